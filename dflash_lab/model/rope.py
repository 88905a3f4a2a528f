"""RoPE: THE definition of the drafter's rotary embedding (types, parameters, tables): a drafter's
RoPE is ``rope_theta`` plus ``rope_scaling`` (None = plain RoPE), which :func:`normalize_scaling`
validates and :func:`rope_tables` turns into the inverse frequencies and cos/sin scale, per type
what vLLM 0.32 computes for that config.json, transformers 5 being the numerical reference;
``longrope``, nested per-layer-type and unread keys are refused (docs/export.md, "RoPE").
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

DEFAULT = "default"
#: rope_type -> (required keys, optional keys) besides ``rope_type``.
PARAMETERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    DEFAULT: ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
}
ROPE_TYPES = tuple(PARAMETERS)
#: Types we know and refuse, with why.
REFUSED_TYPES = {
    "longrope": "engines build a position-dependent table (vLLM 0.32 switches short_factor -> "
                "long_factor at original_max_position_embeddings within a request, transformers "
                "switches every position once the sequence is longer), so no one table of ours "
                "equals what they run",
}
#: Types whose ``original_max_position_embeddings`` transformers' Qwen3Config fills in from
#: ``max_position_embeddings`` when absent (standardize_rope_params); we write it explicitly.
NEEDS_ORIGINAL = ("yarn", "llama3")
_FIX = ("use one of " + ", ".join(ROPE_TYPES) + " (docs/export.md, RoPE), or null for plain RoPE")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """``rope_type`` (or the legacy ``type``) of a scaling dict; ``default`` for None."""
    if not scaling:
        return DEFAULT
    return str(scaling.get("rope_type", scaling.get("type", DEFAULT)))


def is_nested(scaling: dict[str, Any]) -> bool:
    """Per-layer-type parameters: ``{"full_attention": {...}, "sliding_attention": {...}}``."""
    return bool(scaling) and all(isinstance(v, dict) for v in scaling.values())


def positive_number(value: Any) -> bool:
    """A finite int or float > 0 (not a bool)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def _check_values(kind: str, out: dict[str, Any], fail) -> None:
    for key in ("factor", "attention_factor", "low_freq_factor", "high_freq_factor",
                "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if key in out and out[key] is not None and not positive_number(out[key]):
            fail(f"{key}={out[key]!r} must be a finite number > 0")
    original = out.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int)
                                 or original < 1):
        fail(f"original_max_position_embeddings={original!r} must be a positive integer")
    if "truncate" in out and not isinstance(out["truncate"], bool):
        fail(f"truncate={out['truncate']!r} must be true or false")
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        fail("llama3 needs high_freq_factor > low_freq_factor (transformers divides by "
             "their difference)")


def normalize_scaling(scaling: dict[str, Any] | None, *, rope_theta: float,
                      max_position_embeddings: int, where: str) -> dict[str, Any] | None:
    """The drafter's ``rope_scaling`` in one spelling, or ValueError naming the value and fix
    (``where``: the config's source). None and ``{"rope_type": "default"}`` give None (plain).
    Else: ``rope_type`` (legacy ``type`` accepted), exactly the keys the type reads, explicit
    ``original_max_position_embeddings`` for yarn / llama3 (default: max_position_embeddings,
    as transformers), ``rope_theta`` only if equal to rope_theta."""
    if scaling is None:
        return None
    scaling = dict(scaling)

    def fail(why: str) -> None:
        raise ValueError(f"{where}: invalid rope_scaling={scaling!r}: {why}")

    if is_nested(scaling):
        fail(f"per-layer-type RoPE ({sorted(scaling)}) cannot be served: vLLM 0.32 and SGLang "
             "0.5.23 both raise TypeError building the drafter (their get_rope caches hash the "
             "nested dicts); give the drafter one RoPE (the target's full_attention entry is "
             "what dflash-train takes)")
    legacy = scaling.pop("type", None)
    kind = scaling.pop("rope_type", legacy)
    if legacy is not None and kind != legacy:
        fail(f"rope_type={kind!r} and type={legacy!r} disagree; keep rope_type")
    kind = DEFAULT if kind is None else kind
    if kind in REFUSED_TYPES:
        fail(f"rope_type '{kind}' is not supported: {REFUSED_TYPES[kind]}; {_FIX}")
    if kind not in PARAMETERS:
        fail(f"rope_type '{kind}' is not supported; {_FIX}")
    theta = scaling.pop("rope_theta", rope_theta)
    if float(theta) != float(rope_theta):
        fail(f"its rope_theta={theta} disagrees with rope_theta={rope_theta}; keep one")
    if kind == DEFAULT and not scaling:
        return None
    required, optional = PARAMETERS[kind]
    if kind in NEEDS_ORIGINAL:
        scaling.setdefault("original_max_position_embeddings", int(max_position_embeddings))
    unknown = sorted(set(scaling) - set(required) - set(optional))
    if unknown:
        fail(f"keys {unknown} are not read for rope_type '{kind}' (it reads "
             f"{list(required + optional)}); the drafter would not compute what they say: "
             "remove them")
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        fail(f"rope_type '{kind}' needs {missing}")
    _check_values(kind, scaling, fail)
    return {"rope_type": kind, **{k: scaling[k] for k in required + optional if k in scaling}}


# ---------------------------------------------------------------------------- tables
def _default_inv_freq(theta: float, dim: int) -> Tensor:
    """[dim/2] fp32, the op order of transformers' ``compute_default_rope_parameters``."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    return _default_inv_freq(theta, dim) / p["factor"], 1.0


def _dynamic(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    """vLLM's fixed base with M_trained = M (= transformers' table up to M): plain RoPE."""
    factor = p["factor"]
    base = theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(p: dict[str, Any]) -> float:
    """The cos/sin scale transformers and vLLM 0.32 give a yarn config."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(p["factor"], mscale) / yarn_mscale(p["factor"], mscale_all_dim))
    return yarn_mscale(p["factor"])


def _yarn_correction_range(p: dict[str, Any], dim: int, theta: float) -> tuple[float, float]:
    """The dims between the beta_fast and beta_slow rotation counts at the original length."""
    def dim_of(rotations: float) -> float:
        original = p["original_max_position_embeddings"]
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(p.get("beta_fast") or 32), dim_of(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    """transformers' ``_compute_yarn_parameters`` (same ops, same order)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (p["factor"] * pos_freqs)
    low, high = _yarn_correction_range(p, dim, theta)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 = extrapolate (high-frequency dims keep their frequency)
    return interpolation * (1 - keep) + extrapolation * keep, yarn_attention_factor(p)


def _llama3(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    """transformers' ``_compute_llama3_parameters`` (same ops, same order)."""
    inv_freq = _default_inv_freq(theta, dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled), 1.0


_TABLES = {"linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3}


def rope_tables(rope_theta: float, head_dim: int, scaling: dict[str, Any] | None,
                max_position_embeddings: int) -> tuple[Tensor, float]:
    """(inv_freq [head_dim / 2] fp32, cos/sin scale) of a normalized ``scaling``."""
    kind = rope_type_of(scaling)
    if kind == DEFAULT:
        return _default_inv_freq(rope_theta, head_dim), 1.0
    return _TABLES[kind](float(rope_theta), head_dim, scaling, int(max_position_embeddings))


def same_rope(a: tuple[Tensor, float], b: tuple[Tensor, float], rtol: float = 1e-6) -> bool:
    """Two (inv_freq, scale) tables give the same rotary (up to fp32 re-association)."""
    return (a[0].shape == b[0].shape and bool(torch.allclose(a[0], b[0], rtol=rtol, atol=0.0))
            and math.isclose(a[1], b[1], rel_tol=rtol))


def describe(rope_theta: float, scaling: dict[str, Any] | None) -> str:
    """One line: ``yarn(factor=4.0, original_max_position_embeddings=2048), theta 10000``."""
    kind = rope_type_of(scaling)
    params = ", ".join(f"{k}={v}" for k, v in (scaling or {}).items() if k != "rope_type")
    return f"{kind}" + (f"({params})" if params else "") + f", theta {rope_theta:g}"
