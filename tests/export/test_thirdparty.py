"""Third-party config.json files: z-lab's field reading (dflash_lab.export.engines.zlab), the layout
resolved by one named engine rule set, one resolution shared by the importer and --inspect, and
--inspect on a directory that holds only config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_lab.export import export_drafter, import_drafter, inspect_dir
from dflash_lab.export.cli import EXIT_REFUSED, EXIT_UNCHECKED, main
from dflash_lab.export.engines.common import NO_ARTIFACTS
from dflash_lab.export.engines.zlab import base_config, block_size
from dflash_lab.export.formats import ZLAB
from dflash_lab.export.formats.base import resolve_third_party
from dflash_lab.export.weights import MASK_FILE, WEIGHTS_FILE, Source, expected_shapes
from dflash_lab.model.config import LayerSpec
from tests.export_doubles import make_config, random_state, write_zlab_dir, zlab_config

ZLAB_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16,
    "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960, "max_window_layers": 5, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
    "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.57.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
#: z-lab DFlash 2 layout: the conv/selector keys and scales in dflash_config, no training spec
ZLAB_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 512,
    "rope_theta": 1e6, "num_target_layers": 6, "block_size": 4,
    "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 3], "block_size": 4,
                      "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 16,
                      "selector_top_k": 4, "output_multiplier": 0.5},
}


def resolved(d, rule_set="vllm-main-v2"):
    return resolve_third_party(d, Path("z-lab"), NO_ARTIFACTS, rule_set, ZLAB)[0]


def config_only_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------------------- field reading
def test_zlab_config_loads_with_its_bookkeeping_keys():
    cfg = base_config(ZLAB_QWEN3_8B, "z-lab/config.json")
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.block_size == 16
    assert cfg.variant == "dflash1" and cfg.output_multiplier == 1.0
    assert resolved(ZLAB_QWEN3_8B).layer_specs() == [LayerSpec(None, False)] * 5


@pytest.mark.parametrize(("where", "key", "hint"), [
    ("dflash_config", "future_knob", ""),
    ("dflash_config", "selector_topk", "did you mean one of 'selector_top_k'"),
    ("top", "attention_value_scale", ""),
    ("top", "output_multipler", "did you mean 'output_multiplier'"),
])
def test_unknown_keys_are_errors(where, key, hint):
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    (d["dflash_config"] if where == "dflash_config" else d)[key] = 3
    with pytest.raises(ValueError, match=f"unknown key '.*{key}'") as err:
        base_config(d, "z-lab/config.json")
    assert hint in str(err.value) and "z-lab/config.json" in str(err.value)


def test_transformers5_rope_parameters_are_read():
    d = {k: v for k, v in ZLAB_QWEN3_8B.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    assert base_config(d, "z").rope_theta == 5e5
    d["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}
    assert base_config(d, "z").rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="disagrees with rope_parameters.rope_theta"):
        base_config(dict(d, rope_theta=1e6), "z")


def test_block_size_is_read_the_zlab_way_and_a_null_is_an_error():
    d = dict(ZLAB_QWEN3_8B, block_size=8)
    assert block_size(d) == 8 and base_config(d, "z").block_size == 8
    d["dflash_config"] = dict(d["dflash_config"], block_size=4)  # dflash_config first
    assert block_size(d) == 4 and base_config(d, "z").block_size == 4
    d["dflash_config"]["block_size"] = None
    with pytest.raises(ValueError, match="z: block_size=None is not an integer"):
        base_config(d, "z")


# ---------------------------------------------------------------------------- layout by a rule set
def test_use_swa_without_sliding_layer_types_slides_every_layer_bidirectionally():
    d = dict(ZLAB_QWEN3_8B, dflash_config={"mask_token_id": 151669, "use_swa": True,
                                           "swa_window_size": 2048,
                                           "target_layer_ids": [1, 9, 17, 25, 33]})
    assert resolved(d).layer_specs() == [LayerSpec(2048, False)] * 5
    assert base_config(d, "z").layer_specs() == [LayerSpec(None, False)] * 5  # no layout read


def test_explicit_is_causal_is_read_in_the_rule_sets_precedence_order():
    base = dict(ZLAB_QWEN3_8B, dflash_config={"mask_token_id": 1, "causal": False,
                                              "target_layer_ids": [1, 9, 17, 25, 33]})
    assert resolved(base).causal_flags == [False] * 5
    assert resolved(dict(base, is_causal=True)).causal_flags == [True] * 5
    # vLLM <= 0.26 never reads the top-level is_causal
    assert resolved(dict(base, is_causal=True), "vllm<=0.26-v2").causal_flags == [False] * 5


# ---------------------------------------------------------------------------- one resolution
def _weights_dir(path: Path, d: dict) -> Path:
    config = resolved(d)
    return write_zlab_dir(path, d, {k: v for k, v in random_state(config).items()
                                    if k in expected_shapes(config)})


def test_importer_and_inspect_resolve_hf_invented_layer_types_identically(tmp_path):
    """No layer_types: transformers' Qwen3Config invents them from use_sliding_window and
    max_window_layers ([full, sliding, sliding] here). The importer and --inspect must resolve
    it the same way (the model config used to read it as all full, so --inspect claimed vLLM
    runs layers 1 and 2 differently from what config.json declares)."""
    d = dict(zlab_config("qwen3_8b"), use_sliding_window=True, sliding_window=8,
             max_window_layers=1)
    path = _weights_dir(tmp_path / "z", d)
    imported = import_drafter(path)
    result = inspect_dir(path, "vllm")
    assert imported.config.layer_specs() == [LayerSpec(None, False), LayerSpec(8, True),
                                             LayerSpec(8, True)]
    assert result.declared == imported.config.layer_specs()
    assert result.assumed_rules == imported.assumed_rules == "vllm-main-v2"
    assert "- vllm-main-v2: yes" in result.text


def test_null_block_size_is_a_problem_for_inspect_and_an_error_for_the_importer(tmp_path):
    d = zlab_config("qwen3_8b")
    path = _weights_dir(tmp_path / "z", d)
    d["dflash_config"]["block_size"] = None
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="block_size=None is not an integer"):
        import_drafter(path)
    assert any("block_size=None is not an integer" in p for p in inspect_dir(path).problems)


# ---------------------------------------------------------------------------- config.json alone
def test_inspect_config_only_export_classifies_layers_and_lists_unmade_checks(tmp_path, capsys):
    config = make_config("zlab_default")
    export_drafter(Source(config, random_state(config), "checkpoint", "test"), tmp_path / "out",
                   dtype="float32")
    full = inspect_dir(tmp_path / "out")
    (tmp_path / "out" / WEIGHTS_FILE).unlink()
    only = inspect_dir(tmp_path / "out")
    assert full.ok and full.unchecked == []
    assert only.readings == full.readings and only.trained == full.trained
    assert only.status == "unchecked" and not only.ok and only.problems == []
    assert [u.split(":")[0] for u in only.unchecked] == [
        "tensor names and shapes against config.json (hidden_size, heads, vocab_size, the fc "
        "input of every target layer)", "attention sinks", "learned mask embedding"]
    assert main(["--inspect", str(tmp_path / "out")]) == EXIT_UNCHECKED
    text = capsys.readouterr().out
    assert "Not checked (no model.safetensors: config.json alone):" in text
    assert "NOT FULLY CHECKED" in text and "OK: every rule set" not in text
    (tmp_path / "out" / MASK_FILE).write_bytes(b"")  # a shipped mask file is seen without weights
    assert not any("mask" in u for u in inspect_dir(tmp_path / "out").unchecked)


def test_inspect_config_only_zlab_dflash2(tmp_path):
    path = config_only_dir(tmp_path / "d2", ZLAB_DFLASH2)
    result = inspect_dir(path)
    assert result.status == "unchecked", result.problems
    assert result.declared == [LayerSpec(None, False)] * 2  # as the importer resolves it
    assert any(u.startswith("DFlash 2 tensors") for u in result.unchecked)
    assert "- variant: dflash2 (DFlash2DraftModel)" in result.text
    assert "weights were not checked" in result.text
    assert main(["--inspect", str(path), "--engine", "vllm"]) == EXIT_UNCHECKED


def test_inspect_config_only_mixed_layout_still_reports_engine_problems(tmp_path, capsys):
    path = config_only_dir(tmp_path / "g", zlab_config("gemma4"))
    result = inspect_dir(path)
    assert result.status == "problems" and result.unchecked
    layer_rows = [line for line in result.text.splitlines() if line.startswith("| 0 |")]
    assert layer_rows and "W=8 causal" in layer_rows[0]
    assert main(["--inspect", str(path)]) == EXIT_REFUSED
    assert "weight check(s) not made" in capsys.readouterr().out
