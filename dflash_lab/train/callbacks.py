"""Checkpointing that also records the best checkpoint where the exporter looks for it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

BEST_FILE = "best.json"


class DFlashCheckpoint(ModelCheckpoint):
    """ModelCheckpoint (monitor val/tau, mode max, last.ckpt) + ``checkpoints/best.json``.

    ``best.json`` = {"path": best checkpoint relative to the run directory, "val/tau": score};
    the exporter and the eval pick a run directory's best checkpoint from it.
    ``last_every_n_steps``: also write last.ckpt every N optimizer steps, inside epochs, so a
    killed run loses at most N steps (the data module's state makes the resumed epoch continue
    where it stopped); None: only at validation.
    """

    def __init__(self, *args: Any, last_every_n_steps: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if last_every_n_steps is not None and last_every_n_steps < 1:
            raise ValueError(f"callbacks.checkpoint.last_every_n_steps={last_every_n_steps}: "
                             "must be >= 1, or null to write last.ckpt only at validation")
        self.last_every_n_steps = last_every_n_steps

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.world_size > 1:
            check_same_start_step(trainer, pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        n, step = self.last_every_n_steps, trainer.global_step
        # The first batch that sees step % n == 0 is the one whose optimizer step made it (with
        # gradient accumulation the next ones share the step and are skipped as already saved).
        if n and step > 0 and step % n == 0 and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        if not self.best_model_path or self.dirpath is None:
            return
        run_dir = Path(self.dirpath).parent
        score = self.best_model_score
        record = {"path": os.path.relpath(self.best_model_path, run_dir),
                  "val/tau": float(score) if score is not None else None}
        target = Path(self.dirpath) / BEST_FILE
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(target)


def check_same_start_step(trainer, device: torch.device) -> None:
    """Every rank must start training from the same step. ``ckpt_path=auto`` looks for
    last.ckpt in each process; nodes that see different files (run directory not on a shared
    filesystem, a stale NFS cache) would resume some ranks and start others afresh, and then
    diverge or hang. All ranks raise together (they all see the gathered steps)."""
    steps = trainer.strategy.all_gather(torch.tensor(trainer.global_step, device=device))
    steps = steps.flatten().tolist()
    if min(steps) != max(steps):
        raise RuntimeError(
            f"the ranks start training from different steps (step per rank: {steps}): some "
            "found checkpoints/last.ckpt and resumed, others did not. Every node must see the "
            "run directory on one shared filesystem; or pass ckpt_path=PATH explicitly")
