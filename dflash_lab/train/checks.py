"""Start-up checks of a training config: user mistakes found before any loading, each a
one-line ValueError naming the value and the fix (the entry point prints it as ``error: ...``).

These are the values that otherwise fail late (at the first validation, after an epoch) or not
at all; values checked where they are used (drafter, data, module constructors) stay there.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def check_module(cfg: DictConfig) -> None:
    """``module.num_anchors`` >= 1, ``module.gamma`` > 0, ``module.position_weighting`` known
    and, for dpace, ``module.dpace_alpha`` in (0, 1]."""
    anchors, gamma = cfg.module.get("num_anchors"), cfg.module.get("gamma")
    if anchors is not None and int(anchors) < 1:
        raise ValueError(f"module.num_anchors={anchors}: must be >= 1 (blocks drafted per "
                         "sequence per step; the recipes use 512)")
    if gamma is not None and float(gamma) <= 0:
        raise ValueError(f"module.gamma={gamma}: must be > 0 (slot weight exp(-(t-1)/gamma))")
    from dflash_lab.train.loss import check_position_weighting

    check_position_weighting(cfg.module.get("position_weighting", "exp_decay"),
                             cfg.module.get("dpace_alpha", 0.5))
    loss_spec(cfg.module)
    from dflash_lab.train.distill import resolve_val_temperatures

    resolve_val_temperatures(cfg.module.get("val_temperatures"), None)


def loss_spec(module_cfg):
    """The :class:`~dflash_lab.train.distill.LossSpec` of ``module.*`` (ValueError if bad)."""
    from dflash_lab.train.distill import LossSpec

    loss = module_cfg.get("loss", "ce")
    if not isinstance(loss, str):
        loss = OmegaConf.to_container(loss) if isinstance(loss, DictConfig) else loss
    return LossSpec.create(loss, float(module_cfg.get("label_temperature", 1.0)),
                           float(module_cfg.get("lk_eta", 3.0)),
                           float(module_cfg.get("accept_temperature", 1.0)))


def check_loss_data(module_cfg, data) -> None:
    """The loss and ``module.val_temperatures`` against what the data module's batches carry
    (``data.target_distribution()``): refused naming the capture option to rerun with."""
    from dflash_lab.train.distill import resolve_val_temperatures, teacher_kind

    available = data.target_distribution()
    temps = resolve_val_temperatures(module_cfg.get("val_temperatures"), available)
    soft = (module_cfg.get("selector") or {}).get("target", "argmax") == "distribution"
    teacher_kind(loss_spec(module_cfg), available, temps, data.describe(),
                 "module.selector.target=distribution" if soft else None)


def _sequence_limit(cfg: DictConfig) -> tuple[int | None, str]:
    """(longest sequence the data gives, where that limit is set)."""
    if cfg.data._target_.endswith("OnlineDataModule"):
        return cfg.data.get("max_length"), "data.max_length"
    from dflash_lab.data.shards import read_manifest

    return read_manifest(cfg.data.path).get("max_length"), f"{cfg.data.path}/manifest.json " \
        "max_length (the capture's capture.max_length)"


def check_data(cfg: DictConfig) -> None:
    """``data=offline`` has ``data.path``; ``data.pack`` has its row length;
    ``drafter.block_size`` fits the sequences."""
    offline = not cfg.data._target_.endswith("OnlineDataModule")
    if offline and (OmegaConf.is_missing(cfg.data, "path") or not cfg.data.get("path")):
        raise ValueError("data.path is not set: data=offline reads a capture directory; pass "
                         "data.path=DIR (the dflash-capture out_dir holding manifest.json)")
    if cfg.data.get("pack") and cfg.data.get("max_tokens_per_row") is None:
        raise ValueError("data.pack=true needs data.max_tokens_per_row (tokens per packed row, "
                         "e.g. data.max_tokens_per_row=2048): documents are packed whole up to "
                         "that length")
    block = cfg.drafter.get("block_size")
    limit, where = _sequence_limit(cfg)
    if block is not None and limit is not None and int(block) > int(limit):
        raise ValueError(f"drafter.block_size={block} is longer than the sequences "
                         f"({where}={limit}): no block fits; lower drafter.block_size or "
                         "raise the sequence length")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (tried, then removed: permission bits
    do not tell for root, read-only mounts or quotas)."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".dflash-write-check-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def check_writable(cfg: DictConfig) -> None:
    """The checkpoint directory (or the nearest existing parent it will be made in) must be
    writable now, not at the first save after an epoch. Leaves nothing behind."""
    callback = (cfg.get("callbacks") or {}).get("checkpoint") or {}
    dirpath = callback.get("dirpath") or Path(cfg.paths.output_dir) / "checkpoints"
    where = _nearest_existing(Path(str(dirpath)))
    if not where.is_dir() or not _writable(where):
        raise ValueError(f"{where} is not a writable directory: checkpoints go to {dirpath}; "
                         "fix its permissions or choose paths.output_dir / "
                         "callbacks.checkpoint.dirpath elsewhere")


def check_train_config(cfg: DictConfig) -> None:
    """Every start-up check of a training config (before any model or data is loaded)."""
    check_module(cfg)
    check_data(cfg)
    check_writable(cfg)
