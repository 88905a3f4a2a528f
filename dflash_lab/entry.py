"""What the entry points share besides their Hydra groups: the experiment logger outside
Lightning (the same ``logger`` group as dflash-train; the final log and wandb-only work live
beside :class:`dflash_lab.train.callbacks.WandbRun`), renamed keys and a head chosen by its key
refused with the fix (:func:`check_renamed_keys`) and unknown keys refused before anything is
built (:func:`check_group_keys`) (docs/guarantees.md, "Bad values stop at start-up").
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from dflash_lab.errors import RENAMED_KEYS, renamed_key_error
from dflash_lab.model.heads import DEFAULT as DEFAULT_HEAD
from dflash_lab.paths import CONF_DIR


def check_recipe(overrides: list[str]) -> None:
    """Refuse ``recipe=NAME`` that names no recipe in conf/recipe/, in one line with the
    nearest one (Hydra's own message spans many lines and exits 1)."""
    recipes = CONF_DIR / "recipe"
    if any(a.startswith("hydra.searchpath") for a in overrides):
        return  # Hydra may find the recipe in another config folder
    for arg in overrides:
        name = arg.partition("=")[2] if arg.startswith("recipe=") else None
        if name and name != "null" and not (recipes / f"{name}.yaml").is_file():
            known = sorted(p.stem for p in recipes.glob("*.yaml"))
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean recipe={near[0]}? " if near else ""
            raise ValueError(f"recipe={name}: there is no {recipes / name}.yaml; {hint}the "
                             f"recipes: {known}")


def check_renamed_keys(overrides: list[str]) -> None:
    """Refuse a former key on the command line (Hydra's own message would not name the new one)."""
    for arg in overrides:
        key = arg.lstrip("+~").split("=", 1)[0]
        if key in RENAMED_KEYS:
            raise renamed_key_error(key, f"command line: {arg}")
        if arg.startswith("drafter.variant="):  # Hydra's own refusal spans six lines
            name = arg.partition("=")[2]  # a head is a config group: name the group to choose
            groups = sorted(p.stem for p in (CONF_DIR / "drafter").glob("*.yaml"))
            group = "default" if name == DEFAULT_HEAD else name
            fix = f"drafter={group}" if group in groups else f"drafter=GROUP, one of {groups}"
            raise ValueError(f"drafter.variant={name}: a head is chosen with its config group, "
                             f"not the key: use {fix} (conf/drafter/ sets variant and the head's "
                             "fields)")


#: keys Hydra's ``instantiate`` reads itself
_HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def accepted_keys(target: str) -> frozenset[str] | None:
    """The keyword arguments the ``_target_`` ``target`` takes, from its signature; a class's
    ``**kwargs`` is followed into its bases' ``__init__`` (a data module's to BlockDataModule); a
    function declares its ``**kwargs`` as ``fn.keyword_fields()`` (build_drafter: DrafterConfig's
    fields). None when a ``**kwargs`` goes elsewhere undeclared or ``target`` is not found."""
    try:
        obj = get_object(target)
    except Exception:
        return None
    inits = ([vars(c)["__init__"] for c in inspect.getmro(obj) if "__init__" in vars(c)]
             if inspect.isclass(obj) else [obj])
    names: set[str] = set()
    for fn in inits:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            return None
        names |= {p.name for p in params if p.kind in _NAMED}
        if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
            return frozenset(names - {"self"})
        if declared := getattr(fn, "keyword_fields", None):  # what its **kwargs take
            return frozenset(names | set(declared()))
    return None


def _check_node(node: Any, where: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_node(item, f"{where}[{i}]")
        return
    if not isinstance(node, dict):
        return
    target = node.get("_target_")
    valid = accepted_keys(target) if isinstance(target, str) else None
    unknown = [str(k) for k in node if k not in (valid or ()) and k not in _HYDRA_KEYS]
    if valid is not None and unknown:
        key, more = unknown[0], f" (nor {unknown[1:]})" if len(unknown) > 1 else ""
        near = difflib.get_close_matches(key, sorted(valid), n=1)
        hint = f"did you mean {where}.{near[0]}? " if near else ""
        raise ValueError(f"{where}.{key}: {where} ({target}) takes no key '{key}'{more} (set by "
                         f"the recipe, the group's yaml or the command line); {hint}the keys it "
                         f"takes: {sorted(valid)}. Fix its spelling, or remove it (a recipe's key: "
                         f"~{where}.{key} on the command line)")
    for key, value in node.items():
        _check_node(value, f"{where}.{key}" if where else str(key))


def check_group_keys(cfg: DictConfig) -> None:
    """Refuse a key no ``_target_`` of ``cfg`` takes (every group: data, module, trainer,
    callbacks, target, logger, ...), naming it, the nearest valid key and those it takes."""
    _check_node(OmegaConf.to_container(cfg, resolve=False), "")


def make_logger(logger_cfg: DictConfig):
    """The configured Lightning logger, or None for ``logger=none`` (``_target_: null``).
    Building it touches no file and no network: wandb starts on the first call that logs."""
    return instantiate(logger_cfg) if logger_cfg.get("_target_") else None
