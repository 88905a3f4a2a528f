"""The training run's callbacks: checkpointing that also records the best checkpoint where the
exporter looks for it (atomic writes with a ``.sha256`` sidecar, ``last.prev.ckpt`` kept, saved
paths rebased onto the run's current directory); the target's identity in every checkpoint; and
:class:`WandbRun`, the one place that knows a logger is wandb's (docs/guarantees.md).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any
from weakref import proxy

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from dflash_lab.checksums import sidecar
from dflash_lab.paths import atomic_path, atomic_write_text
from dflash_lab.terminal import emit
from dflash_lab.train.resume import PREVIOUS_LAST, finish_checkpoint

BEST_FILE = "best.json"
TARGET_KEY = "dflash_target"  #: checkpoint key of the target identity (config/tokenizer/weights)
_PATH_KEYS = ("best_model_path", "kth_best_model_path", "last_model_path")


def write_checkpoint_file(checkpoint: dict[str, Any], path: str | Path) -> None:
    """``torch.save`` straight into ``path``: the temporary file beside the checkpoint that
    :func:`~dflash_lab.train.resume.finish_checkpoint` fsyncs and renames."""
    with open(path, "wb") as f:
        torch.save(checkpoint, f)


class BesideCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer without its staging (``_atomic_save``: an fsspec transaction
    through a file in the system temp folder, copied over at the end, after a second in-memory
    copy: a small ``$TMPDIR`` fails a large checkpoint). :class:`DFlashCheckpoint` already
    writes a temporary file beside its target, so this writes that file directly."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_checkpoint_file(checkpoint, path)


class DFlashCheckpoint(ModelCheckpoint):
    """ModelCheckpoint (monitor val/tau, mode max, last.ckpt) + ``checkpoints/best.json`` =
    {"path": relative to the run directory, "val/tau"}, where the exporter and eval find the best.
    ``last_every_n_steps``: also write last.ckpt every N optimizer steps inside epochs (a killed
    run loses at most N; the data module's state resumes mid-epoch); None: at validation only."""

    def __init__(self, *args: Any, last_every_n_steps: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if last_every_n_steps is not None and last_every_n_steps < 1:
            raise ValueError(f"callbacks.checkpoint.last_every_n_steps={last_every_n_steps}: "
                             "must be >= 1, or null to write last.ckpt only at validation")
        self.last_every_n_steps = last_every_n_steps

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Rebase the saved absolute paths onto this run's ``dirpath``: Lightning keeps a stale
        ``best_model_path`` when the directory moved and forgets ``last_model_path`` (the next
        save then goes to last-v1.ckpt beside a stale last.ckpt)."""
        old = state_dict.get("dirpath")
        if old and self.dirpath and old != self.dirpath:
            state_dict = {**state_dict, "dirpath": self.dirpath,
                          **{k: self._rebase(state_dict.get(k), old) for k in _PATH_KEYS},
                          "best_k_models": {self._rebase(k, old): v for k, v in
                                            (state_dict.get("best_k_models") or {}).items()}}
        super().load_state_dict(state_dict)

    def _rebase(self, path: str | None, old_dir: str) -> str | None:
        if not path:
            return path
        rel = os.path.relpath(path, old_dir)
        return path if rel.startswith("..") else os.path.join(self.dirpath, rel)

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Write checkpoints with :class:`BesideCheckpointIO` (unless the strategy brings a
        writer of its own, e.g. an asynchronous or sharded one)."""
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = BesideCheckpointIO()

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        """Lightning's save, but atomic: ``.<name>.tmp`` beside ``filepath`` (one name for every
        rank: a sharded strategy writes it together), then on global rank 0
        :func:`~dflash_lab.train.resume.finish_checkpoint` (``finish`` of ``atomic_path``)."""
        tmp = Path(filepath).with_name(f".{Path(filepath).name}.tmp")
        keep = PREVIOUS_LAST if Path(filepath).name == "last.ckpt" else None
        # rank 0 renames (a failed write, e.g. a full disk, is removed: the old one stays)
        writing = (atomic_path(filepath, temp=tmp, finish=partial(finish_checkpoint,
                                                                  keep_previous_as=keep))
                   if trainer.is_global_zero else nullcontext(tmp))
        with writing as tmp:
            trainer.save_checkpoint(str(tmp), self.save_weights_only)
        trainer.strategy.barrier()
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:  # and its .sha256 sidecar
            sidecar(Path(filepath)).unlink(missing_ok=True)

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
        if (trainer.sanity_checking or not trainer.is_global_zero or not self.best_model_path
                or self.dirpath is None):
            return
        score = self.best_model_score
        record = {"path": os.path.relpath(self.best_model_path, Path(self.dirpath).parent),
                  "val/tau": float(score) if score is not None else None}
        atomic_write_text(Path(self.dirpath) / BEST_FILE, json.dumps(record, indent=2) + "\n")


class RecordTarget(Callback):
    """Saves ``Target.identity()`` of the run's target in every checkpoint the run writes, as
    ``checkpoint["dflash_target"]`` (plain data: weights_only loads it); the exporter and warm
    start compare a ``--target``'s weights fingerprint with it. Added by dflash-train itself
    (``build_components``): every run records its target, whatever the callbacks config."""

    def __init__(self, target_identity: dict[str, Any]):
        self.target_identity = dict(target_identity)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[TARGET_KEY] = self.target_identity


class ProgressLines(Callback):
    """Training's progress lines for ``dflash-lab run`` (:func:`dflash_lab.terminal.emit`):
    optimizer step / total (at most one a second) and the latest val/tau."""

    def __init__(self):
        self.emitted = 0.0

    def _emit(self, trainer, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.emitted >= 1.0:
            self.emitted = now
            tau = trainer.callback_metrics.get("val/tau")
            total = trainer.estimated_stepping_batches
            emit(unit="step", done=trainer.global_step, what="step",
                 total=int(total) if total != float("inf") else None,
                 tau=None if tau is None else float(tau))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._emit(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._emit(trainer, force=True)


class RunEndCallback(Callback):
    """A callback with work for when the whole training run is over: after the last validation
    and the end-of-run export, which no Lightning hook follows.
    :func:`dflash_lab.train.run.train` calls :meth:`on_run_end` of each one the trainer has."""

    def on_run_end(self, trainer, result: dict[str, Any]) -> None:
        """``result``: what ``train()`` returns (``export_dir`` when the run exported)."""


class WandbRun(RunEndCallback):
    """wandb's part of a run, for the given loggers that are ``WandbLogger``: the end-of-run export
    as model artifact ``artifact_name``, tables and images, and finishing the run last so all is
    flushed (Lightning's ``finalize`` leaves it open). dflash-train: ``callbacks.wandb``; the
    trainer-less commands call the class methods (dflash_lab/entry.py, eval/cli.py)."""

    def __init__(self, artifact_name: str = "drafter"):
        self.artifact_name = artifact_name

    @staticmethod
    def runs(loggers) -> list[WandbLogger]:
        """The wandb loggers among ``loggers`` (a list, one logger, or None)."""
        loggers = loggers if isinstance(loggers, list | tuple) else [loggers]
        return [lg for lg in loggers if isinstance(lg, WandbLogger)]

    @classmethod
    def log_table(cls, loggers, key: str, columns: list[str], data: list[list[Any]]) -> None:
        for logger in cls.runs(loggers):
            logger.log_table(key=key, columns=columns, data=data)

    @classmethod
    def log_images(cls, loggers, images: dict[str, str]) -> None:
        """``images``: {key: image file}."""
        for logger in cls.runs(loggers):
            for key, path in images.items():
                logger.log_image(key=key, images=[path])

    @classmethod
    def finish(cls, loggers) -> None:
        """Finish each wandb run: flush metrics and artifacts (offline: to disk)."""
        for logger in cls.runs(loggers):
            logger.experiment.finish()

    def on_run_end(self, trainer, result: dict[str, Any]) -> None:
        if not trainer.is_global_zero:
            return
        for logger in self.runs(trainer.loggers):
            if result.get("export_dir"):
                import wandb

                artifact = wandb.Artifact(self.artifact_name, type="model")
                artifact.add_dir(str(result["export_dir"]))
                logger.experiment.log_artifact(artifact)
        self.finish(trainer.loggers)


def log_final(logger, cfg: DictConfig, metrics: dict[str, Any], step: int | None = None) -> None:
    """Log the resolved config and final numbers (plain numbers, bools as 0/1); flush and close
    the logger: csv writes its files; a wandb run is finished (offline: on disk) by
    :class:`WandbRun`, where the wandb-specific work lives."""
    if logger is None:
        return
    logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    numbers = {k: int(v) if isinstance(v, bool) else v for k, v in metrics.items()
               if isinstance(v, (int, float))}
    logger.log_metrics(numbers, step=step)
    logger.save()
    logger.finalize("success")
    WandbRun.finish(logger)


def check_same_start_step(trainer, device: torch.device) -> None:
    """Every rank must start from the same step: ``ckpt_path=auto`` looks for last.ckpt in each
    process, and nodes seeing different files (no shared filesystem, a stale NFS cache) would
    resume some ranks and start others afresh, then diverge or hang. All ranks raise together."""
    steps = trainer.strategy.all_gather(torch.tensor(trainer.global_step, device=device))
    steps = steps.flatten().tolist()
    if min(steps) != max(steps):
        raise RuntimeError(
            f"the ranks start training from different steps (step per rank: {steps}): some "
            "found checkpoints/last.ckpt and resumed, others did not. Every node must see the "
            "run directory on one shared filesystem; or pass ckpt_path=PATH explicitly")
