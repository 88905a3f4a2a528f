"""The head interface and its registry: what a drafter variant (``drafter.variant``: dflash1,
dflash2, dspark, ...) adds to the shared DFlash backbone. A head is ONE module under
``dflash_lab/heads/`` holding a :class:`Head` (fields, modules, training terms, draft walk,
serving form); a feature any head may switch on (Laguna's, a draft vocabulary) is a
:class:`Head` listed in ``FEATURES``. The core calls the hooks and never asks which head it
holds; the registry imports a head's module on first use, and a head outside the package
registers itself when the module ``DFLASH_LAB_HEADS`` names (comma-separated) is imported
(docs/architecture.md, "Add a head").
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

#: The head of a config that names none (``drafter.variant``'s default).
DEFAULT = "dflash1"
#: Built-in heads: variant name -> the module that defines (and registers) it.
BUILTIN = {"dflash1": "dflash_lab.heads.dflash1", "dflash2": "dflash_lab.heads.dflash2",
           "dspark": "dflash_lab.heads.dspark", "domino": "dflash_lab.heads.domino",
           "xpress": "dflash_lab.heads.xpress", "lilicorr": "dflash_lab.heads.lilicorr"}
#: Built-in features: applied to every drafter, in this order.
FEATURES = ("dflash_lab.heads.laguna", "dflash_lab.heads.draft_vocab")
#: Environment variable naming modules outside the package that register heads.
PLUGINS_ENV = "DFLASH_LAB_HEADS"

_HEADS: dict[str, Head] = {}
_FEATURES: dict[str, Head] = {}
_OWNERS: dict[str, Head] = {}


class Head:
    """A drafter head: every hook's default is "adds nothing" (a plain DFlash 1 drafter).
    ``fields``: the config fields it owns and their defaults (unset takes the default; another
    head's field must stay unset; two heads may declare one field, each with its own default:
    LiLiCorr reuses DFlash 2's conv fields); ``serving_keys``: those in ``dflash_config``
    (default: all)."""

    name: str = ""  #: the ``drafter.variant`` value (a feature: its own name)
    title: str = ""  #: how messages name it ("DFlash 2")
    architecture: str = ""  #: config.json ``architectures`` entry the engines select it by
    fields: Mapping[str, Any] = {}
    #: what drafts besides the unary argmax ("selector", "Markov walk"); None: the unary head.
    #: Such a head samples from that walk, so the unary expected tau_T is not its (no val/tau_T)
    walk: str | None = None
    #: how messages name its own tensors ("conv and selector tensors")
    tensors: str = ""
    #: its fields whose change changes the set or shapes of its tensors (a warm start refuses
    #: to override them)
    weight_fields: tuple[str, ...] = ()
    #: whether the unary expected tau at T > 0 (val/tau_T) is measured for it
    expected_taus: bool = True
    #: the key of our training spec its :meth:`training_spec` writes (a feature: "laguna")
    spec_key: str | None = None
    #: the engines that serve it (an export for another engine is refused naming it)
    engines: tuple[str, ...] = ("vllm", "sglang")
    #: its ``module.head`` training settings and their defaults (Domino: lambda_start, ...)
    module_settings: Mapping[str, Any] = {}
    #: its :meth:`serving_keys` go at the config.json top level, not in ``dflash_config``
    #: (vLLM reads XPress's ``xpress_*`` there)
    top_level_keys: bool = False
    #: its :meth:`draft` reads the hidden rows of the whole block [B, H] (anchor row 0
    #: included; XPress's refiner), not the drafted slots' [k, H]
    block_rows: bool = False
    #: its :meth:`draft` reads ``context_h`` (LiLiCorr's anchor row): only then does the
    #: drafter's context cache keep the fused context rows [Bt, C, H]
    reads_context: bool = False
    #: the serving engine's runtime settings of its draft walk and their defaults; eval sets
    #: them with ``drafter.walk={KEY: VALUE}`` (Domino: SGLang's candidate pool)
    walk_settings: Mapping[str, Any] = {}

    # ---------------------------------------------------------------- config
    def validate(self, config: Any) -> None:
        """Refuse bad values of this head's fields (``config._fail(key, value, fix)``)."""

    def walk_with(self, config: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        """:attr:`walk_settings` with ``settings`` (``drafter.walk``) applied; ValueError naming
        a key the head's walk does not take."""
        unknown = sorted(set(settings) - set(self.walk_settings))
        if unknown:
            raise ValueError(f"drafter.walk.{unknown[0]}: the {self.title} walk takes "
                             f"{sorted(self.walk_settings) or 'no settings'}")
        return {**self.walk_settings, **settings}

    def serving_keys(self, config: Any) -> dict[str, Any]:
        """The head's entries of ``dflash_config`` in the serving config.json."""
        return {key: getattr(config, key) for key in self.fields}

    def training_spec(self, config: Any) -> dict[str, Any]:
        """Entries of our training spec (``dflash_lab_training_spec``) no engine reads."""
        return {}

    def check_read(self, fields: dict[str, Any], source: str) -> None:
        """Refuse a config.json (``fields``: what was read) this head's owners could not load."""

    # ---------------------------------------------------------------- modules
    def attach(self, drafter: Any) -> None:
        """Add this head's modules to ``drafter`` (names are their state-dict prefixes)."""

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Serving name -> shape of every tensor :meth:`attach` and :meth:`layer_modules` add
        (what an export must hold and an engine loads)."""
        return {}

    def layer_modules(self, config: Any) -> dict[str, Any]:
        """Modules of one draft layer (DFlash 2: its sublayer convs)."""
        return {}

    def min_slots(self, config: Any) -> int:
        """Fewest block slots a draft runs on."""
        return 2

    # ---------------------------------------------------------------- training
    def check_training(self, config: Any, module: Any) -> None:
        """Refuse module settings this head cannot train ``config`` with (DFlashModule's
        construction: a head before the teacher is chosen, a feature after)."""

    def settings(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``module.head`` over :attr:`module_settings`; a key it does not have is refused."""
        unknown = sorted(set(given) - set(self.module_settings))
        if unknown:
            raise ValueError(f"module.head: {unknown} are not settings of the {self.title} head "
                             f"(its settings: {sorted(self.module_settings)}); remove them")
        return {**self.module_settings, **given}

    def needs_distribution(self, module: Any) -> str | None:
        """The setting of this head that trains on the target's distribution, named for the
        refusal when the data holds none (DFlash 2: module.selector.target=distribution)."""
        return None

    def unary_top_k(self, config: Any) -> int:
        """Candidates per slot the CE pass keeps (the unary top-K a selector re-ranks)."""
        return 0

    def head_inputs(self, module: Any, step: Any) -> None:
        """Change ``step.head_in`` / ``step.lm_head`` before the CE pass (DSpark's bias)."""

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """Add this head's loss pieces to ``out`` after the CE pass (selector, confidence)."""

    def terms(self, module: Any, out: Any, step: int) -> list[Any]:
        """This head's named terms of the objective at optimizer step ``step``
        (train/objective.py ``Term``), summed after the label and accept terms."""
        return []

    def probe_outputs(self, drafter: Any, hidden_bph: Any, unary_bpv: Any,
                      anchor_b: Any) -> list[Any]:
        """Outputs of this head's own modules on the export self-check's probe block (hidden
        [1, B, H], unary logits [1, B, V'], anchor [1]), compared between the source and the
        reloaded drafter beside the unary logits, so a lost or renamed tensor of it fails."""
        return []

    # ---------------------------------------------------------------- eval
    def walk_metrics(self) -> Any | None:
        """None when the greedy tau is the CE pass's; else fresh metrics of the walk it drafts
        with, whose tau replaces it (DFlash 2's ``SelectorMetrics``): ``correct(out)`` [Bt, N,
        B] in a step; ``update(out)``, ``compute()`` (``val/...`` -> value, ``val/tau`` too),
        ``reset()`` over validation; ``features(drafter, lm_head, hidden_bnph, anchor_ids_bn,
        labels_bnp, valid_bnp)`` -> (walk, oracle) flags in features mode."""
        return None

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any,
              embed_tokens: Any = None, context_h: Any = None) -> tuple[Any, Any] | None:
        """This head's draft walk over one block: (tokens [k], their probabilities or None),
        or None for the unary head's draft (argmax, or a sample at ``temperature``).
        ``embed_tokens``: the target's embedding table (Domino's GRU reads it); ``context_h``
        [H]: the fused context row of the last committed position (LiLiCorr's anchor row)."""
        return None


def register(head: Head, *, feature: bool = False) -> Head:
    """Make ``head`` available as ``drafter.variant=head.name`` (or, ``feature``, on every
    drafter). Registering a name twice replaces the earlier head (tests reload modules)."""
    (_FEATURES if feature else _HEADS)[head.name] = head
    _OWNERS.clear()
    return head


def unregister(name: str) -> None:
    """Forget the head or feature ``name`` (a test that registered one restores the registry)."""
    _HEADS.pop(name, None)
    _FEATURES.pop(name, None)
    _OWNERS.clear()


def _load_builtins() -> None:
    """Import the built-in heads and features, then the modules ``DFLASH_LAB_HEADS`` names."""
    plugins = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    for module in (*BUILTIN.values(), *FEATURES, *plugins):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ImportError(f"{PLUGINS_ENV}: cannot import the head module '{module}' "
                              f"({err}); put it on the import path or remove it") from err


def get(name: str) -> Head:
    """The head registered as ``name``; KeyError when there is none."""
    if name not in _HEADS:
        _load_builtins()
    return _HEADS[name]


def names() -> list[str]:
    """Every head name: built in, registered and named by ``DFLASH_LAB_HEADS``."""
    _load_builtins()
    return sorted({*BUILTIN, *_HEADS})


def features() -> list[Head]:
    """Every feature, applied to every drafter."""
    _load_builtins()
    return list(_FEATURES.values())


def heads() -> list[Head]:
    """Every head, built in and registered."""
    _load_builtins()
    return [get(n) for n in names()]


def field_owners() -> dict[str, Head]:
    """Every field a head or feature declares -> the first (by name) that declares it."""
    if not _OWNERS:
        for part in (*heads(), *features()):
            for key in part.fields:
                _OWNERS.setdefault(key, part)
    return _OWNERS
