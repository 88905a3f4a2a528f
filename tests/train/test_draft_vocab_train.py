"""A draft-vocabulary drafter (issue 27 item 5) trains, exports for vLLM, reads back and decodes
losslessly; SGLang, which drafts through the target's own head, is refused at start-up."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from safetensors.torch import load_file, save_file

from dflash_lab.eval.loading import load_drafter
from dflash_lab.export.api import inspect_dir
from dflash_lab.train.run import build_components, check_export_plan, train
from tests.train.test_train import _compose, _tiny_overrides

STEPS = {"trainer.max_epochs": 1, "trainer.max_steps": 4, "trainer.val_check_interval": 2,
         "drafter.draft_vocab_size": 64, "export.enabled": True, "export.engine": "vllm"}


def test_draft_vocab_trains_exports_for_vllm_reads_back_and_decodes_losslessly(
        tiny_target_dir, tmp_path, monkeypatch):
    from dflash_lab.eval.cli import main as eval_main

    result = train(_compose(_tiny_overrides(tmp_path, tiny_target_dir, rows=32, **STEPS)))
    record = json.loads((Path(result["output_dir"]) / "draft_vocab.json").read_text())
    assert record["draft_vocab_size"] == 64 and record["counted"] == "conversation tokens"
    assert 0.0 < record["coverage"] <= 1.0 and len(record["token_ids"]) == 64
    out = Path(result["export_dir"])
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 64 and config["vocab_size"] > 64
    drafter = load_drafter(out).drafter
    assert drafter.draft_token_ids().tolist() == record["token_ids"]
    ckpt = torch.load(result["best_checkpoint"], map_location="cpu", weights_only=True)
    assert torch.equal(ckpt["state_dict"]["drafter.d2t"], drafter.d2t.cpu())
    assert load_drafter(result["best_checkpoint"]).drafter.draft_vocab_set
    inspected = inspect_dir(out, engine="vllm")
    assert inspected.problems == [], inspected.text
    assert f"draft vocabulary: 64 of {config['vocab_size']} target tokens" in inspected.text
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    weights = load_file(str(broken / "model.safetensors"))
    save_file({**weights, "d2t": torch.zeros_like(weights["d2t"])},
              str(broken / "model.safetensors"))
    assert any("d2t and t2d do not name" in p for p in inspect_dir(broken, "vllm").problems)
    # a warm start keeps the source's vocabulary instead of recounting
    warm = {**STEPS, "export.enabled": False, "drafter.init_from": result["output_dir"]}
    again = train(_compose(_tiny_overrides(tmp_path / "warm", tiny_target_dir, rows=32, **warm)))
    kept = json.loads((Path(again["output_dir"]) / "draft_vocab.json").read_text())
    assert kept["counted"] == "kept from drafter.init_from"
    assert kept["token_ids"] == record["token_ids"]
    for temperature in (0.0, 1.0):
        report = tmp_path / f"eval_T{temperature}"
        args = ["target=hf", f"target.name_or_path={tiny_target_dir}", f"drafter.path={out}",
                f"data.path={tmp_path / 'demo.jsonl'}", f"output_dir={report}",
                "num_prompts=2", "max_new_tokens=16", "progress=false",
                "target.dtype=float32", "target.device=cpu", f"temperature={temperature}"]
        if temperature:
            args.append("sampling=rejection")
        monkeypatch.setattr(sys, "argv", ["dflash-eval", *args])
        GlobalHydra.instance().clear()
        eval_main()
        got = json.loads((report / "report.json").read_text())
        assert len(got["outputs"]) == 2 and got["tau_mean"] >= 1.0
        if not temperature:  # greedy: token for token the target's own output
            assert got["lossless"] is True


def test_a_draft_vocab_run_refuses_sglang_at_start_up(tiny_target_dir,
                                                                           tmp_path):
    cfg = _compose(_tiny_overrides(tmp_path, tiny_target_dir, rows=32,
                                   **{**STEPS, "export.engine": "both"}))
    parts = build_components(cfg)
    with pytest.raises(ValueError, match="draft_vocab_size=64 with its lm_head and d2t"):
        check_export_plan(cfg, parts["drafter"], parts["target"])


def test_a_distribution_loss_trains_over_the_draft_vocabulary(tiny_target_dir, tmp_path):
    """The teacher is the target head's rows of the draft vocabulary: renormalised over it."""
    steps = {**STEPS, "module.loss": "{kl: 1.0}", "export.enabled": False,
             "trainer.log_every_n_steps": 1}
    result = train(_compose(_tiny_overrides(tmp_path, tiny_target_dir, rows=32, **steps)))
    metrics = next(Path(result["output_dir"]).rglob("metrics.csv")).read_text()
    assert "train/loss_kl" in metrics and "val/tau_T1" in metrics
    assert result["val_tau_after"] >= 1.0
