"""The test-only head of tests/heads/toy_head.py works through the head interface alone
(docs/architecture.md, "Add a head"): its field is validated and carried, it trains with its
own term, exports, inspects and decodes losslessly from its export, and a separate process
knows it through DFLASH_LAB_HEADS."""

import csv
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.model import heads
from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import CONF_DIR
from tests.doubles import tiny_drafter_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def toy():
    """The toy head, registered for this test only (other tests list the built-in heads)."""
    module = importlib.import_module("tests.heads.toy_head")  # registers it on first import
    heads.register(module.HEAD)
    yield module.HEAD
    heads.unregister("toy")


def _toy(**fields):
    return tiny_drafter_config(variant="toy", **fields)


def test_the_head_declares_its_field_and_the_config_validates_it():
    config = _toy()
    assert config.head is heads.get("toy") and config.toy_probe_weight == 0.5
    assert "toy_probe_weight" in DrafterConfig.field_names()
    with pytest.raises(ValueError, match="toy_probe_weight=-1.*must be a number >= 0"):
        _toy(toy_probe_weight=-1)
    with pytest.raises(ValueError, match="toy_probe_weight=0.3.*is a Toy field; set "
                                         "variant='toy'"):
        tiny_drafter_config(toy_probe_weight=0.3)


def test_our_config_json_carries_the_head_and_reads_it_back():
    config = _toy(toy_probe_weight=0.25)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["architectures"] == ["ToyDraftModel"]
    assert data["dflash_config"]["toy_probe_weight"] == 0.25
    assert DrafterConfig.from_dict(data) == config


def test_the_drafter_gets_the_heads_module_and_drafts_as_dflash1():
    drafter = DFlashDrafter(_toy())
    assert "toy_probe.weight" in drafter.state_dict()
    assert not hasattr(drafter, "candidate_selector")
    assert not hasattr(drafter, "markov_head")


def _compose(tmp_path, target_dir):
    overrides = {"recipe": "tiny_cpu", "paths.output_dir": str(tmp_path / "run"),
                 "target.path": str(target_dir), "data.demo_rows": 24,
                 "data.demo_file": str(tmp_path / "demo.jsonl"), "data.max_length": 96,
                 "data.batch_size": 8, "data.val_fraction": 0.25, "logger": "csv",
                 "trainer.log_every_n_steps": 1, "trainer.max_epochs": 1,
                 "module.num_anchors": 8, "callbacks.progress": "null",
                 "++drafter.variant": "toy", "+drafter.toy_probe_weight": 0.3}
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[f"{k}={v}" for k, v in overrides.items()])


def test_it_trains_exports_inspects_and_evaluates(tiny_target_dir, tiny_target, tmp_path):
    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.eval.loop import DecodeSettings, baseline_generate, speculative_generate
    from dflash_lab.eval.proposer import DFlashProposer
    from dflash_lab.eval.target_runner import TargetRunner
    from dflash_lab.export import inspect_dir
    from dflash_lab.train.run import train

    run_dir = Path(train(_compose(tmp_path, tiny_target_dir))["output_dir"])
    rows = []
    for path in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    losses = [float(r["train/toy_loss"]) for r in rows if r.get("train/toy_loss")]
    assert losses and all(v > 0 for v in losses)
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)
    assert "drafter.toy_probe.weight" in ckpt["state_dict"]
    assert ckpt["hyper_parameters"]["drafter_config"]["architectures"] == ["ToyDraftModel"]
    export_dir = run_dir / "export"  # the end-of-run export (the recipe's export section)
    assert "ToyDraftModel" in (export_dir / "config.json").read_text()
    inspected = inspect_dir(export_dir)
    assert inspected.trained is not None and not any("toy_probe" in p for p in inspected.problems)
    loaded = load_drafter(export_dir)
    assert loaded.drafter.config.head.name == "toy"
    assert torch.equal(loaded.drafter.toy_probe.weight,
                       ckpt["state_dict"]["drafter.toy_probe.weight"])
    pieces, ids = tiny_target.pieces(), loaded.drafter.config.target_layer_ids
    settings = DecodeSettings(max_new_tokens=24)
    proposer = DFlashProposer(loaded.drafter, pieces.embed_tokens, pieces.lm_head)
    spec = speculative_generate(TargetRunner(tiny_target.model, ids), proposer, [1, 2, 3],
                                settings)
    base = baseline_generate(TargetRunner(tiny_target.model), [1, 2, 3], settings)
    assert spec.output_ids == base.output_ids  # lossless under greedy decoding


def test_another_process_knows_the_head_through_the_environment():
    code = ("from dflash_lab.model import heads; from tests.doubles import tiny_drafter_config; "
            "print(heads.names(), tiny_drafter_config(variant='toy').toy_probe_weight)")
    env = {**os.environ, heads.PLUGINS_ENV: "tests.heads.toy_head", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                         capture_output=True, check=True).stdout
    assert "'toy'" in out and out.strip().endswith("0.5")
    env[heads.PLUGINS_ENV] = "tests.heads.no_such_head"
    failed = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                            capture_output=True)
    assert failed.returncode != 0
    assert "DFLASH_LAB_HEADS: cannot import the head module 'tests.heads.no_such_head'" in \
        failed.stderr
