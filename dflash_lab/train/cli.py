"""``dflash-train``: Hydra entry point (conf/train.yaml; recipes via ``recipe=NAME``).

Under torchrun or srun the launch is checked against the trainer config before anything loads
(README, "Past one machine").
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dflash_lab.entry import check_recipe, check_renamed_keys
from dflash_lab.errors import user_errors
from dflash_lab.launch import check_shared_run_dir, check_trainer_launch, detect_launch
from dflash_lab.paths import CONF_DIR
from dflash_lab.terminal import one_handler, setup

RUN_NAME_ENV = "DFLASH_RUN_NAME"  #: the run name Lightning's launcher hands its child processes


def check_launch(cfg: DictConfig, trainer_source: str = "the trainer config") -> None:
    """Start-up checks of a multi-process launch: ``trainer.num_nodes`` / ``devices`` against
    torchrun or srun, and one run directory for every process."""
    launch = detect_launch()
    check_trainer_launch(cfg.trainer, launch, trainer_source)
    raw = OmegaConf.to_container(cfg, resolve=False)
    check_shared_run_dir(raw.get("run_name"), raw["paths"].get("output_dir"), launch)
    if launch is None:
        share_run_name(cfg, os.environ)


def share_run_name(cfg: DictConfig, env: MutableMapping[str, str]) -> None:
    """Lightning's own launcher (``trainer=ddp_cpu``, ``ddp`` without torchrun) re-runs this
    command for local ranks >= 1, each of which would read its own start time for the default
    ``run_name``: the first process puts its run name in the environment they inherit."""
    if int(env.get("LOCAL_RANK", 0) or 0) > 0 and RUN_NAME_ENV in env:
        cfg.run_name = env[RUN_NAME_ENV]
    else:
        env[RUN_NAME_ENV] = str(cfg.run_name)


#: what a run stopped by a full disk keeps (docs/guarantees.md, "A full disk")
KEPT = ("the checkpoints saved before it (last.ckpt whole: a half-written one is removed); the "
        "rerun resumes from last.ckpt (ckpt_path=auto)")


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    with user_errors(KEPT):
        choice = HydraConfig.get().runtime.choices.get("trainer")
        check_launch(cfg, f"conf/trainer/{choice}.yaml and the command line" if choice
                     else "the command line")
        from dflash_lab.train.run import train

        one_handler()  # Lightning is imported now, after Hydra's logging set-up
        train(cfg)


def main() -> None:
    """Console entry point (``dflash-train``)."""
    setup()
    with user_errors():
        check_recipe(sys.argv[1:])
        check_renamed_keys(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
