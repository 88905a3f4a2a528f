"""How vLLM 0.32 and SGLang 0.5.23 build a drafter's rotary from config.json (through
``Qwen3Config``), in model/rope.py's terms: a difference from the trained RoPE is a dropped
feature, its overrides build the engine's drafter for the self-check (docs/export.md, "How each
engine builds the rotary").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from dflash_lab.export.engines.common import EngineReading, hf_view
from dflash_lab.model.rope import describe, normalize_scaling, rope_tables, same_rope, yarn_mscale

HF_DEFAULT_THETA = 10000.0  #: transformers' RotaryEmbeddingConfigMixin.default_theta
QWEN3_DEFAULT_MAX_POSITIONS = 32768  #: Qwen3Config.max_position_embeddings
_ORIGINAL_TYPES = ("yarn", "llama3", "longrope")
#: transformers' validate_rope: required keys per type (KeyError at config load when missing)
_HF_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
                "yarn": ("factor", "original_max_position_embeddings"),
                "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
                           "high_freq_factor"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
#: types each engine builds but the drafter has no equivalent table for
_VLLM_OTHER = ("ntk", "longrope", "deepseek_yarn", "deepseek_llama_scaling", "proportional",
               "mllama4", "bailing_mrope", "openpangu")
_SGLANG_OTHER = ("longrope", "deepseek_yarn", "proportional")


@dataclass
class RopeReading:
    """What one engine's rotary is, in the drafter's vocabulary where it has one."""

    theta: float
    scaling: dict[str, Any] | None  #: None with ``other`` set: no drafter equivalent
    other: str | None = None  #: the engine class the drafter cannot express
    refusal: str | None = None  #: the engine's load-time error
    ignored: list[str] = field(default_factory=list)  #: keys the engine does not read

    def label(self) -> str:
        return self.other or describe(self.theta, self.scaling)


def hf_rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(Qwen3Config's ``rope_parameters``, nested?) for a raw config.json (module docstring)."""
    params = copy.deepcopy(config.get("rope_scaling") or config.get("rope_parameters") or {})
    theta = config.get("rope_theta", HF_DEFAULT_THETA)
    max_pos = config.get("max_position_embeddings", QWEN3_DEFAULT_MAX_POSITIONS)
    labels = hf_view(config).layer_types or []
    nested = [k for k in params if k in labels]
    for entry in ([params[k] for k in nested if params[k] is not None] if nested else [params]):
        entry.setdefault("rope_theta", theta)
        entry.setdefault("rope_type", entry.get("type", "default"))
        if entry["rope_type"] in _ORIGINAL_TYPES:
            entry.setdefault("original_max_position_embeddings", max_pos)
    return params, bool(nested)


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _dynamic_base(theta: float, factor: float, ratio: float, dim: int) -> float:
    """``theta * (factor * ratio - (factor - 1)) ** (d / (d - 2))``: the engines' fixed base."""
    return theta * ((factor * ratio) - (factor - 1)) ** (dim / (dim - 2))


def _engine_reading(config: dict[str, Any], cache: str
                    ) -> tuple[dict[str, Any], str, RopeReading | None]:
    """(rope parameters, rope_type, the reading when both engines read it alike) of a
    config.json: a per-layer-type dict is refused the way both engines fail on it (``cache``:
    how this engine's get_rope caches), default/linear/llama3 are read as transformers reads
    them; None leaves the engine-specific types to the caller."""
    p, nested = hf_rope_parameters(config)
    if nested:
        return p, "", RopeReading(0.0, None, refusal="raises TypeError (unhashable type: "
                                  f"'dict'): get_rope {cache} and a per-layer-type dict holds "
                                  "dicts")
    kind, theta = p["rope_type"], float(p["rope_theta"])
    if kind == "default":
        return p, kind, RopeReading(theta, None)
    if kind == "linear":
        return p, kind, RopeReading(theta, {"rope_type": "linear", "factor": p["factor"]})
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
        return p, kind, RopeReading(theta, {"rope_type": "llama3", **{k: p[k] for k in keys}})
    return p, kind, None


_YARN_RAMP = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")


def vllm_rope(config: dict[str, Any]) -> RopeReading:
    """vLLM 0.32's rotary for the drafter (module docstring)."""
    p, kind, early = _engine_reading(config, "caches on rope_parameters' items")
    if early is not None:
        return early
    theta = float(p["rope_theta"])
    if kind == "dynamic" and "alpha" not in p:
        max_pos = config.get("max_position_embeddings", QWEN3_DEFAULT_MAX_POSITIONS)
        ratio = max_pos / p.get("max_trained_positions", max_pos)
        return RopeReading(_dynamic_base(theta, p["factor"], ratio, _head_dim(config)), None)
    if kind == "yarn":
        keys = (*_YARN_RAMP, "mscale", "mscale_all_dim", "attention_factor")
        return RopeReading(theta, {"rope_type": "yarn", **{k: p[k] for k in keys if k in p}})
    return _other(kind, theta, _VLLM_OTHER)


def _other(kind: str, theta: float, built: tuple[str, ...]) -> RopeReading:
    """A type the drafter has no table for: the engine's class (``built``), else its refusal."""
    if kind == "dynamic" or kind in built:
        name = "DynamicNTKAlphaRotaryEmbedding" if kind == "dynamic" else f"{kind} RoPE"
        return RopeReading(theta, None, other=name)
    return RopeReading(theta, None, refusal=f"raises ValueError: Unknown RoPE scaling type {kind}")


def _sglang_yarn(p: dict[str, Any], theta: float) -> RopeReading:
    """``YaRNScalingRotaryEmbedding``: attention_factor not read; its scale is its own."""
    if float(p.get("extrapolation_factor", 1)) != 1.0:
        return RopeReading(theta, None, other="yarn with extrapolation_factor != 1")
    factor, mscale, all_dim = p["factor"], p.get("mscale"), p.get("mscale_all_dim")
    scale = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
                  if mscale is not None and all_dim is not None else yarn_mscale(factor))
    scale *= float(p.get("attn_factor", 1))
    ramp = {k: p[k] for k in _YARN_RAMP if k in p}
    ignored = ["attention_factor"] if "attention_factor" in p else []
    return RopeReading(theta, {"rope_type": "yarn", **ramp, "attention_factor": scale},
                       ignored=ignored)


def sglang_rope(config: dict[str, Any]) -> RopeReading:
    """SGLang 0.5.23's rotary for the drafter (module docstring)."""
    p, kind, early = _engine_reading(config, "keys its cache on rope_scaling's items")
    if early is not None:
        return early
    theta = float(p["rope_theta"])
    if kind == "dynamic" and "alpha" not in p:
        return RopeReading(_dynamic_base(theta, p["factor"], p["factor"], _head_dim(config)),
                           None)
    if kind == "yarn":
        return _sglang_yarn(p, theta)
    return _other(kind, theta, _SGLANG_OTHER)


def declared_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None] | str:
    """What the drafter computes from config.json (model/rope.py), or why it cannot."""
    p, nested = hf_rope_parameters(config)
    if nested:
        return "per-layer-type RoPE (the drafter has one RoPE)"
    p = dict(p)
    theta = float(p.pop("rope_theta"))
    p.pop("type", None)
    try:
        scaling = normalize_scaling(p, rope_theta=theta, where="config.json",
                                    max_position_embeddings=config.get(
                                        "max_position_embeddings", QWEN3_DEFAULT_MAX_POSITIONS))
    except ValueError as err:
        return str(err)
    return theta, scaling


def _missing_keys(config: dict[str, Any]) -> str | None:
    p, nested = hf_rope_parameters(config)
    for entry in ([v for v in p.values() if v] if nested else [p]):
        missing = [k for k in _HF_REQUIRED.get(entry["rope_type"], ()) if k not in entry]
        if missing:
            return (f"raises KeyError at config load (transformers' validate_rope): rope_type "
                    f"'{entry['rope_type']}' needs {missing}")
    return None


_FIXES = {
    "vllm": "export with --engine sglang, or retrain with a RoPE vLLM reads as trained",
    "sglang": "export with --engine vllm, or retrain with a RoPE SGLang reads as trained "
              "(yarn without attention_factor: SGLang then derives the same 0.1 ln(factor) + 1 "
              "as vLLM and transformers; plain RoPE for a dynamic target, which dflash-train "
              "gives it)",
}


def apply_rope(reading: EngineReading, config: dict[str, Any], engine: str) -> None:
    """Record the engine's RoPE on ``reading``: its label, a refusal, the keys it ignores (a note
    when harmless), a dropped feature + overrides when its table differs from the drafter's."""
    if refusal := _missing_keys(config):
        reading.refusal = refusal
        return
    rope = vllm_rope(config) if engine == "vllm" else sglang_rope(config)
    if rope.refusal:
        reading.refusal = rope.refusal
        return
    reading.rope = rope.label()
    declared = declared_rope(config)
    if isinstance(declared, str):  # the importer refuses it; nothing to compare with
        return
    theta, scaling = declared
    same = rope.other is None and _same(config, (theta, scaling), (rope.theta, rope.scaling))
    ignored = ", ".join(rope.ignored)
    if same:
        if ignored:
            reading.notes.append(f"RoPE: ignores {ignored} (its own value is the same here)")
        return
    why = f"it ignores {ignored}" if ignored else f"{engine} builds it this way"
    reading.dropped.append(f"the trained RoPE {describe(theta, scaling)} (runs {rope.label()}: "
                           f"{why}; every position is rotated differently); fix: "
                           f"{_FIXES[engine]}")
    if rope.other is None:
        reading.overrides.update(rope_theta=rope.theta, rope_scaling=rope.scaling)


def _same(config: dict[str, Any], a: tuple[float, dict | None],
          b: tuple[float, dict | None]) -> bool:
    dim = _head_dim(config)
    max_pos = config.get("max_position_embeddings", QWEN3_DEFAULT_MAX_POSITIONS)
    return same_rope(rope_tables(a[0], dim, a[1], max_pos), rope_tables(b[0], dim, b[1], max_pos))
