"""Start-up checks of a training config: the mistakes that otherwise fail late (at the first
validation) or never, each one ValueError naming the value and the fix (printed as ``error:``),
before any loading; values checked where they are used (constructors) stay there.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from dflash_lab.data.module import BlockDataModule
from dflash_lab.export.options import check_section
from dflash_lab.train.distill import LossSpec, resolve_val_temperatures, teacher_kind
from dflash_lab.train.loss import check_position_weighting


def check_module(cfg: DictConfig) -> None:
    """``module.num_anchors`` >= 1, ``module.gamma`` > 0, ``module.position_weighting`` known
    and, for dpace, ``module.dpace_alpha`` in (0, 1]."""
    anchors, gamma = cfg.module.get("num_anchors"), cfg.module.get("gamma")
    if anchors is not None and int(anchors) < 1:
        raise ValueError(f"module.num_anchors={anchors}: must be >= 1 (blocks drafted per "
                         "sequence per step; the recipes use 512)")
    if gamma is not None and float(gamma) <= 0:
        raise ValueError(f"module.gamma={gamma}: must be > 0 (slot weight exp(-(t-1)/gamma))")
    check_position_weighting(cfg.module.get("position_weighting", "exp_decay"),
                             cfg.module.get("dpace_alpha", 0.5))
    loss_spec(cfg.module)
    resolve_val_temperatures(cfg.module.get("val_temperatures"), None)


def loss_spec(module_cfg):
    """The :class:`~dflash_lab.train.distill.LossSpec` of ``module.*`` (ValueError if bad)."""
    loss = module_cfg.get("loss", "ce")
    loss = OmegaConf.to_container(loss) if isinstance(loss, DictConfig) else loss
    return LossSpec.create(loss, float(module_cfg.get("label_temperature", 1.0)),
                           float(module_cfg.get("lk_eta", 3.0)),
                           float(module_cfg.get("accept_temperature", 1.0)))


def check_loss_data(module_cfg, data) -> None:
    """The loss and ``module.val_temperatures`` against what the data module's batches carry
    (``data.target_distribution()``): refused naming the capture option to rerun with."""
    available = data.target_distribution()
    temps = resolve_val_temperatures(module_cfg.get("val_temperatures"), available)
    soft = (module_cfg.get("selector") or {}).get("target", "argmax") == "distribution"
    teacher_kind(loss_spec(module_cfg), available, temps, data.describe(),
                 "module.selector.target=distribution" if soft else None)


def data_class(data_cfg: DictConfig) -> type:
    """The data module class ``data._target_`` names (not instantiated): what the run needs to
    know about its data before loading anything is declared on it (``BlockDataModule``)."""
    name = data_cfg.get("_target_")
    try:
        cls = get_class(str(name))
    except Exception as err:  # hydra raises ImportError or ValueError, wrapped differently
        raise ValueError(f"data._target_={name!r} does not import ({err}): use data=online or "
                         "data=offline (conf/data/), or a BlockDataModule subclass") from err
    if not (isinstance(cls, type) and issubclass(cls, BlockDataModule)):
        raise ValueError(f"data._target_={name!r} is not a data module of dflash_lab.data.module "
                         "(a BlockDataModule subclass declares what dflash-train needs): use "
                         "data=online or data=offline (conf/data/)")
    return cls


def check_data(cfg: DictConfig) -> None:
    """The data module's own config check (``data=offline`` has ``data.path``);
    ``data.pack`` has its row length; ``drafter.block_size`` fits the sequences."""
    cls = data_class(cfg.data)
    cls.check_config(cfg.data)
    if cfg.data.get("pack") and cfg.data.get("max_tokens_per_row") is None:
        raise ValueError("data.pack=true needs data.max_tokens_per_row (tokens per packed row, "
                         "e.g. data.max_tokens_per_row=2048): documents are packed whole up to "
                         "that length")
    block = cfg.drafter.get("block_size")
    limit, where = cls.sequence_limit(cfg.data)
    if block is not None and limit is not None and int(block) > int(limit):
        raise ValueError(f"drafter.block_size={block} is longer than the sequences "
                         f"({where}={limit}): no block fits; lower drafter.block_size or "
                         "raise the sequence length")


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
    where = Path(str(dirpath)).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir() or not _writable(where):
        raise ValueError(f"{where} is not a writable directory: checkpoints go to {dirpath}; "
                         "fix its permissions or choose paths.output_dir / "
                         "callbacks.checkpoint.dirpath elsewhere")


def check_export(cfg: DictConfig) -> None:
    """Every key and value of the ``export:`` section is an export setting
    (export/options.py: the dflash-export options of the same names)."""
    check_section(OmegaConf.to_container(cfg.export, resolve=False),
                  "the export section (conf/train.yaml, the recipe, the command line)")


def check_train_config(cfg: DictConfig) -> None:
    """Every start-up check of a training config (before any model or data is loaded)."""
    check_module(cfg)
    check_export(cfg)
    check_data(cfg)
    check_writable(cfg)
