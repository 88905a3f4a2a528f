"""Checkpointing that also records the best checkpoint where the exporter looks for it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

BEST_FILE = "best.json"


class DFlashCheckpoint(ModelCheckpoint):
    """ModelCheckpoint (monitor val/tau, mode max, last.ckpt) + ``checkpoints/best.json``.

    ``best.json`` = {"path": best checkpoint relative to the run directory, "val/tau": score};
    the exporter and the eval pick a run directory's best checkpoint from it.
    """

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
