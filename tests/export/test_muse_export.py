"""dflash-export --format muse-glimmer: our drafter written in the Muse Glimmer assistant layout.

The exported directory must be what transformers' own MuseGlimmerAssistantModel loads and runs as
our drafter (same forward while the window convention does not bind), what our importer reads
back bit-identical, and what every engine rule set (formats/muse_glimmer.py) runs as trained;
whatever the format cannot carry is refused by name before anything is written."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_lab.export import export_drafter, formats, import_drafter, inspect_dir
from dflash_lab.export.cli import EXIT_OK, EXIT_USAGE, main
from dflash_lab.export.formats.muse_glimmer import MUSE_GLIMMER
from dflash_lab.model.config import DrafterConfig, LayerSpec
from tests.export_doubles import BASE, S, random_state, write_checkpoint, write_muse_dir

pytest.importorskip("transformers.models.muse_glimmer_assistant")

W = 16  #: the window of the sliding layout (block_size 4 from BASE)
#: The released Muse Glimmer layout at BASE's sizes: every layer sliding and bidirectional
SLIDING_BIDIR = dict(layer_types=[S, S, S], sliding_window=W, is_causal=False,
                     rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=512)
FULL_BIDIR = dict(is_causal=False)
#: SGLang's trtllm_mha draft backend runs bidirectional sliding layers block-anchored
#: (engines/sglang.py), so sliding exports name a backend that runs them as trained
SGLANG_FA3 = dict(sglang_backend="fa3")


def config_of(**layout) -> DrafterConfig:
    return DrafterConfig(**{**BASE, **layout})


@pytest.fixture
def checkpoint(tmp_path):
    config = config_of(**SLIDING_BIDIR)
    state = random_state(config)
    return write_checkpoint(tmp_path / "run" / "last.ckpt", config, state), config, state


def exported(ckpt: Path, out: Path, **kw) -> Path:
    export_drafter(ckpt, out, dtype="float32", format="muse-glimmer", **{**SGLANG_FA3, **kw})
    return out


def owners_model(path: Path):
    from transformers import MuseGlimmerAssistantModel

    return MuseGlimmerAssistantModel.from_pretrained(path, attn_implementation="eager").eval()


# ---------------------------------------------------------------------------- files
def test_round_trip_config_and_weights_bit_identical(checkpoint, tmp_path):
    ckpt, config, state = checkpoint
    out = exported(ckpt, tmp_path / "muse")
    assert sorted(p.name for p in out.iterdir()) == ["EXPORT_REPORT.md", "SHA256SUMS",
                                                     "config.json", "model.safetensors"]
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["MuseGlimmerAssistantModel"]
    assert raw["model_type"] == "muse_glimmer_assistant"
    assert (raw["layer_types"], raw["sliding_window"], raw["is_causal"]) == ([S] * 3, W, False)
    assert "dflash_config" not in raw and "dflash_lab_training_spec" not in raw
    back = import_drafter(out)
    assert back.config == config  # every field (the dataclass compares all but _source)
    assert back.config.layer_specs() == [LayerSpec(W, False)] * 3
    assert back.assumed_rules == "vllm-main-v2"  # the two known exceptions (see --inspect)
    assert back.disagreements == ["sglang==0.5.23+trtllm_mha: reads it differently",
                                  "sglang<#34262: reads it differently"]
    saved = load_file(str(out / "model.safetensors"))
    assert "encoder.fc.weight" in saved and "encoder.output_norm_enc.weight" in saved
    assert back.state_dict.keys() == state.keys()
    assert all(torch.equal(back.state_dict[k], state[k]) for k in state)


def test_the_owners_class_writes_the_same_config_and_tensor_names(checkpoint, tmp_path):
    """Loaded and re-saved by MuseGlimmerAssistantModel, every key it writes has our value, and
    its tensors carry our exported names."""
    out = exported(checkpoint[0], tmp_path / "muse")
    model = owners_model(out)
    model.save_pretrained(tmp_path / "resaved")
    ours = json.loads((out / "config.json").read_text())
    theirs = json.loads((tmp_path / "resaved" / "config.json").read_text())
    theirs.pop("transformers_version")
    assert {k: ours.get(k, "<missing>") for k in theirs} == theirs
    assert set(model.state_dict()) == set(load_file(str(out / "model.safetensors")))


def test_an_all_full_layout_leaves_sliding_window_out(tmp_path):
    """The owners' config refuses sliding_window null; no layer slides, so none is written."""
    config = config_of(**FULL_BIDIR)
    ckpt = write_checkpoint(tmp_path / "c.ckpt", config, random_state(config))
    out = exported(ckpt, tmp_path / "muse")
    raw = json.loads((out / "config.json").read_text())
    assert "sliding_window" not in raw and raw["use_sliding_window"] is False
    assert owners_model(out).config.layer_types == ["full_attention"] * 3
    assert import_drafter(out).config == config


def test_a_muse_directory_re_exported_keeps_the_owners_values(tmp_path):
    """Muse Glimmer dir -> --format muse-glimmer: every key the owners' class wrote is
    written again with its value (no vocab_size invented without --target)."""
    src = tmp_path / "assistant"
    write_muse_dir(src)
    out = tmp_path / "muse"
    export_drafter(src, out, dtype="float32", format="muse-glimmer", **SGLANG_FA3)
    theirs = json.loads((src / "config.json").read_text())
    ours = json.loads((out / "config.json").read_text())
    differ = {k for k in theirs if ours.get(k) != theirs[k]}
    assert differ == {"transformers_version", "bos_token_id", "eos_token_id", "pad_token_id"}
    assert "vocab_size" not in ours
    assert load_file(str(out / "model.safetensors")).keys() \
        == load_file(str(src / "model.safetensors")).keys()


# ---------------------------------------------------------------------------- the owners' forward
def _forwards(out: Path, config: DrafterConfig, state: dict, num_ctx: int):
    """(the owners' model's hidden, our drafter's hidden) for one block after num_ctx context
    positions: anchor + MASK slots embedded by one random table."""
    from transformers.cache_utils import DFlashCache

    from dflash_lab.model.drafter import DFlashDrafter

    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, num_ctx, len(config.target_layer_ids) * config.hidden_size,
                        generator=gen)
    table = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    torch.nn.init.normal_(table.weight, generator=gen)
    anchor = torch.tensor([11])
    ids = torch.full((1, config.block_size), config.mask_token_id)
    ids[0, 0] = anchor
    model = owners_model(out)
    # as the owners' generation runs it: a DFlashCache told how many context positions this
    # call adds (without one their mask spans the block alone and no context key is windowed)
    cache = DFlashCache(config=model.config)
    cache.set_previous_accepted_tokens(num_ctx)
    with torch.no_grad():
        theirs = model(noise_embeds=table(ids), context_hidden_states=feats,
                       cache=cache).last_hidden_state
    drafter = DFlashDrafter(config, backend="sdpa").eval()
    drafter.load_state_dict(state, strict=True)
    cache = drafter.new_cache()
    drafter.extend_context(cache, feats)
    return theirs, drafter.draft(cache, anchor, table)


def test_the_owners_forward_equals_ours_while_the_window_does_not_bind(checkpoint, tmp_path):
    """context + block <= W: no key lies W positions from a query, so |q - k| <= W (theirs)
    and |q - k| < W (ours, the engines') keep the same keys."""
    ckpt, config, state = checkpoint
    out = exported(ckpt, tmp_path / "muse")
    num_ctx = W - config.block_size
    theirs, ours = _forwards(out, config, state, num_ctx)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_the_owners_class_keeps_one_key_more_per_side_when_the_window_binds(checkpoint,
                                                                           tmp_path):
    """A longer context: the owners' class runs window W as ours runs W + 1 (their sliding mask
    keeps |q - k| <= W); vLLM and SGLang run W as trained, and --inspect says so."""
    ckpt, config, state = checkpoint
    out = exported(ckpt, tmp_path / "muse")
    theirs, ours = _forwards(out, config, state, num_ctx=2 * W)
    assert (theirs - ours).abs().max() > 1e-3
    wider = dataclasses.replace(config, sliding_window=W + 1)
    _, ours_wider = _forwards(out, wider, state, num_ctx=2 * W)
    torch.testing.assert_close(theirs, ours_wider, rtol=1e-5, atol=1e-5)
    text = inspect_dir(out).text
    assert "Muse Glimmer format notes:" in text and f"|q - k| <= {W}" in text
    assert f"|q - k| <= {W}" in (out / "EXPORT_REPORT.md").read_text()


# ---------------------------------------------------------------------------- engines
def test_inspect_shows_every_rule_set_running_a_full_layout_as_trained(tmp_path):
    config = config_of(**FULL_BIDIR)
    ckpt = write_checkpoint(tmp_path / "c.ckpt", config, random_state(config))
    result = inspect_dir(exported(ckpt, tmp_path / "muse"))
    assert result.ok, result.problems
    assert result.declared == [LayerSpec(None, False)] * 3
    assert all(r.layers and [x.label() for x in r.layers] == ["full bidir"] * 3
               for r in result.readings.values())


def test_inspect_of_a_sliding_export_names_only_the_known_exceptions(checkpoint, tmp_path):
    """Every vLLM rule set and SGLang's symmetric-window backends run W=16 bidirectional; the
    two known exceptions are SGLang's block-anchored trtllm_mha backend and SGLang before
    #34262 (no is_causal read): the same as for the owners' own directories."""
    result = inspect_dir(exported(checkpoint[0], tmp_path / "muse"))
    assert result.declared == [LayerSpec(W, False)] * 3
    as_trained = {name for name, r in result.readings.items()
                  if r.layers and all((x.window, x.causal) == (W, False) for x in r.layers)}
    assert {"vllm-main-v1", "vllm-main-v2", "sglang#34524"} <= as_trained
    others = set(result.readings) - as_trained
    assert others <= {"sglang<#34262"} | {n for n in result.readings if "trtllm" in n}
    assert all("trtllm" in p or "sglang<#34262" in p for p in result.problems)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("layout", "message"), [
    (dict(draft_vocab_size=50, is_causal=False), r"the fields \['draft_vocab_size'\]"),
    (dict(learned_mask_embedding=True, is_causal=False), r"carry a learned mask embedding: "),
    (dict(attention_sink_bias=True, is_causal=False), r"the fields \['attention_sink_bias'\]"),
    (dict(attention_bias=True, is_causal=False), r"the fields \['attention_bias'\]"),
    (dict(output_multiplier=0.5, is_causal=False), r"the fields \['output_multiplier'\]"),
    (dict(aux_hidden_norms=True, attention_gate="per-head", is_causal=False),
     r"the fields \['aux_hidden_norms', 'attention_gate'\]"),
    (dict(is_causal=True), r"causal layers \[0, 1, 2\]: MuseGlimmerAssistantAttention runs.*"
                           r"the fields \['is_causal'\]"),
    (dict(is_causal=[True, False, True]), r"per-layer causality \(layers \[0, 2\] causal"),
    (dict(layer_types=[S, S, "full_attention"], sliding_window=8), r"per-layer causality"),
])
def test_what_the_format_cannot_carry_is_named(layout, message):
    """The fields lost in the write -> read round trip, each by name, and why the owners'
    class runs it otherwise (engine_problems) where the round trip cannot see it."""
    with pytest.raises(ValueError, match="cannot be exported --format muse-glimmer") as err:
        formats.write_config("muse-glimmer", config_of(**layout), "float32", None, True)
    assert re.search(message, str(err.value)), str(err.value)


def test_a_refusal_writes_nothing_and_names_the_fix(tmp_path, capsys):
    config = config_of(is_causal=True)
    ckpt = write_checkpoint(tmp_path / "c.ckpt", config, random_state(config))
    with pytest.raises(ValueError, match=r"cannot be exported --format muse-glimmer.*Fix: "
                                         r"export it in dflash-lab's own format"):
        export_drafter(ckpt, tmp_path / "out", format="muse-glimmer")
    assert main([str(ckpt), str(tmp_path / "out"), "--format", "muse-glimmer"]) == EXIT_USAGE
    assert "omit --format muse-glimmer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert MUSE_GLIMMER.engine_problems(config_of(**SLIDING_BIDIR)) == []


def test_command_line_format_option(checkpoint, tmp_path, capsys):
    ckpt = checkpoint[0]
    out = tmp_path / "muse"
    assert main([str(ckpt), str(out), "--format", "muse-glimmer", "--dtype", "float32",
                 "--sglang_attention_backend", "fa3"]) == EXIT_OK
    report = (out / "EXPORT_REPORT.md").read_text()
    assert "muse-glimmer (MuseGlimmerAssistantModel)" in report
    assert "-> ok" in report and "MISMATCH" not in report
    assert json.loads((out / "config.json").read_text())["model_type"] == "muse_glimmer_assistant"
    # the default format is still ours
    assert main([str(ckpt), str(tmp_path / "ours"), "--dtype", "float32",
                 "--sglang_attention_backend", "fa3"]) == EXIT_OK
    assert "dflash_lab_training_spec" in json.loads((tmp_path / "ours" / "config.json")
                                                    .read_text())


# ---------------------------------------------------------------------------- vLLM's target layers
def test_the_export_names_the_target_layers_vllm_must_capture(checkpoint, tmp_path):
    """vLLM 0.32 captures ``eagle_aux_hidden_state_layer_ids`` (our ids + 1); without it, for
    this format, the target's EAGLE-3 default (2, L // 2, L - 3): the export writes the key, a
    file without it is noted where the default differs, and a wrong value is refused."""
    out = exported(checkpoint[0], tmp_path / "muse")
    raw = json.loads((out / "config.json").read_text())
    ids = checkpoint[1].target_layer_ids
    assert raw["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]
    assert not any("eagle_aux" in n for n in import_drafter(out).format_notes)
    depth = raw["num_target_layers"]
    assert [2, depth // 2, depth - 3] != [i + 1 for i in ids]  # the default would be wrong
    del raw["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(raw))
    notes = import_drafter(out, verify=False).format_notes
    assert any(f"vLLM 0.32 captures the target's EAGLE-3 default layers "
               f"{[2, depth // 2, depth - 3]}" in n for n in notes), notes
    raw["eagle_aux_hidden_state_layer_ids"] = [i + 2 for i in ids]
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids=.* is not "
                                         "target_layer_ids \\+ 1"):
        import_drafter(out, verify=False)
