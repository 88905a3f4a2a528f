"""What the entry points share besides their Hydra groups (conf/logger/, conf/target/, ...).

- The experiment logger outside Lightning: dflash-capture, dflash-regenerate and dflash-eval
  instantiate the same ``logger`` group as dflash-train (a Lightning logger, or none) and log
  through the generic Lightning logger calls, so wandb and csv both work.
- A guard for the tiny target's build directory: ``target=tiny target.path=DIR`` rebuilds DIR
  when its marker is stale, so a DIR that holds something else (a user's model) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dflash_lab.target.tiny import MARKER_FILE


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
    """Flush and close: csv writes its files; a wandb run is finished (offline: on disk)."""
    logger.save()
    logger.finalize("success")
    if type(logger).__name__ == "WandbLogger":
        logger.experiment.finish()


def check_tiny_build_dir(target_cfg: DictConfig) -> None:
    """ValueError when ``target=tiny`` would build over a directory that is not a tiny target.

    The tiny target replaces a build directory whose marker does not match its recipe; a
    non-empty directory without any marker is not one of ours (most likely an HF model meant
    for ``target=hf``), so it is never touched.
    """
    if not str(target_cfg.get("_target_", "")).endswith("load_tiny_target"):
        return
    path = target_cfg.get("path")
    root = Path(path) if path else None
    if root is not None and root.is_dir() and any(root.iterdir()) \
            and not (root / MARKER_FILE).is_file():
        raise ValueError(f"target.path={path} is not a tiny target build directory (no "
                         f"{MARKER_FILE}); for the model in it use target=hf "
                         f"target.name_or_path={path}")
