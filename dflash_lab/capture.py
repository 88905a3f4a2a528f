"""dflash-capture: run a frozen target over conversations, write feature shards (docs/capture.md).
Thin entry point: Hydra config (conf/capture.yaml) -> target -> conversations -> run_capture, in
process or from a vLLM server (:mod:`dflash_lab.data.capture_server`), alone or under ``torchrun``.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dflash_lab.data.capture_loop import CaptureSettings, build_plan, claim_dir, run_capture
from dflash_lab.data.capture_server import (
    check_server,
    log_argmax_checks,
    make_server_settings,
    open_capture_server,
)
from dflash_lab.entry import check_group_keys, check_renamed_keys, make_logger
from dflash_lab.errors import user_errors
from dflash_lab.launch import detect_launch
from dflash_lab.model.config import resolve_target_layer_ids
from dflash_lab.paths import CONF_DIR
from dflash_lab.runinfo import write_run_info
from dflash_lab.train.callbacks import log_final
from dflash_lab.writer_lock import writer_lock

log = logging.getLogger("dflash_lab.capture")
#: Manifest counts sent to the logger when the capture completes.
_LOGGED = ("num_samples", "num_tokens", "num_loss_tokens")


def rank_and_world() -> tuple[int, int]:
    """(global rank, world size) of this process: from torchrun or SLURM's srun
    (:func:`dflash_lab.launch.detect_launch`), else RANK / WORLD_SIZE set by hand, else (0, 1)."""
    launch = detect_launch()
    if launch is not None:
        return launch.rank, launch.world_size
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} / WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    return rank, world


def check_context(target, max_length: int) -> bool:
    """Warn when ``capture.max_length`` passes the target's declared context: the capture still
    runs (RoPE extrapolates) but features past that length are ones the target was never
    trained to give, which a drafter then learns from. True when within the context."""
    limit = target.max_position_embeddings
    if limit is None or max_length <= limit:
        return True
    log.warning("capture.max_length=%d is beyond the target's max_position_embeddings=%d: rows "
                "longer than %d tokens get features from positions the target never trained "
                "on (extend its context, e.g. rope scaling, or lower capture.max_length)",
                max_length, limit, limit)
    return False


def _settings(cfg: DictConfig, target) -> CaptureSettings:
    c = cfg.capture
    ids = resolve_target_layer_ids(c.target_layer_ids, target.num_hidden_layers,
                                   "capture.target_layer_ids")
    return CaptureSettings(
        out_dir=str(c.out_dir), target_layer_ids=ids,
        max_length=c.max_length, hidden_dtype=c.hidden_dtype, shard_size=c.shard_size,
        last_turn_only=c.last_turn_only, enable_thinking=c.enable_thinking,
        batch_size=c.batch_size, verify_existing=c.verify_existing, bad_rows=c.bad_rows,
        distribution=tuple(c.get("distribution") or ()),
        distribution_topk=int(c.get("distribution_topk", 64)),
        target_hidden_size=c.get("target_hidden_size"),
    )


def capture(cfg: DictConfig) -> dict[str, Any] | None:
    """Run this process's part of the capture; returns the manifest once all shards exist.
    One capture writes an output directory at a time (:func:`writer_lock`, rank 0)."""
    check_group_keys(cfg)
    with writer_lock(cfg.capture.out_dir, what="capture.out_dir"):
        rank, world = rank_and_world()
        served = make_server_settings(cfg)
        if served is not None and "head_only" in cfg.target and not cfg.target.get("gguf_file"):
            # the engine runs the decoder: only the final norm and LM head (labels) are needed here
            cfg.target.head_only = True
        logger = make_logger(cfg.logger)
        target = instantiate(cfg.target)
        data = instantiate(cfg.data)
        settings = _settings(cfg, target)
        check_context(target, settings.max_length)
        serving = (nullcontext() if served is None else open_capture_server(
            served, target, settings, world))
        with serving as server:
            engine = None if server is None else check_server(server, target, settings.max_length)
            if rank == 0:  # refuse a directory captured with other settings before the record
                claim_dir(Path(settings.out_dir), build_plan(target, settings, len(data.dataset),
                                                              data.source, engine))
                write_run_info(settings.out_dir, cfg, world_size=world)
            manifest = run_capture(target, data.dataset, settings, data.source, rank=rank,
                                   world_size=world, progress=cfg.capture.progress, server=server,
                                   engine=engine)
            if server is not None:
                log_argmax_checks(server)
        out = Path(settings.out_dir).absolute()
        if manifest is not None:
            log.info("capture complete: %d samples, %d tokens (%d with loss), %d shards -> %s",
                     manifest["num_samples"], manifest["num_tokens"], manifest["num_loss_tokens"],
                     len(manifest["shards"]), out)
            log_final(logger, cfg, {f"capture/{k}": manifest[k] for k in _LOGGED}
                      | {"capture/num_shards": len(manifest["shards"])})
        else:
            log.info("rank %d finished its shards in %s; waiting for the other ranks", rank, out)
        return manifest


#: what a capture stopped by a full disk keeps (docs/guarantees.md, "A full disk")
KEPT = ("the finished shards (a half-written one is removed); the rerun with the same settings "
        "writes only the missing ones")


@hydra.main(config_path=str(CONF_DIR), config_name="capture", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    log.debug("config:\n%s", OmegaConf.to_yaml(cfg))
    with user_errors(KEPT):
        capture(cfg)


def main() -> None:
    """Console entry point (``dflash-capture``) without a recipe (with one: dflash_lab.commands)."""
    with user_errors():
        check_renamed_keys(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
