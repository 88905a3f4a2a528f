"""The export settings, defined once (:data:`EXPORT_OPTIONS`): ``dflash-export``'s ``--KEY``
options, the Hydra ``export:`` section and dflash-train's end-of-run export read the same keys,
and ``--recipe NAME`` takes a recipe's ``export:`` section as defaults. Imports no Hydra:
:func:`recipe_export_section` composes a recipe only when called.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash_lab.export.api import FORMATS, OURS
from dflash_lab.export.engines import SGLANG_BACKENDS
from dflash_lab.export.engines.sglang import DEFAULT_RELEASE
from dflash_lab.export.engines.sglang import RELEASES as SGLANG_RELEASES
from dflash_lab.export.weights import DTYPES


@dataclass(frozen=True)
class ExportOption:
    """One export setting. ``key``: the Hydra ``export.KEY`` and the CLI ``--KEY``;
    ``kwarg``: the :func:`~dflash_lab.export.api.export_drafter` argument it sets;
    ``choices``: the allowed values (None: a bool, ``--KEY`` / ``--no-KEY`` on the CLI);
    ``old``: the former CLI spelling and the value it set (still accepted, with a note)."""

    key: str
    kwarg: str
    default: Any
    choices: tuple[str, ...] | None
    help: str
    old: tuple[str, Any] | None = None


EXPORT_OPTIONS: tuple[ExportOption, ...] = (
    ExportOption("engine", "engine", "both", ("both", "vllm", "sglang"),
                 "engines the export must serve correctly"),
    ExportOption("dtype", "dtype", "bfloat16", tuple(DTYPES), "dtype of the written weights"),
    ExportOption("format", "format", OURS, tuple(FORMATS),
                 "layout of OUT_DIR: dflash-lab (ours), muse-glimmer (the Muse Glimmer "
                 "assistant's MuseGlimmerAssistantModel) or laguna (DFlashLagunaForCausalLM, "
                 "for drafter=laguna runs); refused for what the layout cannot carry"),
    ExportOption("sglang_version", "sglang_version", DEFAULT_RELEASE, tuple(SGLANG_RELEASES),
                 "SGLang release the export must be right for (others only warn)",
                 old=("--sglang-version", None)),
    ExportOption("sglang_attention_backend", "sglang_backend", "any", tuple(SGLANG_BACKENDS),
                 "SGLang draft attention backend you will serve with "
                 "(--speculative-draft-attention-backend); any = every one read",
                 old=("--sglang-attention-backend", None)),
    ExportOption("allow_lossy", "allow_lossy", False, None,
                 "turn engine-rule refusals into loud warnings recorded in the report",
                 old=("--allow-lossy", True)),
    ExportOption("self_check", "self_check", True, None,
                 "reload the export and compare logits (--no-self_check skips it; recorded "
                 "in the report)", old=("--no-self-check", False)),
)
#: Keys of the Hydra export section that are no dflash-export option: whether dflash-train
#: exports at all, and where (dflash-export's positional OUT_DIR).
TRAIN_ONLY_KEYS = ("enabled", "out_dir")
BY_KEY = {o.key: o for o in EXPORT_OPTIONS}


def check_section(section: Mapping[str, Any], where: str) -> None:
    """Refuse an unknown key or value in an ``export:`` section (else a typo is the default)."""
    known = [*BY_KEY, *TRAIN_ONLY_KEYS]
    for key, value in section.items():
        if key not in known:
            raise ValueError(f"{where}: export.{key} is no export setting; the keys are "
                             f"{known} (export/options.py)")
        option = BY_KEY.get(key)
        if option is None or value is None or (isinstance(value, str) and value.startswith("${")):
            continue  # not an option, its default (null), or an interpolation (checked resolved)
        if option.choices is None and not isinstance(value, bool):
            raise ValueError(f"{where}: export.{key}={value!r} must be true or false")
        if option.choices is not None and str(value) not in option.choices:
            raise ValueError(f"{where}: export.{key}={value!r} is not one of "
                             f"{list(option.choices)}")


def export_kwargs(section: Mapping[str, Any], where: str = "the export section") -> dict:
    """``export_drafter``'s keyword arguments of an export section (its values, else defaults)."""
    check_section(section, where)
    return {o.kwarg: (str(section[o.key]) if o.choices is not None else bool(section[o.key]))
            if section.get(o.key) is not None else o.default for o in EXPORT_OPTIONS}


class _Deprecated(argparse.Action):
    """A former option spelling: stores like the current one and says so on stderr."""

    def __init__(self, option_strings, dest, new: str, const: Any = None, **kw):
        self.new = new
        super().__init__(option_strings, dest, nargs=0 if const is not None else None,
                         const=const, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"dflash-export: {option_string} is deprecated, use {self.new} (the Hydra "
              "export section's key)", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.const is not None else values)


def add_export_options(parser: argparse.ArgumentParser) -> None:
    """``--KEY`` for every option (default None: not given, so a recipe's value or the default
    applies), and the deprecated former spellings."""
    for o in EXPORT_OPTIONS:
        kind = ({"action": argparse.BooleanOptionalAction} if o.choices is None
                else {"choices": list(o.choices)})
        parser.add_argument(f"--{o.key}", dest=o.key, default=None,
                            help=f"{o.help} (default: {o.default})", **kind)
        if o.old is not None:
            new = f"--{o.key}" if o.old[1] in (None, True) else f"--no-{o.key}"
            parser.add_argument(o.old[0], dest=o.key, action=_Deprecated, new=new,
                                const=o.old[1], help=argparse.SUPPRESS,
                                **({"choices": list(o.choices)} if o.old[1] is None else {}))


def resolve_options(args: argparse.Namespace, section: Mapping[str, Any] | None,
                    where: str = "") -> dict[str, Any]:
    """{key: value}: from the command line, else the recipe's ``section``, else the default."""
    base = {o.key: o.default for o in EXPORT_OPTIONS}
    if section:
        check_section(section, where)
        base.update({k: v for k, v in section.items() if k in BY_KEY and v is not None})
    given = {o.key: getattr(args, o.key) for o in EXPORT_OPTIONS
             if getattr(args, o.key) is not None}
    return {**base, **given}


def recipe_export_section(name: str) -> dict[str, Any]:
    """The ``export:`` section of ``dflash-train recipe=NAME`` (conf/train.yaml's, as the recipe
    overrides it), composed as dflash-train composes it; ``out_dir`` left unresolved."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException
    from omegaconf import OmegaConf

    from dflash_lab.paths import CONF_DIR

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=[f"recipe={name}"])
    except MissingConfigException as err:
        known = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))
        raise ValueError(f"--recipe {name}: no such recipe in {CONF_DIR / 'recipe'}; the "
                         f"recipes are {known}") from err
    finally:
        GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg.export, resolve=False)
