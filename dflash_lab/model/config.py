"""DrafterConfig: THE definition of a DFlash drafter.

Everything else (drafter, attention backends, exporter, eval) reads the per-layer attention layout
from :meth:`DrafterConfig.layer_specs`, never from the raw ``layer_types`` / ``is_causal`` fields.

The serving ``config.json`` format (dflash.md section 4) is produced by :meth:`to_dict` and read by
:meth:`from_dict`. Target layer ids use the z-lab convention: id ``i`` is the OUTPUT of decoder
layer ``i``, i.e. HF ``output_hidden_states[i + 1]`` (vLLM's aux-layer ids are ``i + 1``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_lab.attention.mask import LayerSpec

log = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
SUPPORTED_ROPE_TYPES = ("default", "linear")

#: Key under which our exporter records the exact per-layer spec the drafter was trained with,
#: so ``dflash-export --inspect`` can compare it with what each engine will do.
TRAINING_SPEC_KEY = "dflash_lab_training_spec"

#: Standard Hugging Face bookkeeping keys: accepted and ignored when reading a config.json.
HF_BOOKKEEPING_KEYS = frozenset(
    {
        "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
        "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
        "output_attentions", "output_hidden_states", "return_dict", "attention_dropout",
        "tie_word_embeddings", "architectures", "model_type", "hidden_act", "max_window_layers",
        "use_sliding_window", "quantization_config", "layer_idx", "name_or_path",
    }
)


def build_target_layer_ids(num_target_layers: int, num_draft_inputs: int) -> list[int]:
    """Evenly spread target layer ids (z-lab convention) from layer 1 to layer L-3.

    ``round(1 + i * (L - 4) / (n - 1))`` for i in 0..n-1, and ``[L // 2]`` for n == 1.
    Qwen3-8B (L=36, n=5) gives [1, 9, 17, 25, 33].
    """
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
    # Round half up (not Python's banker's rounding) to match the reference rule.
    step = span / (num_draft_inputs - 1)
    return [math.floor(1 + i * step + 0.5) for i in range(num_draft_inputs)]


def _suggest(key: str, known: set[str] | frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape and attention layout of a DFlash drafter (Qwen3-style decoder layers).

    Shapes follow HF Qwen3 names. ``hidden_size`` must equal the target's hidden size because the
    drafter shares the target's embedding and LM head.
    """

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
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    #: one of "full_attention" / "sliding_attention" per layer; None = all full
    layer_types: list[str] | None = None
    sliding_window: int | None = None  #: W for sliding layers (counts the query itself)
    #: True/False for every layer, or one bool per layer; None = legacy rule
    #: (sliding -> causal, full -> bidirectional)
    is_causal: bool | list[bool] | None = None
    learned_mask_embedding: bool = False  #: one trainable H-vector used in every MASK slot
    attention_sink_bias: bool = False  #: one learnable sink logit per head and layer
    _source: str = field(default="<DrafterConfig>", repr=False, compare=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        # Plain Python containers, whatever came in (e.g. OmegaConf ListConfig from Hydra).
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            self.is_causal = [bool(c) for c in self.is_causal]
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
        self._validate()

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
        self._validate_target_layers()
        self._validate_layers()
        self._validate_rope()

    def _validate_target_layers(self) -> None:
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

    def _validate_layers(self) -> None:
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

    def _validate_rope(self) -> None:
        if self.rope_scaling is None:
            return
        rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            self._fail("rope_scaling", self.rope_scaling,
                       f"rope_type '{rope_type}' is not supported; use one of "
                       f"{list(SUPPORTED_ROPE_TYPES)} or null")
        if rope_type == "linear" and float(self.rope_scaling.get("factor", 0)) <= 0:
            self._fail("rope_scaling", self.rope_scaling, "linear scaling needs factor > 0")

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
        return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}

    @classmethod
    def create(cls, source: str = "<drafter config>", **kwargs: Any) -> DrafterConfig:
        """Strict constructor for our own configs (Hydra ``_target_``): unknown keys are errors.

        ``target_layer_ids`` may be an int n, meaning ``build_target_layer_ids(L, n)``.
        """
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
        ids = kwargs.get("target_layer_ids")
        if isinstance(ids, int):
            kwargs["target_layer_ids"] = build_target_layer_ids(kwargs["num_target_layers"], ids)
        return cls(_source=source, **kwargs)

    # ------------------------------------------------------------------ serving config.json
    def to_dict(self) -> dict[str, Any]:
        """The serving config.json (dflash.md section 4), plus our exact training spec."""
        uniform = self.uniform_causal
        dflash: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "attention_sink_bias": self.attention_sink_bias,
        }
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.any_sliding,
            "sliding_window": self.sliding_window if self.any_sliding else None,
            "max_window_layers": self.num_hidden_layers,
        }
        if self.any_sliding:
            dflash["swa_window_size"] = self.sliding_window
        if uniform is not None:
            out["is_causal"] = uniform
            dflash["causal"] = uniform
        out["dflash_config"] = dflash
        out[TRAINING_SPEC_KEY] = {
            "format_version": 1,
            "layer_specs": [{"window": s.window, "causal": s.causal} for s in self.layer_specs()],
            "is_causal": self.is_causal,
            "learned_mask_embedding": self.learned_mask_embedding,
        }
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, strict: bool = False,
                  source: str = "<config dict>") -> DrafterConfig:
        """Read a serving config.json dict (ours or a third-party z-lab one).

        HF bookkeeping keys are ignored. Unknown keys raise in ``strict`` mode (our own files)
        and are logged as warnings otherwise. Causality precedence: our recorded training spec,
        top-level ``is_causal``, ``dflash_config.causal``, else the legacy per-layer rule.
        Layers that only ``dflash_config.use_swa`` makes sliding stay bidirectional (vLLM rule).
        """
        return _parse_serving_dict(cls, d, strict=strict, source=source)

    @classmethod
    def from_json(cls, path: str | Path, *, strict: bool = False) -> DrafterConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err}); re-export the drafter") from err
        return cls.from_dict(data, strict=strict, source=str(path))

    def save_json(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)


_SHAPE_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
    "max_position_embeddings", "attention_bias", "num_target_layers", "block_size",
)
_TOP_KEYS = frozenset(_SHAPE_KEYS) | {
    "layer_types", "sliding_window", "is_causal", "dflash_config", TRAINING_SPEC_KEY,
}
_DFLASH_KEYS = frozenset(
    {"mask_token_id", "target_layer_ids", "block_size", "causal", "swa_window_size", "use_swa",
     "attention_sink_bias", "learned_mask_embedding"}
)


def _report_unknown(keys: set[str], known: frozenset[str], where: str, strict: bool,
                    source: str) -> None:
    for key in sorted(keys - known):
        msg = f"{source}: unknown key '{where}{key}'{_suggest(key, known)}"
        if strict:
            raise ValueError(msg + "; remove it or fix its spelling")
        log.warning("%s (ignored)", msg)


def _parse_serving_dict(cls: type[DrafterConfig], d: dict[str, Any], *, strict: bool,
                        source: str) -> DrafterConfig:
    _report_unknown(set(d), _TOP_KEYS | HF_BOOKKEEPING_KEYS, "", strict, source)
    dfc = dict(d.get("dflash_config") or {})
    _report_unknown(set(dfc), _DFLASH_KEYS, "dflash_config.", strict, source)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size") if k not in d]
    if "mask_token_id" not in dfc:
        missing.append("dflash_config.mask_token_id")
    if missing:
        raise ValueError(f"{source}: missing required keys {missing}; is this a DFlash drafter?")
    kwargs: dict[str, Any] = {k: d[k] for k in _SHAPE_KEYS if d.get(k) is not None}
    kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
    kwargs["mask_token_id"] = dfc["mask_token_id"]
    if "block_size" in dfc:
        kwargs["block_size"] = dfc["block_size"]
    n_layers = int(d["num_hidden_layers"])
    ids = dfc.get("target_layer_ids")
    if "num_target_layers" not in kwargs:
        if ids is None:
            raise ValueError(f"{source}: needs num_target_layers or dflash_config.target_layer_ids")
        kwargs["num_target_layers"] = max(ids) + 1
        log.warning("%s: num_target_layers missing; assuming %d (max target id + 1)",
                    source, kwargs["num_target_layers"])
    kwargs["target_layer_ids"] = ids if ids is not None else build_target_layer_ids(
        kwargs["num_target_layers"], n_layers)
    kwargs["sliding_window"] = dfc.get("swa_window_size") or d.get("sliding_window")
    layer_types = d.get("layer_types")
    if layer_types is None or SLIDING not in layer_types:
        if dfc.get("use_swa"):
            # vLLM: use_swa makes every layer slide, and those layers stay bidirectional.
            kwargs["layer_types"] = [SLIDING] * n_layers
            kwargs["is_causal"] = False
        else:
            kwargs["layer_types"] = layer_types
    else:
        kwargs["layer_types"] = layer_types
    spec = d.get(TRAINING_SPEC_KEY)
    if spec is not None:
        kwargs["is_causal"] = spec.get("is_causal")
        kwargs["learned_mask_embedding"] = bool(spec.get("learned_mask_embedding", False))
    elif d.get("is_causal") is not None:
        kwargs["is_causal"] = bool(d["is_causal"])
    elif dfc.get("causal") is not None:
        kwargs["is_causal"] = bool(dfc["causal"])
    kwargs["attention_sink_bias"] = bool(dfc.get("attention_sink_bias", False))
    if "learned_mask_embedding" in dfc:
        kwargs["learned_mask_embedding"] = bool(dfc["learned_mask_embedding"])
    return cls(_source=source, **kwargs)
