"""A YaRN-scaled target, through the path users take: dflash-train (tiny recipe) -> the training-end
export -> config.json, whose rotary (read by transformers, as both engines read it) equals the
drafter's and the target's own; the export's warm start keeps it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
#: before, at and past the original length, and past max_position_embeddings (2048)
POSITIONS = torch.tensor([0, 3, 100, 511, 512, 513, 1000, 2047, 2048, 3000])


def _yarn_target(tiny_target_dir: Path, out: Path) -> Path:
    """The tiny target with YaRN scaling in its config.json (transformers 5 rope_parameters)."""
    shutil.copytree(tiny_target_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **YARN}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash_lab.paths import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _transformers_rotary(config_dir: Path):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rotary = Qwen3RotaryEmbedding(Qwen3Config.from_pretrained(str(config_dir)))
    cos, sin = rotary(torch.zeros(1), POSITIONS[None])
    return cos[0], sin[0]


def test_a_yarn_target_exports_a_drafter_whose_rotary_is_transformers(tiny_target_dir, tmp_path,
                                                                      caplog):
    from dflash_lab.export import import_drafter, inspect_dir
    from dflash_lab.model.drafter import DFlashDrafter
    from dflash_lab.targets.loader import load_target
    from dflash_lab.train.factory import build_drafter
    from dflash_lab.train.run import train

    target_dir = _yarn_target(tiny_target_dir, tmp_path / "target")
    run = train(_compose([
        "recipe=tiny_cpu", f"paths.output_dir={tmp_path / 'run'}", f"target.path={target_dir}",
        "trainer.max_steps=2", "trainer.max_epochs=1", "data.demo_rows=24", "data.demo_seed=1",
        f"data.demo_file={tmp_path / 'demo.jsonl'}", "data.max_length=96", "data.batch_size=8",
        "data.val_fraction=0.25", "logger=none"]))
    export = Path(run["export_dir"])
    written = json.loads((export / "config.json").read_text())
    assert (written["rope_theta"], written["rope_scaling"], written["max_position_embeddings"]) \
        == (10000.0, YARN, 2048)

    drafter = DFlashDrafter(import_drafter(export).config)
    ours = drafter.rotary(POSITIONS, torch.float32)
    for reference in (_transformers_rotary(export), _transformers_rotary(target_dir)):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    plain = _transformers_rotary(tiny_target_dir)
    assert not torch.allclose(ours[0], plain[0])  # the scaling is really there

    text = inspect_dir(export).text
    assert "RoPE: yarn(factor=4.0, original_max_position_embeddings=512), theta 10000" in text
    assert "silently drops the trained RoPE" not in text

    target = load_target(str(target_dir), dtype="float32", device="cpu")
    with caplog.at_level(logging.WARNING, logger="dflash_lab.train.warm_start"):
        warm = build_drafter(target, backend="sdpa", init_from=str(export))
    assert warm.config.rope_scaling == YARN and "contradicts" not in caplog.text
