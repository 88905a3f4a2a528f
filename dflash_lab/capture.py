"""dflash-capture: run a frozen target over conversations and write feature shards.

Thin entry point: Hydra config (conf/capture.yaml) -> target -> dataset -> run_capture.
Runs as one process or under ``torchrun`` (RANK / WORLD_SIZE split the shards; see
docs/capture.md).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.data.conversations import load_conversations
from dflash_lab.data.demo_corpus import write_demo_jsonl
from dflash_lab.model.config import build_target_layer_ids
from dflash_lab.paths import CONF_DIR
from dflash_lab.runinfo import write_run_info

log = logging.getLogger("dflash_lab.capture")


def rank_and_world() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from the environment torchrun sets; (0, 1) otherwise."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} / WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    return rank, world


def data_path(data: DictConfig) -> str:
    """The conversations file; ``demo`` writes the built-in demo conversations first."""
    if data.path == "demo":
        return str(write_demo_jsonl(data.demo_file, num=data.demo_rows, seed=data.demo_seed))
    return str(data.path)


def _settings(cfg: DictConfig, target) -> CaptureSettings:
    c = cfg.capture
    ids = c.target_layer_ids
    if ids is None:
        ids = build_target_layer_ids(target.num_hidden_layers, c.num_layers)
    return CaptureSettings(
        out_dir=str(c.out_dir), target_layer_ids=[int(i) for i in ids],
        max_length=c.max_length, hidden_dtype=c.hidden_dtype, shard_size=c.shard_size,
        last_turn_only=c.last_turn_only, enable_thinking=c.enable_thinking,
        batch_size=c.batch_size, verify_existing=c.verify_existing,
    )


def capture(cfg: DictConfig) -> dict[str, Any] | None:
    """Run this process's part of the capture; returns the manifest once all shards exist."""
    rank, world = rank_and_world()
    target = instantiate(cfg.target)
    path = data_path(cfg.data)
    dataset = load_conversations(path, split=cfg.data.split, limit=cfg.data.limit,
                                 shuffle_seed=cfg.data.shuffle_seed)
    settings = _settings(cfg, target)
    source = {"path": path, "split": cfg.data.split, "limit": cfg.data.limit,
              "shuffle_seed": cfg.data.shuffle_seed}
    if rank == 0:
        write_run_info(settings.out_dir, cfg, world_size=world)
    manifest = run_capture(target, dataset, settings, source, rank=rank, world_size=world,
                           progress=cfg.capture.progress)
    out = Path(settings.out_dir).absolute()
    if manifest is not None:
        log.info("capture complete: %d samples, %d tokens (%d with loss), %d shards -> %s",
                 manifest["num_samples"], manifest["num_tokens"], manifest["num_loss_tokens"],
                 len(manifest["shards"]), out)
    else:
        log.info("rank %d finished its shards in %s; waiting for the other ranks", rank, out)
    return manifest


@hydra.main(config_path=str(CONF_DIR), config_name="capture", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    log.debug("config:\n%s", OmegaConf.to_yaml(cfg))
    capture(cfg)


def main() -> None:
    """Console entry point (``dflash-capture``)."""
    _hydra_main()


if __name__ == "__main__":
    main()
