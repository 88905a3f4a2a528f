"""How each stage's command line derives from the composed train config (dflash_lab/pipeline.py):
one target for every stage, the drafter's layers for the capture, the export section as
dflash-export options, and each stage's composed config (what its record's inputs hash).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from dflash_lab.entry import check_recipe
from dflash_lab.paths import CONF_DIR

#: Target keys that belong to one stage (capture may run bfloat16, eval float32, train
#: head-only): every other key of train's target section is passed to capture and eval.
STAGE_TARGET_KEYS = ("_target_", "dtype", "device", "head_only")


def compose(config_name: str, overrides: list[str]) -> DictConfig:
    """``conf/<config_name>.yaml`` + overrides, as the stage's command composes it (Hydra's
    choices kept under ``hydra``); a recipe that does not exist is refused in one line."""
    check_recipe(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides,
                                 return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override syntax (strings quoted only when they need it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value)
    if isinstance(value, str) and any(c in text for c in " ,[]{}()='\"\\:$"):
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def target_args(train_cfg: DictConfig) -> list[str]:
    """The train stage's target (group, identity keys) as capture / eval overrides: one target."""
    section = OmegaConf.to_container(train_cfg.target, resolve=True)
    args = [f"target={train_cfg.hydra.runtime.choices.target}"]
    return args + [f"target.{k}={hydra_value(v)}" for k, v in section.items()
                   if k not in STAGE_TARGET_KEYS]


def target_location(train_cfg: DictConfig) -> str:
    """Where the target lives (a directory, hub id or GGUF file), for ``dflash-export --target``."""
    target = train_cfg.target
    where = target.get("name_or_path") or target.get("path")
    gguf = target.get("gguf_file")
    return str(Path(where) / gguf) if gguf else str(where)


def export_options(section: dict[str, Any]) -> list[str]:
    """cfg.export as ``dflash-export --KEY`` options (``enabled``/``out_dir`` are train's)."""
    return [f"--{key}" if value is True else f"--no-{key}" if value is False else f"--{key}={value}"
            for key, value in section.items()  # null: the exporter's default
            if key not in ("enabled", "out_dir") and value is not None]


def option_args(args: list[str]) -> list[str]:
    """``export:dtype=X`` is accepted for ``export:--dtype=X``."""
    return [a if a.startswith("-") else "--" + a for a in args]


def capture_layers(train_cfg: DictConfig) -> list[str]:
    ids = train_cfg.drafter.target_layer_ids  # an int n: the capture spreads the same n ids
    out = [f"capture.target_layer_ids={hydra_value(ids if isinstance(ids, int) else list(ids))}"]
    width = train_cfg.drafter.get("target_hidden_size")
    return out + ([f"capture.target_hidden_size={int(width)}"] if width is not None else [])


def is_offline(train_cfg: DictConfig) -> bool:
    """Does the recipe train on a capture (data=offline), so that capture is one of its stages."""
    from dflash_lab.train.checks import data_class

    return not data_class(train_cfg.data).runs_target


def stage_config(name: str, args: list[str]) -> dict[str, Any]:
    """The stage's composed config (unresolved: ``${now:...}`` stays stable), refused here when
    a required value is missing, before anything runs."""
    cfg = compose(name, args)
    with open_dict(cfg):
        del cfg["hydra"]
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(f"the {name} stage needs {missing}: set them in the recipe's "
                         f"pipeline.{name} list or on the command line ({name}:{missing[0]}=...)")
    return OmegaConf.to_container(cfg, resolve=False)
