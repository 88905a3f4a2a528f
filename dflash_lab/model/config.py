"""DrafterConfig: THE definition of a DFlash drafter: fields, validation and the resolved
per-layer layout (:meth:`DrafterConfig.layer_specs`, which everything else reads instead of the
raw ``layer_types`` / ``is_causal``). The config.json form is model/serving_form.py's, each head's
fields its module's; third-party config.json files are read by ``export``. Target layer id ``i``
is the OUTPUT of decoder layer ``i`` (HF ``hidden_states[i + 1]``) (docs/training.md, "The
drafter and its attention").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash_lab.attention.mask import LayerSpec
from dflash_lab.model import heads
from dflash_lab.model.rope import normalize_scaling, positive_number
from dflash_lab.model.serving_form import (  # noqa: F401  (the serving form's names, re-exported)
    CORE_DFLASH_KEYS,
    HF_BOOKKEEPING_KEYS,
    OUR_TOP_KEYS,
    SCALE_DEFAULTS,
    TARGET_IDENTITY_KEY,
    TRAINING_SPEC_KEY,
    _suggest,
    parse_ours,
    reject_unknown_keys,
    require_keys,
    serving_dict,
    shape_fields,
    variant_keys,
    variant_of,
)

log = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

DFLASH1 = heads.DEFAULT
DFLASH2 = "dflash2"
DSPARK = "dspark"
#: Names read from the head modules (model/heads.py): each head declares its own fields,
#: defaults and serving class; these views keep one definition.
_HEAD_VIEWS = {"DFLASH2_DEFAULTS": "dflash2", "DSPARK_DEFAULTS": "dspark",
               "LAGUNA_DEFAULTS": "laguna"}


def __getattr__(name: str) -> Any:
    """Views of the head modules' declarations (module ``__getattr__``, PEP 562)."""
    if name in _HEAD_VIEWS:
        part = {p.name: p for p in (*heads.heads(), *heads.features())}[_HEAD_VIEWS[name]]
        return dict(part.fields)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_target_layer_ids(ids: Any, num_target_layers: int, key: str) -> list[int]:
    """``target_layer_ids`` as every config spells it (``drafter.target_layer_ids``,
    ``capture.target_layer_ids``): an int n = :func:`build_target_layer_ids` (L, n), or an
    explicit list of ids; anything else is refused naming ``key``."""
    if isinstance(ids, int) and not isinstance(ids, bool):
        return build_target_layer_ids(num_target_layers, ids)
    if isinstance(ids, (list, tuple)) or (hasattr(ids, "__iter__") and not isinstance(ids, str)):
        return [int(i) for i in ids]
    raise ValueError(f"{key}={ids!r}: give an int n (n evenly spread target layers, e.g. 5) or "
                     "an explicit list of layer ids (e.g. [1, 9, 17, 25, 33])")


def build_target_layer_ids(num_target_layers: int, num_draft_inputs: int) -> list[int]:
    """Evenly spread target layer ids (z-lab convention) from layer 1 to layer L-3:
    ``round(1 + i * (L - 4) / (n - 1))`` for i in 0..n-1, ``[L // 2]`` for n == 1, with Python's
    ``round`` (half to even) as z-lab's ``build_target_layer_ids`` and SGLang compute it: Qwen3-8B
    (L=36, n=5) gives [1, 9, 17, 25, 33]; SmolLM2 (L=30, n=5) [1, 8, 14, 20, 27] (20.5 -> 20)."""
    if num_draft_inputs < 1:
        raise ValueError(f"num_draft_inputs={num_draft_inputs}: need at least one target layer")
    if num_target_layers < 4 and num_draft_inputs > 1:
        raise ValueError(
            f"num_target_layers={num_target_layers} is too shallow for {num_draft_inputs} "
            "evenly spread layers (the rule needs L >= 4); pass target_layer_ids explicitly"
        )
    if num_draft_inputs == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_inputs - 1)) for i in range(num_draft_inputs)]


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape and attention layout of a DFlash drafter (Qwen3-style decoder layers, HF Qwen3
    names). ``hidden_size`` must equal the target's (the drafter shares its embedding and LM
    head). ``target_hidden_size``: the width of one target layer's features (``fc`` reads
    len(target_layer_ids) of them): H, except a multi-stream target's flattened streams (n*H)."""

    hidden_size: int  #: = target hidden size H
    num_hidden_layers: int  #: number of draft layers (paper: 5)
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  #: = target vocab size
    mask_token_id: int  #: embedding row used for MASK slots (Qwen3: 151669)
    num_target_layers: int  #: number of decoder layers of the target
    target_layer_ids: list[int]  #: z-lab convention: output of target layer i
    head_dim: int | None = None  #: default hidden_size // num_attention_heads
    block_size: int = 16  #: B: anchor + (B-1) MASK slots drafted in one pass
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    #: None = plain RoPE; else one of model/rope.py's types with the keys it reads (normalized:
    #: ``rope_type`` spelling, yarn/llama3 ``original_max_position_embeddings`` explicit)
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960  #: the target's; yarn/llama3 default original length
    attention_bias: bool = False
    #: one of "full_attention" / "sliding_attention" per layer; None = all full
    layer_types: list[str] | None = None
    sliding_window: int | None = None  #: W for sliding layers (counts the query itself)
    #: True/False for every layer, or one bool per layer; None = legacy rule
    #: (sliding -> causal, full -> bidirectional)
    is_causal: bool | list[bool] | None = None
    learned_mask_embedding: bool = False  #: one trainable H-vector used in every MASK slot
    attention_sink_bias: bool = False  #: one learnable sink logit per head and layer
    #: the head (model/heads.py; one module each in dflash_lab/heads/: dflash1, dflash2, dspark,
    #: ...); a head's own fields live in ``head_options``
    variant: str = DFLASH1
    #: Every head: block input embeddings (raw target table rows) are multiplied by this
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0  #: unary logits = lm_head(h) * output_multiplier ...
    final_logit_softcapping: float | None = None  #: ... then c * tanh(logits / c); None = off
    #: the drafter drafts from the N most frequent target tokens of its training data
    #: (docs/draft_vocab.md; heads/draft_vocab.py): None = the target's whole vocabulary
    draft_vocab_size: int | None = None
    #: False (DFlash): slot 0 holds the anchor and predicts nothing, slot t >= 1 predicts the
    #: token at a + t (B-1 drafts). True (DSpark / speculators' ``sample_from_anchor``): slot k
    #: predicts the token at a + k + 1 (B drafts). :meth:`label_shift` is the one definition.
    sample_from_anchor: bool = False
    #: width of one target layer's features, T: fc is [H, len(target_layer_ids) * T]; None =
    #: hidden_size. A multi-stream target (``hc_mult`` = n) gives H (the streams' mean, what
    #: vLLM and SGLang feed) or n*H (flattened streams); vLLM reads the top-level key
    target_hidden_size: int | None = None
    #: The fields the head and the features declare (``fields`` of a model/heads.py Head:
    #: ``conv_kernel_size``, ``markov_rank``, ``attention_gate``, ...), read as attributes
    #: (``config.markov_rank``) and given as keywords like any other field.
    head_options: dict[str, Any] = field(default_factory=dict)
    _source: str = field(default="<DrafterConfig>", repr=False, compare=False)

    def __init__(self, **kwargs: Any) -> None:
        """Keyword fields; a head's or a feature's field goes to ``head_options``."""
        owners = heads.field_owners()
        options = dict(kwargs.pop("head_options", None) or {})
        options.update((key, kwargs.pop(key)) for key in [k for k in kwargs if k in owners])
        for f in dataclasses.fields(self):
            if f.name == "head_options":
                continue
            if f.name in kwargs:
                value = kwargs.pop(f.name)
            elif f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                raise TypeError(f"DrafterConfig needs the field '{f.name}'")
            object.__setattr__(self, f.name, value)
        if kwargs:
            raise TypeError(f"DrafterConfig got unknown fields {sorted(kwargs)}")
        object.__setattr__(self, "head_options", options)
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        """A head's or a feature's field (None where the config's head does not use it)."""
        options = self.__dict__.get("head_options")
        if options is not None and not name.startswith("__"):
            if name in options:
                return options[name]
            if name in heads.field_owners():
                return None
        raise AttributeError(f"DrafterConfig has no field '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in heads.field_owners():
            self.head_options[name] = value
        else:
            object.__setattr__(self, name, value)

    @property
    def head(self) -> heads.Head:
        """The head this config drafts with (model/heads.py)."""
        return heads.get(self.variant)

    @property
    def features(self) -> list[heads.Head]:
        """Every feature (model/heads.py): switched on or off by their own fields."""
        return heads.features()

    @property
    def parts(self) -> list[heads.Head]:
        """The head, then every feature: the order their hooks run in."""
        return [self.head, *self.features]

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        # Plain Python containers, whatever came in (e.g. OmegaConf ListConfig from Hydra).
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            self.is_causal = [bool(c) for c in self.is_causal]
        if self.rope_scaling is not None:  # nested mappings too (Hydra DictConfig)
            self.rope_scaling = {k: dict(v) if isinstance(v, Mapping) else v
                                 for k, v in dict(self.rope_scaling).items()}
        self._fill_head_defaults()
        self._validate()
        if self.draft_vocab_size == self.vocab_size:  # the whole vocabulary: nothing to map
            self.draft_vocab_size = None

    def _fail(self, key: str, value: Any, fix: str) -> None:
        raise ValueError(f"{self._source}: invalid {key}={value!r}: {fix}")

    def _validate(self) -> None:
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim",
                    "num_target_layers", "max_position_embeddings"):
            if int(getattr(self, key)) < 1:
                self._fail(key, getattr(self, key), "must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            self._fail("num_attention_heads", self.num_attention_heads,
                       f"must divide hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            self._fail("num_key_value_heads", self.num_key_value_heads,
                       f"must divide num_attention_heads={self.num_attention_heads} (GQA groups)")
        if self.block_size < 2:
            self._fail("block_size", self.block_size, "must be >= 2 (anchor + at least one MASK)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            self._fail("mask_token_id", self.mask_token_id,
                       f"must be in [0, vocab_size={self.vocab_size}); use the target's MASK id")
        ids = self.target_layer_ids
        if not ids:
            self._fail("target_layer_ids", ids,
                       "give at least one id, e.g. build_target_layer_ids(num_target_layers, 5)")
        bad = [i for i in ids if not 0 <= i < self.num_target_layers]
        if bad:
            self._fail("target_layer_ids", ids,
                       f"ids {bad} are outside [0, num_target_layers={self.num_target_layers}) "
                       "(z-lab convention: id i = output of decoder layer i)")
        if len(set(ids)) != len(ids):
            self._fail("target_layer_ids", ids, "ids must be distinct")
        width = self.target_hidden_size
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            self._fail("target_hidden_size", width,
                       "must be a positive integer: the width of one target layer's features "
                       "(null = hidden_size)")
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            self._fail("layer_types", self.layer_types,
                       f"needs one entry per draft layer (num_hidden_layers={n}), "
                       f"got {len(self.layer_types)}")
        unknown = [t for t in self.layer_types if t not in LAYER_TYPES]
        if unknown:
            self._fail("layer_types", self.layer_types,
                       f"entries {unknown} are not one of {list(LAYER_TYPES)}")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            self._fail("sliding_window", self.sliding_window,
                       "a sliding_attention layer needs sliding_window >= 1 (keys counting the "
                       "query itself); set it or make the layer full_attention")
        if isinstance(self.is_causal, list) and len(self.is_causal) != n:
            self._fail("is_causal", self.is_causal,
                       f"a per-layer list needs {n} entries; or give one bool for all layers")
        if not positive_number(self.rope_theta):
            self._fail("rope_theta", self.rope_theta, "must be a finite number > 0")
        # model/rope.py's rules; the normalized dict replaces the given one
        self.rope_scaling = normalize_scaling(
            self.rope_scaling, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, where=self._source)
        if not isinstance(self.sample_from_anchor, bool):
            self._fail("sample_from_anchor", self.sample_from_anchor, "must be true or false")
        n = self.draft_vocab_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)
                              or not 1 <= n <= self.vocab_size):
            self._fail("draft_vocab_size", n, f"must be an integer in [1, vocab_size="
                       f"{self.vocab_size}], or null for the target's whole vocabulary")
        for key in ("input_embedding_scale", "output_multiplier"):
            if not positive_number(getattr(self, key)):
                self._fail(key, getattr(self, key), "must be a finite number > 0 (1.0 = off)")
        cap = self.final_logit_softcapping
        if cap is not None and not positive_number(cap):
            self._fail("final_logit_softcapping", cap, "must be a finite number > 0, or null (off)")
        for part in self.parts:
            part.validate(self)

    def _fill_head_defaults(self) -> None:
        """Refuse an unknown head or another head's field; default the unset fields of the parts."""
        if self.variant not in heads.names():
            self._fail("variant", self.variant, f"must be one of {heads.names()}")
        mine = {key: part.fields[key] for part in self.parts for key in part.fields}
        for key, owner in heads.field_owners().items():
            if key in mine:
                if self.head_options.get(key) is None:
                    self.head_options[key] = mine[key]
            elif self.head_options.get(key) is not None:
                self._fail(key, self.head_options[key], f"is a {owner.title} field; set "
                           f"variant='{owner.name}' or remove it")
            else:
                self.head_options.pop(key, None)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (vLLM's ``int(head_size * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_features(self) -> int:
        """fc's input width F = len(target_layer_ids) * target_hidden_size."""
        return len(self.target_layer_ids) * self.target_hidden_size

    # ------------------------------------------------------------------ resolved layout
    @property
    def causal_flags(self) -> list[bool]:
        """One causality flag per layer, explicit value or the legacy rule."""
        if isinstance(self.is_causal, list):
            return list(self.is_causal)
        if isinstance(self.is_causal, bool):
            return [self.is_causal] * self.num_hidden_layers
        return [t == SLIDING for t in self.layer_types]

    def layer_specs(self) -> list[LayerSpec]:
        """The explicit (window or None, causal) of every layer: what every backend uses."""
        return [
            LayerSpec(self.sliding_window if t == SLIDING else None, c)
            for t, c in zip(self.layer_types, self.causal_flags, strict=True)
        ]

    @property
    def label_shift(self) -> int:
        """Slot k of the block anchored at a predicts the token at ``a + k + label_shift``:
        0 for DFlash (slot 0 is the anchor), 1 with :attr:`sample_from_anchor`."""
        return int(self.sample_from_anchor)

    @property
    def first_draft_slot(self) -> int:
        """The first slot that drafts a token: 1 for DFlash, 0 with :attr:`sample_from_anchor`."""
        return 1 - self.label_shift

    @property
    def num_draft_tokens(self) -> int:
        """Tokens one block drafts: B-1 for DFlash, B with :attr:`sample_from_anchor`."""
        return self.block_size - self.first_draft_slot

    @property
    def any_sliding(self) -> bool:
        return SLIDING in self.layer_types

    @property
    def uniform_causal(self) -> bool | None:
        """The shared causality flag when all layers agree, else None (mixed)."""
        flags = set(self.causal_flags)
        return flags.pop() if len(flags) == 1 else None

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> set[str]:
        """Every keyword the constructor takes: the dataclass fields and the heads' fields."""
        return ({f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
                - {"head_options"}) | set(heads.field_owners())

    @classmethod
    def create(cls, source: str = "<drafter config>", **kwargs: Any) -> DrafterConfig:
        """Strict constructor for our own configs (Hydra ``_target_``): unknown keys are errors;
        ``target_layer_ids`` may be an int n, meaning ``build_target_layer_ids(L, n)``."""
        known = cls.field_names()
        for key in kwargs:
            if key not in known:
                raise ValueError(
                    f"{source}: unknown drafter key '{key}'{_suggest(key, known)}; "
                    f"valid keys: {sorted(known)}"
                )
        no_default = dataclasses.MISSING
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is no_default and f.default_factory is no_default}
        missing = sorted(required - set(kwargs))
        if missing:
            raise ValueError(f"{source}: missing drafter keys {missing}; set them in the drafter "
                             "config (shape keys default to the target's)")
        if isinstance(kwargs.get("target_layer_ids"), int):
            kwargs["target_layer_ids"] = resolve_target_layer_ids(
                kwargs["target_layer_ids"], kwargs["num_target_layers"],
                f"{source} target_layer_ids")
        return cls(_source=source, **kwargs)

    # ------------------------------------------------------------------ serving config.json
    def to_dict(self) -> dict[str, Any]:
        """The serving config.json (dflash.md section 4) plus our training spec (serving_form)."""
        return serving_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "<config dict>") -> DrafterConfig:
        """Read OUR serving config.json dict (what :meth:`to_dict` writes), strictly: the layout
        from the recorded training spec (``dflash_lab_training_spec``) alone, an unknown key a
        ValueError naming it and its close matches, two ``block_size`` copies agreeing. No engine
        rule is emulated: a third-party config.json is ``dflash_lab.export.import_drafter``'s
        (docs/export.md, "Importing third-party directories")."""
        return parse_ours(cls, d, source=source)
