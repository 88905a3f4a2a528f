"""``dflash-train``: Hydra entry point (conf/train.yaml; recipes via ``recipe=NAME``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dflash_lab.paths import CONF_DIR


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from dflash_lab.train.run import train

    train(cfg)


def main() -> None:
    """Console entry point (``dflash-train``)."""
    _hydra_main()


if __name__ == "__main__":
    main()
