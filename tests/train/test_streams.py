"""Training drafters of a multi-stream target (a tiny random DeepseekV4ForCausalLM, 4 residual
streams): a few steps on online features and on a capture, for both widths a drafter can read
(the stream mean, served by vLLM and SGLang, and the flattened streams), then export, import
and a lossless speculative decode on the target with the exported drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.paths import CONF_DIR
from dflash_lab.targets.loader import load_target
from dflash_lab.targets.tiny import MASK_TOKEN
from tests.tiny_archs import DEEPSEEK_V4_STREAMS, build_tiny_arch_target

H = 64
LAYERS = [1, 3]


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory, tiny_target_dir):
    return build_tiny_arch_target("deepseek_v4", tmp_path_factory.mktemp("dsv4") / "t",
                                  tiny_target_dir, num_hidden_layers=6)


@pytest.fixture(scope="module")
def ds(ds_dir):
    return load_target(str(ds_dir), dtype="float32", device="cpu")


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _overrides(ds, ds_dir: Path, out: Path, width: int | None) -> list[str]:
    return ["target=hf", f"target.name_or_path={ds_dir}", "target.dtype=float32",
            "target.device=cpu", f"drafter.target_layer_ids={LAYERS}",
            f"drafter.mask_token_id={ds.token_id(MASK_TOKEN)}", "drafter.num_hidden_layers=1",
            "drafter.block_size=4", "drafter.backend=sdpa", "logger=none",
            f"paths.output_dir={out}", "trainer=cpu", "trainer.max_steps=3",
            "trainer.max_epochs=1", "data.batch_size=4", "data.num_workers=0",
            "module.num_anchors=8", "export.dtype=float32"] + (
        [f"drafter.target_hidden_size={width}"] if width else [])


@pytest.mark.parametrize("width", [None, DEEPSEEK_V4_STREAMS * H])
def test_online_training_exports_and_decodes_losslessly(ds, ds_dir, tmp_path, width):
    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.eval.loop import DecodeSettings, baseline_generate, speculative_generate
    from dflash_lab.eval.prompts import encode_prompt
    from dflash_lab.eval.proposer import DFlashProposer
    from dflash_lab.eval.target_runner import TargetRunner
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.train.run import train

    run = train(_compose(_overrides(ds, ds_dir, tmp_path / "run", width) + [
        "data=online", "data.path=demo", "data.demo_rows=16",
        f"data.demo_file={tmp_path / 'demo.jsonl'}", "data.max_length=64",
        "data.val_fraction=0.25", "export.enabled=true",
        f"export.allow_lossy={'true' if width else 'false'}"]))
    per_layer = width or H
    assert run["val_tau_after"] >= 1.0
    out = Path(run["export_dir"])
    written = json.loads((out / "config.json").read_text())
    assert written.get("target_hidden_size") == width
    loaded = load_drafter(out)
    assert loaded.drafter.fc.weight.shape == (H, len(LAYERS) * per_layer)
    report = (out / "EXPORT_REPORT.md").read_text()
    assert f"fc reads 2 target layers x {per_layer}" in report
    pieces = ds.pieces()
    proposer = DFlashProposer(loaded.drafter, pieces.embed_tokens, pieces.lm_head)
    settings = DecodeSettings(max_new_tokens=16)
    for conv in demo_conversations(2, seed=9):
        prompt = encode_prompt(ds.tokenizer, conv[:1])
        base = baseline_generate(TargetRunner(ds.model), prompt, settings)
        spec = speculative_generate(TargetRunner(ds.model, LAYERS, width), proposer, prompt,
                                    settings)
        assert spec.output_ids == base.output_ids


@pytest.mark.parametrize("width", [None, DEEPSEEK_V4_STREAMS * H])
def test_offline_training_checks_the_capture_width(ds, ds_dir, tmp_path, width):
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.train.run import train

    rows = [{"messages": c} for c in demo_conversations(12, seed=4)]
    run_capture(ds, rows, CaptureSettings(out_dir=str(tmp_path / "cap"), target_layer_ids=LAYERS,
                                          max_length=64, hidden_dtype="float32",
                                          target_hidden_size=width),
                {"path": "demo"}, progress=False)
    base = _overrides(ds, ds_dir, tmp_path / "run", width) + [
        "data=offline", f"data.path={tmp_path / 'cap'}", "export.enabled=false"]
    result = train(_compose(base))
    assert result["val_tau_after"] >= 1.0
    other = DEEPSEEK_V4_STREAMS * H if width is None else H
    mismatched = [o for o in base if not o.startswith("drafter.target_hidden_size")]
    with pytest.raises(ValueError, match=f"target_hidden_size={width or H}.*{other} was expected"):
        train(_compose([o.replace("run", "run2") if o.startswith("paths.") else o
                        for o in mismatched] + [f"drafter.target_hidden_size={other}"]))


def test_a_width_the_target_cannot_give_is_refused_at_start_up(ds, ds_dir, tmp_path):
    from dflash_lab.train.run import train

    with pytest.raises(ValueError, match=r"drafter.target_hidden_size=100.*\[64, 256\]"):
        train(_compose(_overrides(ds, ds_dir, tmp_path / "run", 100) + [
            "data=online", "data.path=demo", "data.demo_rows=8",
            f"data.demo_file={tmp_path / 'demo.jsonl'}"]))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_last_layer_id_is_refused_for_a_multi_stream_target(ds):
    """transformers' hidden_states[-1] of DeepSeek-V4 is the collapsed final state, not the
    streams the engines average: a drafter reading it would not match what they feed."""
    from dflash_lab.train.factory import drafter_config_for_target

    assert drafter_config_for_target(ds, target_layer_ids=LAYERS, num_hidden_layers=1,
                                     mask_token_id=ds.token_id(MASK_TOKEN)).num_features == 2 * H
    with pytest.raises(ValueError, match=r"id 5 \(the last layer\)"):
        drafter_config_for_target(ds, target_layer_ids=[1, 5], num_hidden_layers=1,
                                  mask_token_id=ds.token_id(MASK_TOKEN))


def test_warm_start_from_a_flattened_streams_export(ds, tiny_target, tmp_path):
    """drafter.init_from an export with target_hidden_size = n x H: the same config and weights
    on the multi-stream target; refused on a one-stream target of the same width and vocab."""
    from dflash_lab.export.api import export_drafter
    from dflash_lab.export.weights import Source, expected_shapes
    from dflash_lab.train.factory import drafter_config_for_target
    from tests.train.test_warm_start import assert_same_weights, warm

    width = DEEPSEEK_V4_STREAMS * H
    config = drafter_config_for_target(ds, target_layer_ids=LAYERS, num_hidden_layers=1,
                                       block_size=4, target_hidden_size=width,
                                       mask_token_id=ds.token_id(MASK_TOKEN))
    gen = torch.Generator().manual_seed(2)
    state = {k: torch.randn(shape, generator=gen) * 0.1
             for k, shape in expected_shapes(config).items()}
    export_drafter(Source(config, state, "checkpoint", "wide"), tmp_path / "export",
                   dtype="float32", allow_lossy=True)
    drafter = warm(ds, tmp_path / "export", target_layer_ids=LAYERS)
    assert drafter.config.target_hidden_size == width and drafter.config.to_dict() == \
        config.to_dict()
    assert_same_weights(drafter, state)
    assert tiny_target.hidden_size == H and tiny_target.vocab_size == ds.vocab_size
    with pytest.raises(ValueError, match=r"target_hidden_size=256: the target gives .*\[64\]"):
        warm(tiny_target, tmp_path / "export", target_layer_ids=LAYERS)
