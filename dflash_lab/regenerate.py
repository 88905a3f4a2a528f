"""dflash-regenerate: rewrite a conversation set's assistant turns with the target (on-policy).
Hydra config (conf/regenerate.yaml: groups target, conversations at ``data``, logger) -> target ->
conversations -> run_regenerate, generating here (``regenerate.backend=hf``) or through a running
vLLM/SGLang server (``server``); one process or several (``torchrun``: RANK / WORLD_SIZE split the
part files), resumable; dflash-capture and dflash-train read ``<out_dir>/conversations.jsonl``.
"""

from __future__ import annotations

import logging
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dflash_lab.capture import rank_and_world
from dflash_lab.data.regenerate_loop import MERGED_FILE, RegenerateSettings, run_regenerate
from dflash_lab.entry import check_group_keys, check_renamed_keys, make_logger
from dflash_lab.errors import user_errors
from dflash_lab.paths import CONF_DIR
from dflash_lab.runinfo import write_run_info
from dflash_lab.serving.completions import open_server
from dflash_lab.serving.settings import ServerSettings, server_settings
from dflash_lab.train.callbacks import log_final
from dflash_lab.writer_lock import writer_lock

log = logging.getLogger("dflash_lab.regenerate")


def regenerate(cfg: DictConfig) -> dict[str, Any] | None:
    """Run this process's parts; returns the manifest once every part exists. One
    regeneration writes an output directory at a time (:func:`writer_lock`, rank 0)."""
    check_group_keys(cfg)
    settings = RegenerateSettings(**OmegaConf.to_container(cfg.regenerate.settings))
    with writer_lock(settings.out_dir, what="regenerate.settings.out_dir"):
        rank, world = rank_and_world()
        server_settings = make_server_settings(cfg)
        if server_settings is not None and "head_only" in cfg.target \
                and not cfg.target.get("gguf_file"):
            # Only the tokenizer, chat template and stop tokens are needed here: skip the decoder
            # weights (head-only reads safetensors; a GGUF target is loaded whole).
            cfg.target.head_only = True
        logger = make_logger(cfg.logger)
        target = instantiate(cfg.target)
        data = instantiate(cfg.data)
        if rank == 0:
            write_run_info(settings.out_dir, cfg, world_size=world)
        serving = (nullcontext() if server_settings is None else
                   open_server(server_settings, Path(settings.out_dir) / "server.log", world))
        with serving as server:
            manifest = run_regenerate(target, data.dataset, settings, data.source, rank=rank,
                                      world_size=world, progress=cfg.regenerate.progress,
                                      server=server)
        out = Path(settings.out_dir).absolute()
        if manifest is None:
            log.info("rank %d finished its parts in %s; waiting for the other ranks", rank, out)
        else:
            log.info("regenerated %d conversations (%d dropped: no turn fitted max_length) -> %s",
                     manifest["num_conversations"], manifest["dropped"], out / MERGED_FILE)
            log_final(logger, cfg, {"regenerate/num_conversations": manifest["num_conversations"],
                                    "regenerate/dropped": manifest["dropped"]})
        return manifest


def make_server_settings(cfg: DictConfig) -> ServerSettings | None:
    """The server settings for ``regenerate.backend=server``, None for ``hf``."""
    backend = cfg.regenerate.backend
    if backend not in ("hf", "server"):
        raise ValueError(f"regenerate.backend={backend!r}: use hf (generate here) or server "
                         "(a running vLLM/SGLang server, see server.* in conf/server/default.yaml)")
    return None if backend == "hf" else server_settings(cfg.server)


@hydra.main(config_path=str(CONF_DIR), config_name="regenerate", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    log.debug("config:\n%s", OmegaConf.to_yaml(cfg))
    with user_errors():
        regenerate(cfg)


def main() -> None:
    """Console entry (``dflash-regenerate``) without a recipe (with one: dflash_lab.commands)."""
    with user_errors():
        check_renamed_keys(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
