"""What the entry points share besides their Hydra groups (conf/logger/, conf/target/, ...).

- The experiment logger outside Lightning: dflash-capture, dflash-regenerate and dflash-eval
  instantiate the same ``logger`` group as dflash-train (a Lightning logger, or none) and log
  through the generic Lightning logger calls, so wandb and csv both work; what only wandb
  does (tables, images, finishing the run) is :class:`dflash_lab.train.callbacks.WandbRun`'s.
- Renamed keys: one concept has one name in every command; the former names are refused
  before Hydra with the new one (:func:`check_renamed_keys`).
"""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dflash_lab.errors import RENAMED_KEYS, renamed_key_error


def check_renamed_keys(overrides: list[str]) -> None:
    """Refuse a former key on the command line (Hydra's own message would not name the new
    one)."""
    for arg in overrides:
        key = arg.lstrip("+~").split("=", 1)[0]
        if key in RENAMED_KEYS:
            raise renamed_key_error(key, f"command line: {arg}")


def make_logger(logger_cfg: DictConfig):
    """The configured Lightning logger, or None for ``logger=none`` (``_target_: null``).

    Building it touches no file and no network: wandb starts on the first call that logs.
    """
    return instantiate(logger_cfg) if logger_cfg.get("_target_") else None


def log_final(logger, cfg: DictConfig, metrics: dict[str, Any], step: int | None = None) -> None:
    """Log the resolved config and the run's final numbers, then close the logger.

    Only plain numbers are logged (bools as 0/1); anything else in ``metrics`` is skipped.
    """
    if logger is None:
        return
    logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    numbers = {k: int(v) if isinstance(v, bool) else v for k, v in metrics.items()
               if isinstance(v, (int, float))}
    logger.log_metrics(numbers, step=step)
    close_logger(logger)


def close_logger(logger) -> None:
    """Flush and close: csv writes its files; a wandb run is finished (offline: on disk) by
    :class:`~dflash_lab.train.callbacks.WandbRun`, where the wandb-specific work lives."""
    from dflash_lab.train.callbacks import WandbRun

    logger.save()
    logger.finalize("success")
    WandbRun.finish(logger)
