"""scripts/check_sglang_config.py: the comparison of SGLang's reading with the trained layout.

The unit tests feed the comparison a fake SGLang worker result (the JSON that
scripts/sglang_config_worker.py prints) and need no SGLang venv; the last test runs the real
check when ``.venv-sglang`` exists (``make sglang-venv``).
"""

from __future__ import annotations

import copy
import json

import pytest

from dflash_lab.paths import REPO_ROOT
from scripts import check_sglang_config as csc

ACCEPTS = dict.fromkeys(("any", "fa3", "fa4", "triton", "flashinfer", "trtllm_mha"), [])
REFUSES = {b: [f"refused for {b}"] for b in ACCEPTS}


def _config(name: str):
    return csc.exports()[name][0]


def fake_result(config, *, target_scale: float = 1.0) -> dict:
    """What SGLang's code returns for a drafter it reads exactly as trained."""
    want = csc.trained(config)
    layers = [[-1 if w is None else w - 1, "DECODER" if c else "ENCODER_ONLY"]
              for w, c in want["layers"]]
    draft = {k: want[k] for k in ("num_hidden_layers", "block_size", "mask_token_id",
                                  "target_layer_ids", "num_target_layers", "output_multiplier",
                                  "final_logit_softcapping", "attention_value_scale",
                                  "conv_kernel_size", "conv_group_size", "selector_rank",
                                  "selector_top_k", *csc.DOMINO_KEYS)}
    draft["attention_sink_bias"] = want["sinks"]
    lilicorr = {k: want[k] for k in csc.LILICORR_KEYS}
    return {"layers": {"value": layers}, "draft": {"value": draft},
            "lilicorr": {"value": lilicorr if any(v is not None for v in lilicorr.values())
                         else None},
            "model_class": {"value": {"architecture": want["architecture"], "known": True,
                                      "entry_classes": [want["architecture"]]}},
            "sinks_built": {"value": True}, "merges_mask": {"value": True},
            "target": {"value": {"capture_hook": True, "noise_scale_hook": False,
                                 "embedding_scale": target_scale}}}


def test_a_lilicorr_key_sglang_reads_otherwise_fails_the_row():
    config = _config("tiny_cpu_lilicorr")
    result = fake_result(config)
    assert csc.verdict(config, "Qwen3ForCausalLM", result, ACCEPTS)["ok"]
    result["lilicorr"]["value"]["lilicorr_logit_scale"] = 1.0
    v = csc.verdict(config, "Qwen3ForCausalLM", result, ACCEPTS)
    assert not v["ok"] and v["sglang_differs"] == [
        "lilicorr_logit_scale: trained 8.0, SGLang 1.0"]


def test_sglang_reading_the_trained_layout_passes():
    config = _config("tiny_cpu_swa")
    v = csc.verdict(config, "Qwen3ForCausalLM", fake_result(config), ACCEPTS)
    assert v["ok"] and v["sglang_differs"] == [] and v["status"] == "as trained"


def test_a_disagreeing_sglang_fails_with_the_diff_when_the_exporter_accepts():
    config = _config("tiny_cpu_swa")
    result = fake_result(config)
    result["layers"]["value"][1][1] = "DECODER"  # SGLang would run layer 1 causal
    result["draft"]["value"]["attention_sink_bias"] = False  # and drop the sinks
    v = csc.verdict(config, "Qwen3ForCausalLM", result, ACCEPTS)
    assert not v["ok"] and v["status"].startswith("FAIL")
    assert v["sglang_differs"] == ["layer 1: trained W=32 bidir, SGLang W=32 causal",
                                   "sinks: trained True, SGLang False"]
    text = csc.report({"tiny_cpu_swa": v})
    assert "FAIL  tiny_cpu_swa" in text and "0 passed, 1 failed" in text
    assert "SGLang differs: sinks: trained True, SGLang False" in text


def test_a_disagreement_passes_only_if_the_exporter_refuses_every_backend_choice():
    config = _config("tiny_cpu")
    result = fake_result(config)
    result["draft"]["value"]["block_size"] = 16
    assert csc.verdict(config, "Qwen3ForCausalLM", result, REFUSES)["ok"]
    fa3_only = dict(REFUSES, fa3=[])  # `--sglang_attention_backend fa3` would export it
    v = csc.verdict(config, "Qwen3ForCausalLM", result, fa3_only)
    assert not v["ok"] and "['fa3']" in v["status"]


def test_sglang_raising_fails_unless_the_exporter_refused():
    config = _config("tiny_cpu")
    result = fake_result(config)
    result["draft"] = {"error": "ValueError: DFLASH block_size must be positive"}
    v = csc.verdict(config, "Qwen3ForCausalLM", result, ACCEPTS)
    assert not v["ok"] and v["sglang_differs"] == [
        "draft: ValueError: DFLASH block_size must be positive"]
    assert csc.verdict(config, "Qwen3ForCausalLM", result, REFUSES)["ok"]


def test_a_target_without_the_dflash_hook_is_a_disagreement():
    config = _config("tiny_cpu")
    result = fake_result(config)
    result["target"]["value"]["capture_hook"] = False
    v = csc.verdict(config, "Gemma3ForCausalLM", result, ACCEPTS)
    assert not v["ok"] and "set_dflash_layers_to_capture" in v["sglang_differs"][0]


def test_the_real_exporter_refuses_gemma4_scaled_inputs_so_the_check_passes():
    """SGLang feeds Gemma 4 block inputs times sqrt(H); the exporter's decision (its public
    plan_export, every backend choice) must be a refusal for the raw-row recipe."""
    config = _config("gemma4_swa")
    arch = "Gemma4ForConditionalGeneration"
    fed = float(config.hidden_size) ** 0.5
    refused = csc.exporter_refusals(config, arch)
    v = csc.verdict(config, arch, fake_result(config, target_scale=fed), refused)
    assert v["sglang_differs"] == [f"input_embedding_scale: trained 1.0, SGLang {fed!r}"]
    assert v["ok"], v
    assert all(refused.values())


def test_check_all_refuses_another_sglang_version():
    items = {"tiny_cpu": csc.exports()["tiny_cpu"]}
    result = fake_result(items["tiny_cpu"][0])
    worker = {"sglang_version": "0.5.20", "exports": {"tiny_cpu": result}}
    with pytest.raises(SystemExit, match="sglang 0.5.20"):
        csc.check_all(items, worker, refusals_of=lambda c, a, n: ACCEPTS)
    worker["sglang_version"] = csc.SGLANG_VERSION
    assert csc.check_all(items, copy.deepcopy(worker), refusals_of=lambda c, a, n: ACCEPTS)[
        "tiny_cpu"]["ok"]


def test_a_recipe_without_a_row_is_an_error(tmp_path):
    for name in [*csc.RECIPES, "new_recipe"]:
        (tmp_path / f"{name}.yaml").write_text("# @package _global_\n")
    with pytest.raises(ValueError, match=r"\['new_recipe'\].*add \(golden layout, target"):
        csc.exports(tmp_path)


def test_every_shipped_recipe_has_a_row():
    shipped = {p.stem for p in (REPO_ROOT / "recipes").glob("*.yaml")}
    assert shipped <= set(csc.exports()) | set(csc.SGLANG_REFUSED)


def test_the_refused_rows_are_refused_by_the_exporter_naming_sglang():
    """A recipe kept out of the SGLang run is one the exporter itself refuses for SGLang."""
    refused = csc.refused_rows()
    assert set(refused) == set(csc.SGLANG_REFUSED)
    for name, why in refused.items():
        # DSpark: its speculators layout; XPress: a head SGLang does not serve
        assert why and ("SGLang 0.5.23" in why[0] and "speculators" in why[0]
                        or why[0].startswith("sglang does not serve a")), (name, why)


#: written by `make sglang-venv` once the venv is complete
SGLANG_STAMP = csc.SGLANG_PYTHON.parent.parent / ".installed"


@pytest.mark.slow
@pytest.mark.skipif(not SGLANG_STAMP.is_file(),
                    reason=f"needs {SGLANG_STAMP.relative_to(REPO_ROOT)} (SGLang 0.5.23's venv, "
                           "about 6 GB, installed completely): run `make sglang-venv`")
def test_real_sglang_reads_every_recipe_as_trained_or_the_exporter_refuses(tmp_path):
    out = tmp_path / "summary.json"
    assert csc.main(["--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["sglang_version"] == csc.SGLANG_VERSION
    assert set(summary["exports"]) == set(csc.exports())


def test_the_muse_glimmer_rows_are_written_in_the_muse_glimmer_format():
    """SGLang reads a Muse Glimmer export through its MuseGlimmerAssistantConfig (DFlash 1) or
    as the released DFlash 2 Muse layout, DFlash2DraftModel: the rows write those files."""
    items = csc.exports()
    one, two = (csc.written(n, items[n][0]) for n in ("muse_glimmer_dflash1",
                                                       "muse_glimmer_dflash2"))
    assert (one["architectures"], one["model_type"]) == (["MuseGlimmerAssistantModel"],
                                                         "muse_glimmer_assistant")
    assert "dflash_config" not in one and one["is_causal"] is False
    assert two["architectures"] == ["DFlash2DraftModel"]
    assert two["dflash_config"]["output_multiplier"] == 0.19611613513818404
    assert csc.trained(items["muse_glimmer_dflash1"][0], one["architectures"][0])[
        "architecture"] == "MuseGlimmerAssistantModel"
