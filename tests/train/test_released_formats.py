"""Training with the layouts of released drafters, and warm starts from their directories.

``drafter=laguna`` (conf/drafter/laguna.yaml) trains a Laguna-shaped drafter that exports
``--format laguna``; a run started from a Laguna directory, or from a DFlash 2 Muse Glimmer
directory (z-lab's DFlash2DraftModel layout, ``--format muse-glimmer`` of a DFlash 2 drafter),
validates at step 0 at that directory's ``dflash-eval`` tau.

Those directories are written the way their owners' code writes them: the Laguna config.json by
transformers' own ``LagunaConfig.save_pretrained`` (from the trained export's keys, so its
defaults are filled in as in a released checkpoint) beside the weights with vLLM 0.32's
``DFlashLagunaModel`` parameter names (our ``--format laguna`` export; tests/export/test_laguna.py
checks those names against vLLM's); the Muse Glimmer DFlash 2 directory by z-lab's own
``DFlash2DraftModel.from_pretrained`` + ``save_pretrained`` (.venv-dflash) of the trained export,
codebooks named as the release names them (tests/export/test_muse_dflash2.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from dflash_lab.export import import_drafter
from dflash_lab.heads.laguna import laguna_features
from dflash_lab.paths import CONF_DIR
from dflash_lab.train.factory import build_drafter
from dflash_lab.train.warm_start import group_defaults
from tests.export_doubles import random_state, write_checkpoint
from tests.train.test_warm_start import ZLAB_PYTHON, _compose, tiny_source_config

LagunaConfig = pytest.importorskip("transformers.models.laguna").LagunaConfig

LAGUNA = {"aux_hidden_norms": True, "context_input_norm": True, "attention_gate": "per-head",
          "partial_rotary_factor": 0.5}


def laguna_group() -> dict:
    """conf/drafter/laguna.yaml's own values (what ``drafter=laguna`` adds to default.yaml)."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "drafter" / "laguna.yaml"))
    return {k: v for k, v in raw.items() if k != "defaults"}


def test_the_drafter_option_sets_every_laguna_feature():
    assert laguna_group() == LAGUNA


def test_a_laguna_drafter_builds_for_the_target_and_its_export_plan_needs_format_laguna(
        tiny_target):
    """``drafter=laguna`` builds a drafter with the Laguna tensors for the tiny target (head_dim
    32: RoPE on 16 dims); the start-up export check accepts ``export.format=laguna`` and refuses
    our own format, which no engine reads the features from."""
    from dflash_lab.train.run import check_export_plan

    drafter = build_drafter(tiny_target, backend="sdpa", **{**group_defaults(None),
                                                             **laguna_group(),
                                                             "num_hidden_layers": 2})
    assert laguna_features(drafter.config) == LAGUNA and drafter.config.rotary_dim == 16
    names = set(drafter.state_dict())
    assert {"aux_hidden_norms.0.weight", "layers.1.self_attn.g_proj.weight"} <= names
    target = SimpleNamespace(identity=lambda: {"architecture": "Qwen3ForCausalLM"})
    check_export_plan(_compose(["drafter=laguna", "export.format=laguna"]), drafter, target)
    with pytest.raises(ValueError, match=r"export it with --format laguna \(dflash-export\) "
                                         r"or export.format=laguna \(dflash-train"):
        check_export_plan(_compose(["drafter=laguna"]), drafter, target)


def test_drafter_laguna_over_a_plain_source_is_refused_by_name(tiny_target, tmp_path):
    """A warm start cannot add the Laguna tensors to a source trained without them."""
    config = tiny_source_config(tiny_target)
    ckpt = write_checkpoint(tmp_path / "plain.ckpt", config, random_state(config))
    with pytest.raises(ValueError, match="aux_hidden_norms=True .trained with False.*"
                                         "attention_gate='per-head' .trained with None."):
        build_drafter(tiny_target, backend="sdpa", init_from=str(ckpt),
                      **{**group_defaults(None), **laguna_group()})


def owners_laguna_dir(export_dir: Path, out: Path) -> Path:
    """``export_dir`` (a ``--format laguna`` export) re-written by transformers' LagunaConfig:
    its ``save_pretrained`` config.json beside the same weights."""
    raw = json.loads((export_dir / "config.json").read_text())
    for key in ("transformers_version", "dtype", "model_type"):
        raw.pop(key, None)
    LagunaConfig(**raw).save_pretrained(out)
    shutil.copy(export_dir / "model.safetensors", out / "model.safetensors")
    return out


COMMON = ["target=tiny", "trainer=cpu", "logger=none", "drafter.backend=sdpa", "data=offline",
          "data.batch_size=4", "data.val_fraction=0.2", "data.num_workers=0",
          "module.num_anchors=64", "module.gamma=4.0"]


def capture(tiny_target, cap: Path) -> Path:
    """40 demo conversations' features of layers [1, 3, 5], at most 64 tokens each."""
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.targets.demo_corpus import demo_conversations

    rows = [{"messages": c} for c in demo_conversations(40, seed=3)]
    run_capture(tiny_target, rows, CaptureSettings(out_dir=str(cap), target_layer_ids=[1, 3, 5],
                                                   shard_size=16, batch_size=8, max_length=64),
                {"path": "demo-seed3"}, progress=False)
    return cap


def train_source(common: list[str], out: Path, drafter: list[str], fmt: str) -> dict:
    """20 steps of a 2-layer drafter (the ``drafter`` overrides) exported ``--format fmt`` (10
    left DFlash 2 at +0.017 val tau on one machine: too close to call it trained)."""
    from dflash_lab.train.run import train

    source = train(_compose([*common, *drafter, f"paths.output_dir={out}",
                             "drafter.num_hidden_layers=2", "drafter.block_size=8",
                             "drafter.target_layer_ids=3", "module.optimizer.lr=3e-3",
                             "trainer.max_steps=20", "trainer.max_epochs=20",
                             "export.enabled=true", f"export.format={fmt}",
                             "export.dtype=float32"]))
    assert source["val_tau_after"] > source["val_tau_before"] + 0.05  # it learned something
    return source


def step_0_and_eval_tau(tiny_target, common: list[str], cap: Path, source_dir: Path,
                        out: Path) -> tuple[float, dict]:
    """Step-0 val tau of a run warm-started from ``source_dir`` with the default drafter group
    (the directory's own layout wins), and ``dflash-eval mode=features drafter.path=`` of the
    directory (its loader and ``feature_eval``) over that run's validation split, every anchor
    evaluated (as in tests/train/test_warm_start.py's step-0 test)."""
    from dflash_lab.data.module import OfflineDataModule
    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.eval.offline_tau import feature_eval
    from dflash_lab.train.run import train

    warm_run = train(_compose([*common, f"paths.output_dir={out}",
                               f"drafter.init_from={source_dir}", "trainer.max_steps=1",
                               "export.enabled=false"]))
    split = OfflineDataModule(str(cap), batch_size=4, val_fraction=0.2, seed=0)
    split.setup()
    report = feature_eval(load_drafter(str(source_dir)).drafter, tiny_target.pieces(),
                          split.val_set, num_anchors=None, progress=False)
    assert report["num_blocks"] > 100 and report["tau_mean"] > 1.05
    return warm_run["val_tau_before"], report


@pytest.mark.slow
def test_step_0_val_tau_from_a_laguna_directory_equals_its_dflash_eval_tau(
        tiny_target, tiny_target_dir, tmp_path):
    """``drafter=laguna`` trains and exports ``--format laguna``; that directory re-saved by
    transformers' LagunaConfig starts a run at its own tau."""
    cap = capture(tiny_target, tmp_path / "capture")
    common = [*COMMON, f"target.path={tiny_target_dir}", f"data.path={cap}"]
    source = train_source(common, tmp_path / "src", ["drafter=laguna"], "laguna")
    export_dir = Path(source["export_dir"])
    assert json.loads((export_dir / "config.json").read_text())["architectures"] == [
        "DFlashLagunaForCausalLM"]
    laguna = owners_laguna_dir(export_dir, tmp_path / "laguna")
    assert laguna_features(import_drafter(laguna).config) == LAGUNA
    step_0, report = step_0_and_eval_tau(tiny_target, common, cap, laguna, tmp_path / "ft")
    assert step_0 == pytest.approx(report["tau_mean"], abs=1e-6)
    assert step_0 == pytest.approx(source["val_tau_after"], abs=1e-6)


@pytest.mark.skipif(not ZLAB_PYTHON.exists(),
                    reason="needs .venv-dflash (make dflash-venv): z-lab's dflash package")
@pytest.mark.slow
def test_step_0_val_tau_from_a_muse_glimmer_dflash2_directory_equals_its_dflash_eval_tau(
        tiny_target, tiny_target_dir, tmp_path):
    """``drafter=dflash2`` exported ``--format muse-glimmer`` (the released DFlash 2 Muse
    layout), re-saved by z-lab's own DFlash2DraftModel, starts a run at its own tau."""
    from tests.export.test_muse_dflash2 import zlab

    cap = capture(tiny_target, tmp_path / "capture")
    common = [*COMMON, f"target.path={tiny_target_dir}", f"data.path={cap}"]
    source = train_source(common, tmp_path / "src", ["drafter=dflash2", "drafter.selector_rank=8",
                                                     "drafter.selector_top_k=4"], "muse-glimmer")
    muse2 = tmp_path / "Muse-Glimmer-DFlash2"
    zlab(tmp_path, "resave", str(source["export_dir"]), str(muse2))
    assert json.loads((muse2 / "config.json").read_text())["architectures"] == [
        "DFlash2DraftModel"]
    step_0, report = step_0_and_eval_tau(tiny_target, common, cap, muse2, tmp_path / "ft")
    assert step_0 == pytest.approx(report["tau_mean"], abs=1e-6)
    assert step_0 == pytest.approx(source["val_tau_after"], abs=1e-6)
