"""Faults and hostile inputs (issue 16): what must never happen, whatever the input."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.paths import CONF_DIR


class _Payload:
    """Unpickling this object creates a file: proof that pickled code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_never_runs_a_pickle_payload(tmp_path, tiny_target_dir, monkeypatch):
    """``ckpt_path=auto`` loads last.ckpt with weights_only=True explicitly, so even
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 cannot make a planted checkpoint execute code."""
    from dflash_lab.train.run import train

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {}, "payload": _Payload(marker)}, run / "checkpoints" / "last.ckpt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "recipe=tiny_cpu", f"target.path={tiny_target_dir}", f"paths.output_dir={run}",
            "logger=none", "export.enabled=false", "data.demo_rows=24",
            f"data.demo_file={tmp_path / 'demo.jsonl'}", "data.max_length=64"])
    with pytest.raises(Exception, match="(?i)weights.only"):
        train(cfg)
    assert not marker.exists()
