"""What a drafter copies from a target's (text) config: layer shape and RoPE, as DrafterConfig
fields (train/factory.py fills unset fields; train/warm_start.py checks a drafter against them)."""

from __future__ import annotations

import logging
from typing import Any

from dflash_lab.model.rope import PARAMETERS, REFUSED_TYPES, is_nested
from dflash_lab.targets.target import text_config

log = logging.getLogger(__name__)

#: DrafterConfig field <- target (text) config attribute.
_FROM_TARGET = {
    "hidden_size": "hidden_size", "vocab_size": "vocab_size",
    "num_target_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads", "head_dim": "head_dim",
    "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
}


def _flat_rope_parameters(config) -> dict[str, Any]:
    """The target's RoPE as one flat dict (``rope_type``, ``rope_theta``, scaling keys): from
    transformers 5's ``rope_parameters`` (a per-layer-type nested one gives ``full_attention``) or
    4.x's ``rope_theta`` + ``rope_scaling`` (docs/targets.md, as :func:`target_rope`)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", None))
    if is_nested(params):
        # DeepSeek-V4 names its attention RoPE "main" (its "compress" one rotates the
        # compressed KV branches)
        chosen = next((k for k in ("full_attention", "main") if k in params), sorted(params)[0])
        log.info("target RoPE is per layer type %s; the drafter uses the %s entry %s",
                 sorted(params), chosen, params[chosen])
        params = params[chosen]
    params = dict(params)
    if "original_max_position_embeddings" not in params and getattr(
            config, "original_max_position_embeddings", None):  # Phi-3 keeps it at the top
        params["original_max_position_embeddings"] = config.original_max_position_embeddings
    return params


def target_rope(config) -> dict[str, Any]:
    """RoPE fields for the drafter from a target config: ``{"rope_theta": ...}`` plus a scaled
    target's ``rope_scaling`` as engines apply it; {} without RoPE (per type: docs/targets.md)."""
    params = _flat_rope_parameters(config)
    theta = params.pop("rope_theta", None)
    if theta is None:
        return {}
    out: dict[str, Any] = {"rope_theta": float(theta)}
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type in ("default", "dynamic"):
        if rope_type == "dynamic":
            log.info("target RoPE is dynamic NTK %s: the drafter uses plain RoPE at theta %s, "
                     "what vLLM precomputes for it (and transformers up to "
                     "max_position_embeddings)", params, theta)
        return out
    if rope_type not in PARAMETERS:
        log.warning("target RoPE type %r is not implemented for the drafter (%s): it uses plain "
                    "RoPE with theta %s", rope_type,
                    REFUSED_TYPES.get(rope_type, "no engine rule read for it"), theta)
        return out
    required, optional = PARAMETERS[rope_type]
    kept = {k: params[k] for k in required + optional if params.get(k) is not None}
    if dropped := sorted(set(params) - set(kept)):
        log.info("target RoPE %s: the drafter does not read %s (it rotates the whole head "
                 "over 1-D positions)", rope_type, dropped)
    out["rope_scaling"] = {"rope_type": rope_type, **kept}
    return out


def _global_value(cfg, name: str) -> Any:
    """``cfg.name``, or its global value where transformers refuses it because some layers
    override it (Gemma-4: the full-attention layers' ``head_dim`` is ``global_head_dim``; the
    drafter takes the global one, that of the sliding majority)."""
    try:
        return getattr(cfg, name, None)
    except Exception as err:  # transformers' AmbiguousGlobalPerLayerAttributeError
        if "per-layer" not in str(err):
            raise
        value = cfg.to_dict().get(name)
        log.info("target %s differs per layer; the drafter uses its global value %s", name, value)
        return value


def target_shape(config) -> dict[str, Any]:
    """DrafterConfig shape fields read from a target config (text config of multimodal ones)."""
    cfg = text_config(config)
    shape = {ours: value for ours, theirs in _FROM_TARGET.items()
             if (value := _global_value(cfg, theirs)) is not None}
    if "head_dim" not in shape and {"hidden_size", "num_attention_heads"} <= shape.keys():
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    return {**shape, **target_rope(cfg)}
