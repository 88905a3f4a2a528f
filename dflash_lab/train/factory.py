"""Build a drafter for a LOADED target: shape, RoPE and MASK id come from the target itself.

It lives in train/ so that model/ imports only torch.

This is the Hydra ``_target_`` of the ``drafter`` config group (instantiated as a partial and
called with ``target=``). Any DrafterConfig field may be given; fields left out (or null) that
the target defines (hidden size, vocab, heads, head_dim, intermediate size, norm eps, RoPE, max
positions) are copied from the target's (text) config, because the drafter shares the target's
embedding and LM head and z-lab drafters mirror the target's layer shape. The target may come
from a local directory, a hub id in the HF cache, a GGUF file or a head-only load: all of them
give a transformers config and a tokenizer, and nothing here reads files by path.
"""

from __future__ import annotations

import logging
from typing import Any

from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.target.loader import text_config
from dflash_lab.target.mask_token import resolve_mask_token_id

log = logging.getLogger(__name__)

#: DrafterConfig field <- target (text) config attribute.
_FROM_TARGET = {
    "hidden_size": "hidden_size", "vocab_size": "vocab_size",
    "num_target_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads", "head_dim": "head_dim",
    "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
}


def target_rope(config) -> dict[str, Any]:
    """RoPE fields for the drafter from a target config: ``{"rope_theta": ...}`` (and a linear
    ``rope_scaling``), or {} when the target declares none.

    transformers >= 5 keeps RoPE in ``rope_parameters``: flat (``{"rope_type", "rope_theta"}``)
    or, for targets with per-layer-type RoPE (Gemma 3: 1e4 on sliding, 1e6 on full layers),
    nested by layer type. The drafter has one RoPE for all its layers (it attends over the
    whole context), so a nested config gives the ``full_attention`` entry. Scaling types other
    than linear (llama3, yarn) describe the target's long-context extension; the drafter then
    uses plain RoPE at the same theta (logged), which is what the engines build from our export.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if params and "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        chosen = "full_attention" if "full_attention" in params else sorted(params)[0]
        log.info("target RoPE is per layer type %s; the drafter uses the %s entry %s",
                 sorted(params), chosen, params[chosen])
        params = params[chosen]
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        return {}
    out: dict[str, Any] = {"rope_theta": float(theta)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(params["factor"])}
    elif rope_type != "default":
        log.info("target RoPE type %r is not applied to the drafter: it uses plain RoPE with "
                 "theta %s", rope_type, theta)
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


def drafter_config_for_target(target, **fields: Any) -> DrafterConfig:
    """DrafterConfig with unset shape fields copied from a loaded target.

    ``target``: a :class:`~dflash_lab.target.loader.Target` (anything with ``model.config``,
    ``tokenizer`` and ``name_or_path``). ``mask_token_id`` null = the tokenizer's mask token;
    an explicit one is checked against the tokenizer (:func:`resolve_mask_token_id`).
    """
    fields = {k: v for k, v in fields.items() if v is not None}
    for key, value in target_shape(target.model.config).items():
        fields.setdefault(key, value)
    fields["mask_token_id"] = resolve_mask_token_id(
        target.tokenizer, fields.get("mask_token_id"), vocab_size=int(fields["vocab_size"]),
        where=str(target.name_or_path))
    return DrafterConfig.create(source=f"drafter config for target {target.name_or_path}",
                                **fields)


def build_drafter(target, backend: str = "auto", init_from: str | None = None,
                  verify_checksums: bool = True, **fields: Any) -> DFlashDrafter:
    """A freshly initialised drafter for a loaded target (Hydra entry of conf/drafter/*.yaml),
    or, with ``init_from``, one holding a trained drafter's weights (train/warm_start.py;
    ``verify_checksums``: an export's SHA256SUMS is checked first)."""
    if init_from is not None:
        from dflash_lab.train.warm_start import warm_started_drafter

        return warm_started_drafter(target, str(init_from), backend, fields,
                                    bool(verify_checksums))
    config = drafter_config_for_target(target, **fields)
    log.info("drafter layers: %s", config.layer_specs())
    return DFlashDrafter(config, backend=backend)
