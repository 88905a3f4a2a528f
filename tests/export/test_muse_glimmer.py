"""The Muse Glimmer assistant format (export/formats/muse_glimmer.py): directories are
written by transformers' own MuseGlimmerAssistantModel.save_pretrained (tests/export_doubles.py);
the import reads every key or refuses it by name, maps the tensor names, resolves the layout
with a named rule set; --inspect shows each engine's reading; re-export round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_lab.export import export_drafter, import_drafter, inspect_dir, load_source
from dflash_lab.export.cli import EXIT_OK, EXIT_REFUSED, main
from dflash_lab.export.engines.common import NO_ARTIFACTS, LayerReading
from dflash_lab.export.formats import read_all
from dflash_lab.model.config import LayerSpec
from tests.export_doubles import muse_state, write_muse_dir

pytest.importorskip("transformers.models.muse_glimmer_assistant")


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    """(directory, the owners' model) of the released layout: two sliding layers, W=16."""
    path = tmp_path_factory.mktemp("muse") / "assistant"
    return path, write_muse_dir(path)


def rewritten(src: Path, dst: Path, **changes) -> Path:
    """A copy of ``src`` whose config.json has ``changes`` (None removes a key)."""
    dst.mkdir()
    d = json.loads((src / "config.json").read_text())
    d.update(changes)
    d = {k: v for k, v in d.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(d))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


# ---------------------------------------------------------------------------- import
def test_import_reads_every_field_the_owners_class_wrote(muse):
    path, model = muse
    imported = import_drafter(path)
    cfg = imported.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (32, 2, 4, 2, 8, 64)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (4, 7, [1, 3])
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 500000.0
    assert cfg.max_position_embeddings == 512 and cfg.variant == "dflash1"
    # every layer sliding W=16 and bidirectional: vLLM's config class defaults causal to False
    assert cfg.layer_specs() == [LayerSpec(16, False)] * 2
    assert imported.assumed_rules == "vllm-main-v2"
    assert "vllm-main-v2" in cfg._source
    # no vocab_size in the format: vLLM's default until a target is given
    assert cfg.vocab_size == 202048 and imported.vocab_recorded is False
    assert any("no vocab_size" in n for n in imported.format_notes)
    assert any("|q - k| <= 16" in n for n in imported.format_notes)


def test_tensor_names_are_mapped_to_ours(muse):
    path, model = muse
    theirs = model.state_dict()
    state = import_drafter(path).state_dict
    assert torch.equal(state["fc.weight"], theirs["encoder.fc.weight"])
    assert torch.equal(state["hidden_norm.weight"], theirs["encoder.output_norm_enc.weight"])
    assert state.keys() == muse_state(model).keys()
    assert all(torch.equal(state[k], v) for k, v in muse_state(model).items())


def test_load_source_records_what_the_format_leaves_out(muse):
    source = load_source(muse[0])
    assert source.description.startswith("Muse Glimmer directory")
    assert source.vocab_recorded is False and source.depth_recorded is False
    assert source.mask_differences and "|q - k| <= 16" in source.mask_differences[0]
    assert "causality resolved by vllm-main-v2" in source.notes


@pytest.mark.parametrize(("changes", "message"), [
    ({"future_knob": 1}, r"unknown key 'future_knob'"),
    ({"mask_token_idx": 7}, r"unknown key 'mask_token_idx' \(did you mean one of 'mask_token_id'"),
    ({"dflash_config": {"causal": True}}, r"key 'dflash_config' is not part of the Muse Glimmer"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ({"rms_norm_eps": None}, r"missing \['rms_norm_eps'\]: MuseGlimmerAssistantConfig"),
    ({"layer_types": None}, r"missing \['layer_types'\]"),
    ({"block_size": 4.0}, r"block_size=4.0 is not an integer"),
])
def test_unsupported_keys_are_errors_naming_key_and_file(muse, tmp_path, changes, message):
    path = rewritten(muse[0], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message) as err:
        import_drafter(path)
    assert str(path / "config.json") in str(err.value)


def test_declared_is_causal_wins_in_both_engines(muse, tmp_path):
    path = rewritten(muse[0], tmp_path / "causal", is_causal=True)
    assert import_drafter(path).config.layer_specs() == [LayerSpec(16, True)] * 2
    readings = read_all(json.loads((path / "config.json").read_text()), NO_ARTIFACTS)
    assert readings["vllm-main-v1"].layers == [LayerReading(16, True)] * 2
    assert readings["sglang==0.5.23"].layers[0].causal is True
    assert readings["sglang<#34262"].layers[0].causal is True  # sliding -> causal there


# ---------------------------------------------------------------------------- engine readings
def test_each_engine_reads_the_released_layout_bidirectional(muse):
    d = json.loads((muse[0] / "config.json").read_text())
    readings = read_all(d, NO_ARTIFACTS)
    for name in ("vllm-main-v1", "vllm-main-v2", "vllm<=0.26-v2", "sglang==0.5.23",
                 "sglang#34524", "sglang#34262..#34524"):
        assert [(r.window, r.causal) for r in readings[name].layers] == [(16, False)] * 2, name
    # SGLang before #34262 read no is_causal: its default made sliding layers causal
    assert [r.causal for r in readings["sglang<#34262"].layers] == [True, True]
    assert "MuseGlimmerAssistantConfig" in readings["vllm-main-v1"].notes[-1]


def test_without_layer_types_the_engines_and_the_owners_disagree(muse):
    """The owners' class fills every layer sliding; vLLM's Qwen3Config-based class invents
    full layers (max_window_layers 28), SGLang's keeps none (every layer full)."""
    d = {k: v for k, v in json.loads((muse[0] / "config.json").read_text()).items()
         if k != "layer_types"}
    readings = read_all(d, NO_ARTIFACTS)
    assert [r.window for r in readings["vllm-main-v2"].layers] == [None, None]
    assert [r.window for r in readings["sglang==0.5.23"].layers] == [None, None]


def test_mixed_layer_types_are_refused_by_vllms_v1_runner(muse):
    d = dict(json.loads((muse[0] / "config.json").read_text()),
             layer_types=["sliding_attention", "full_attention"])
    readings = read_all(d, NO_ARTIFACTS)
    assert "V2 model runner" in readings["vllm-main-v1"].refusal
    assert [(r.window, r.causal) for r in readings["vllm-main-v2"].layers] == [(16, False),
                                                                               (None, False)]


# ---------------------------------------------------------------------------- --inspect
def test_inspect_shows_every_rule_sets_reading_and_the_disagreements(muse):
    result = inspect_dir(muse[0])
    assert result.assumed_rules == "vllm-main-v2"
    assert result.declared == [LayerSpec(16, False)] * 2
    rows = [line for line in result.text.splitlines() if line.startswith("| 0 |")]
    assert rows and rows[0].count("W=16 bidir") >= 6 and "W=16 causal" in rows[0]
    assert ("layer 0: vllm-main-v1 runs 'W=16 bidir' but sglang<#34262 runs 'W=16 causal'"
            in result.problems)
    # the weights are checked under our names: nothing missing or unexpected
    assert not any("model.safetensors" in p for p in result.problems)


# ---------------------------------------------------------------------------- re-export
def test_reexport_round_trips_bit_identical(muse, tmp_path):
    path, model = muse
    out = tmp_path / "ours"
    export_drafter(path, out, dtype="float32", engine="vllm")
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == import_drafter(path).state_dict.keys()
    theirs = muse_state(model)
    assert all(torch.equal(saved[k], theirs[k]) for k in saved)
    back = import_drafter(out)
    assert back.assumed_rules == "dflash_lab training spec"
    assert back.config.layer_specs() == [LayerSpec(16, False)] * 2
    assert (back.config.rope_theta, back.config.rms_norm_eps) == (500000.0, 1e-5)
    assert back.config.vocab_size == 202048  # no --target: the assumed vocabulary is written
    report = (out / "EXPORT_REPORT.md").read_text()
    assert "no vocab_size" in report


def test_reexport_takes_the_targets_vocabulary(muse, tmp_path):
    target = {"hidden_size": 32, "vocab_size": 300, "num_hidden_layers": 6}
    export_drafter(muse[0], tmp_path / "ours", dtype="float32", engine="vllm", target=target)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["vocab_size"] == 300


def test_command_line_inspect_and_export(muse, tmp_path, capsys):
    """dflash-export --inspect DIR and dflash-export DIR OUT: SGLang's trtllm_mha backend runs
    the bidirectional sliding layers block-anchored, so the default (every SGLang draft backend)
    refuses; naming the backend exports, and --target gives the vocabulary."""
    path = muse[0]
    assert main(["--inspect", str(path)]) == EXIT_REFUSED
    assert "sglang==0.5.23+trtllm_mha runs 'W=16 bidir block-end'" in capsys.readouterr().out
    assert main([str(path), str(tmp_path / "a"), "--dtype", "float32"]) == EXIT_REFUSED
    (tmp_path / "target.json").write_text(json.dumps(
        {"hidden_size": 32, "vocab_size": 300, "num_hidden_layers": 6}))
    assert main([str(path), str(tmp_path / "b"), "--dtype", "float32", "--target",
                 str(tmp_path / "target.json"), "--sglang_attention_backend", "fa3"]) == EXIT_OK
    assert import_drafter(tmp_path / "b").config.vocab_size == 300
