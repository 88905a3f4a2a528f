"""Engine rule emulation, config.json contents and refusal rules (no files written)."""

from __future__ import annotations

import pytest

from dflash_lab.export.api import plan_export, serving_config
from dflash_lab.export.checks import REFUSE, WARN, refusals
from dflash_lab.export.engines import Artifacts
from dflash_lab.export.engines.common import hf_view
from dflash_lab.export.formats import read_all
from dflash_lab.model.config import TRAINING_SPEC_KEY
from tests.export_doubles import LAYOUTS, F, S, make_config, zlab_config

CAUSAL, BIDIR = "causal", "bidir"


def labels(reading):
    return None if reading.layers is None else [r.label() for r in reading.layers]


# ---------------------------------------------------------------------------- config.json
def test_config_json_keys_zlab_default():
    d = serving_config(make_config("zlab_default"), "bfloat16")
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["hidden_act"] == "silu" and d["tie_word_embeddings"] is False
    assert d["rope_theta"] == 1_000_000.0 and d["torch_dtype"] == "bfloat16"
    assert d["layer_types"] == [F, F, F]
    assert d["use_sliding_window"] is False and d["sliding_window"] is None
    assert d["is_causal"] is False
    assert d["block_size"] == 4 and d["num_target_layers"] == 6
    assert d["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 2, 3],
                                  "block_size": 4, "attention_sink_bias": False, "causal": False,
                                  "sample_from_anchor": False}  # always explicit
    assert "embed_tokens" not in str(d) and "lm_head" not in str(d)


def test_config_json_keys_sliding_causal():
    d = serving_config(make_config("all_sliding_causal"), "float32")
    assert d["layer_types"] == [S, S, S]
    assert d["use_sliding_window"] is True and d["sliding_window"] == 8
    assert d["max_window_layers"] == 3
    assert d["is_causal"] is True and d["dflash_config"]["causal"] is True
    assert d["dflash_config"]["swa_window_size"] == 8
    assert "use_swa" not in d["dflash_config"]


def test_config_json_keys_gemma_mixed_declares_no_causality():
    """A single flag cannot describe 'sliding causal + full bidirectional': write neither."""
    d = serving_config(make_config("gemma_mixed"), "bfloat16")
    assert "is_causal" not in d and "causal" not in d["dflash_config"]
    assert d["layer_types"] == [S, S, F]
    assert d[TRAINING_SPEC_KEY]["layer_specs"] == [
        {"window": 8, "causal": True}, {"window": 8, "causal": True},
        {"window": None, "causal": False}]


def test_config_json_keys_mimo():
    d = serving_config(make_config("mimo"), "bfloat16")
    assert d["is_causal"] is False and d["dflash_config"]["causal"] is False
    assert d["dflash_config"]["attention_sink_bias"] is True
    assert d[TRAINING_SPEC_KEY]["learned_mask_embedding"] is True


# ---------------------------------------------------------------------------- readings
EXPECTED_CURRENT = {
    "zlab_default": ["full bidir"] * 3,
    "all_sliding_causal": ["W=8 causal"] * 3,
    "gemma_mixed": ["W=8 causal", "W=8 causal", "full bidir"],
}


@pytest.mark.parametrize("layout", list(EXPECTED_CURRENT))
def test_current_engines_read_what_was_trained(layout):
    config = make_config(layout)
    readings = read_all(config.to_dict(), Artifacts())
    assert labels(readings["vllm-main-v2"]) == EXPECTED_CURRENT[layout]
    sglang = [x.replace(" left-only", "") for x in labels(readings["sglang==0.5.23"])]
    assert sglang == EXPECTED_CURRENT[layout]


def test_vllm_v1_refuses_mixed_layer_types_only():
    assert read_all(make_config("gemma_mixed").to_dict(), Artifacts())["vllm-main-v1"].layers \
        is None
    assert read_all(make_config("all_sliding_causal").to_dict(), Artifacts())[
        "vllm-main-v1"].loads


def test_mimo_readings_and_dropped_features():
    config = make_config("mimo")
    readings = read_all(config.to_dict(), Artifacts(True, True))
    assert labels(readings["vllm-main-v2"]) == ["W=8 bidir"] * 3
    assert readings["vllm-main-v2"].dropped == []
    assert readings["sglang==0.5.23"].dropped == []  # 0.5.23 serves both
    dropped = " ".join(readings["sglang#34524"].dropped)
    assert "mask_embedding.pt" in dropped and "attention_sink_bias" in dropped


def test_vllm_legacy_ignores_top_level_is_causal():
    d = make_config("zlab_default", is_causal=True).to_dict()
    d["dflash_config"].pop("causal")
    readings = read_all(d, Artifacts())
    assert labels(readings["vllm-main-v2"]) == ["full causal"] * 3
    assert labels(readings["vllm<=0.26-v2"]) == ["full bidir"] * 3


def test_vllm_v1_uses_one_causal_flag():
    d = make_config("zlab_default", is_causal=True).to_dict()
    d["dflash_config"]["causal"] = None  # no override: legacy per-type rule decides in 0.26
    d["is_causal"] = None
    d["layer_types"] = [F, F, F]
    assert labels(read_all(d, Artifacts())["vllm-main-v1"]) == ["full bidir"] * 3


def test_hf_view_matches_transformers_qwen3config():
    transformers = pytest.importorskip("transformers")
    for extra in ({}, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                  {"use_sliding_window": False, "sliding_window": 8},
                  {"layer_types": [S, F, S], "use_sliding_window": True, "sliding_window": 8}):
        d = {**zlab_config("qwen3_8b"), **extra}
        q = transformers.Qwen3Config.from_dict(dict(d))
        view = hf_view(d)
        assert view.layer_types == q.layer_types and view.sliding_window == q.sliding_window


# ---------------------------------------------------------------------------- z-lab configs
def test_zlab_qwen3_8b_style_all_engines_full_bidirectional():
    readings = read_all(zlab_config("qwen3_8b"), Artifacts())
    for reading in readings.values():
        assert [x.replace(" left-only", "") for x in labels(reading)] == ["full bidir"] * 3


def test_zlab_gemma4_style_implicit_causality():
    readings = read_all(zlab_config("gemma4"), Artifacts())
    assert labels(readings["vllm-main-v2"]) == ["W=8 causal", "W=8 causal", "full bidir"]
    assert readings["vllm-main-v1"].layers is None
    assert labels(readings["sglang==0.5.23"])[:2] == ["W=8 causal", "W=8 causal"]
    # the seed regression: SGLang between #34262 and #34524 makes the sliding layers bidirectional
    assert [r.causal for r in readings["sglang#34262..#34524"].layers] == [False] * 3


def test_zlab_mimo_style_use_swa_without_layer_types():
    readings = read_all(zlab_config("mimo"), Artifacts(True, True))
    assert labels(readings["vllm-main-v2"]) == ["W=8 bidir"] * 3
    assert labels(readings["vllm-main-v1"]) == ["W=8 bidir"] * 3
    assert [x.replace(" left-only", "") for x in labels(readings["sglang==0.5.23"])] == \
        ["full bidir"] * 3
    assert any("use_swa" in item for item in readings["sglang==0.5.23"].dropped)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("layout", ["zlab_default", "all_sliding_causal", "gemma_mixed"])
def test_servable_layouts_are_not_refused(layout):
    _, findings = plan_export(make_config(layout), ("vllm", "sglang"))
    assert refusals(findings) == []


def test_gemma_mixed_warns_about_v2_runner_and_old_sglang():
    _, findings = plan_export(make_config("gemma_mixed"), ("vllm", "sglang"))
    text = " ".join(f.message for f in findings if f.severity == WARN)
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in text and "#34524" in text
    assert any(f.rule_set == "sglang#34262..#34524" and f.layer == 0 for f in findings)


def test_illegal_mixed_causality_is_refused():
    _, findings = plan_export(make_config("illegal_mixed"), ("vllm",))
    bad = refusals(findings)
    assert bad and "cannot be declared" in bad[0].message
    assert {f.layer for f in bad if f.rule_set == "vllm-main-v2"} == {0, 2}


def test_mimo_refused_for_old_sglang_but_fine_for_vllm():
    assert refusals(plan_export(make_config("mimo"), ("vllm",))[1]) == []
    bad = refusals(plan_export(make_config("mimo"), ("vllm", "sglang"),
                               sglang_version="#34524")[1])
    text = " ".join(f.message for f in bad)
    assert "mask_embedding.pt" in text and "attention_sink_bias" in text
    assert all(f.rule_set == "sglang#34524" for f in bad)


def test_bidirectional_window_smaller_than_block_refused_for_sglang():
    config = make_config("all_sliding_causal", is_causal=False, sliding_window=3)  # W=3 < B=4
    assert refusals(plan_export(config, ("vllm",))[1]) == []
    bad = refusals(plan_export(config, ("sglang",), sglang_backend="flashinfer")[1])
    assert len(bad) == 3 and "sliding_window >= block_size" in bad[0].message
    # W >= B: symmetric and left-only windows see the same keys
    ok = make_config("all_sliding_causal", is_causal=False, sliding_window=4)
    assert refusals(plan_export(ok, ("sglang",), sglang_backend="flashinfer")[1]) == []


def test_allow_lossy_downgrades_engine_refusals():
    _, findings = plan_export(make_config("mimo"), ("sglang",), allow_lossy=True)
    assert refusals(findings) == []
    assert any(f.message.startswith("ALLOWED LOSSY") for f in findings)


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size"])
def test_target_size_mismatch_refused_even_with_allow_lossy(key):
    target = {"hidden_size": 32, "vocab_size": 300, "num_hidden_layers": 6}
    target[key] += 1
    _, findings = plan_export(make_config("zlab_default"), ("vllm",), target=target,
                              allow_lossy=True)
    bad = refusals(findings)
    assert len(bad) == 1 and key in bad[0].message and bad[0].severity == REFUSE


def test_target_layer_ids_beyond_target_refused_and_text_config_read():
    target = {"text_config": {"hidden_size": 32, "vocab_size": 300, "num_hidden_layers": 3}}
    bad = refusals(plan_export(make_config("zlab_default"), ("vllm",), target=target)[1])
    assert len(bad) == 1 and "target_layer_ids" in bad[0].message


def test_every_layout_is_covered():
    assert set(LAYOUTS) == {"zlab_default", "all_sliding_causal", "gemma_mixed", "mimo",
                            "illegal_mixed"}
