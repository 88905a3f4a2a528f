"""The Laguna DFlash format as each engine reads it (the facts: export/laguna.py's docstring).

A Laguna drafter directory (``architectures: ["DFlashLagunaForCausalLM"]`` or
``["LagunaForCausalLM"]``, which vLLM's ``EAGLEConfig`` prefixes to the former, ``model_type:
"laguna"``) is parsed by each engine's own ``LagunaConfig``, not by Qwen3Config: no
``use_sliding_window`` rewrite, ``layer_types`` all full when absent. The existing rule sets
(engines/vllm.py, engines/sglang.py) read the layer layout of an engine view built here:

- vLLM 0.32: causality as every DFlash drafter (``qwen3_dflash._dflash_layer_causal`` from the
  proposer: ``is_causal``, else ``dflash_config.causal``, else sliding -> causal); a sliding
  layer's window is ``config.sliding_window`` (``LagunaAttention``; ``swa_window_size`` is not
  read); mixed ``layer_types`` raise NotImplementedError (``_get_dflash_layer_types``).
- SGLang 0.5.23: ``srt/models/dflash.py`` ``_get_dflash_layer_attention_params`` on its
  ``srt/configs/laguna.py`` LagunaConfig, as for any DFlash drafter.

RoPE is not read through those rule sets (their Qwen3 reading refuses nested
``rope_parameters`` and ``partial_rotary_factor``): :func:`vllm_rope` and :func:`sglang_rope`
resolve each engine's RoPE of a uniform drafter, export/laguna.py compares them.

Tensors: the format fuses ``self_attn.qkv_proj`` ([q; k; v] rows), ours keeps q/k/v apart
(:func:`our_names`, :func:`laguna_names`); every other name is shared.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_lab.export.engines.common import FULL, SLIDING, is_format

ARCHITECTURE = "DFlashLagunaForCausalLM"
#: vLLM's EAGLEConfig rewrites the target-style name to ARCHITECTURE for a dflash draft
ARCHITECTURES = (ARCHITECTURE, "LagunaForCausalLM")
MODEL_TYPE = "laguna"
QKV, SPLIT = "self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj")

ENGINE_NOTES = {
    "vllm": "Laguna format read through vLLM 0.32's laguna_dflash.DFlashLagunaForCausalLM "
            "(transformers LagunaConfig; window = sliding_window; uniform layer_types only)",
    "sglang": "Laguna format read through SGLang 0.5.23's dflash.DFlashLagunaForCausalLM "
              "(srt/configs/laguna.py LagunaConfig)",
}


def is_laguna(config: dict[str, Any]) -> bool:
    """A Laguna DFlash drafter config.json (by ``model_type`` or ``architectures``)."""
    return is_format(config, MODEL_TYPE, ARCHITECTURES)


def layer_types(config: dict[str, Any]) -> list[str]:
    """Both engines' LagunaConfig: the file's list, else every layer full."""
    return list(config.get("layer_types") or [FULL] * int(config["num_hidden_layers"]))


def engine_view(config: dict[str, Any], engine: str) -> dict[str, Any]:
    """The config.json the Qwen3-style rule sets read the layout from, as ``engine``'s
    LagunaConfig holds it: the window kept (``use_sliding_window`` true: no Qwen3 rewrite),
    RoPE left out (read by :func:`vllm_rope` / :func:`sglang_rope`). vLLM: no
    ``swa_window_size`` (``LagunaAttention`` reads ``sliding_window`` only)."""
    view = {k: v for k, v in config.items()
            if k not in ("rope_parameters", "swa_rope_parameters", "partial_rotary_factor",
                         "rope_scaling", "rope_theta")}
    view.update(layer_types=layer_types(config), use_sliding_window=True,
                sliding_window=config.get("sliding_window", 512))
    if engine == "vllm":
        view["dflash_config"] = {k: v for k, v in (config.get("dflash_config") or {}).items()
                                 if k != "swa_window_size"}
    return view


def vllm_refusal(config: dict[str, Any]) -> str | None:
    """vLLM 0.32's load-time error for this config, None when it loads."""
    types = layer_types(config)
    if len(set(types)) > 1:
        return (f"raises NotImplementedError: Laguna DFlash drafter requires a uniform "
                f"layer_types (got {sorted(set(types))})")
    return None


def _nested(rope: dict[str, Any]) -> bool:
    return any(isinstance(v, dict) for v in rope.values())


def vllm_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict ``LagunaAttention`` passes to ``get_rope`` for a uniform drafter:
    nested ``rope_parameters[layer_type]`` (else ``["full_attention"]``), a sliding drafter's
    ``swa_rope_parameters`` first, the top-level ``partial_rotary_factor`` where the dict has
    none. transformers' LagunaConfig fills ``rope_parameters`` when absent (owners' default)."""
    kind = layer_types(config)[0]
    top = dict(config.get("rope_parameters") or OWNERS_ROPE)
    base = (top.get(kind) or top.get(FULL) or {}) if _nested(top) else top
    swa = config.get("swa_rope_parameters")
    rope = dict(swa if kind == SLIDING and swa is not None else base)
    if config.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return rope


def sglang_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE SGLang 0.5.23's DFlashAttention builds: its LagunaConfig's FULL-attention
    parameters for every layer (a nested dict's ``full_attention``, else the sliding one when no
    layer is full; a flat dict is not read: theta from ``rope_theta``, else 10000);
    ``swa_rope_parameters`` is never read."""
    rp = config.get("rope_parameters")
    rp = rp if isinstance(rp, dict) and _nested(rp) else {}
    no_full = FULL not in layer_types(config)
    full_rp = rp.get(FULL) or ((rp.get(SLIDING) or {}) if no_full else {})
    theta = full_rp.get("rope_theta", config.get("rope_theta") or 10000.0)
    partial = full_rp.get("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0)
    return {**full_rp, "rope_theta": theta, "partial_rotary_factor": partial}


#: transformers' (and SGLang's) LagunaConfig default rope_parameters
OWNERS_ROPE = {FULL: {"rope_type": "default", "rope_theta": 500000.0,
                      "partial_rotary_factor": 0.5},
               SLIDING: {"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 1.0}}


def _sizes(config: dict[str, Any]) -> tuple[int, int]:
    head_dim = int(config.get("head_dim") or 128)
    return int(config["num_attention_heads"]) * head_dim, \
        int(config["num_key_value_heads"]) * head_dim


def our_names(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Laguna tensors (or shapes) -> ours: every ``qkv_proj`` split into q/k/v rows."""
    q, kv = _sizes(config)
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if not name.endswith(QKV):
            out[name] = value
            continue
        prefix = name[: -len(QKV)] + "self_attn."
        if isinstance(value, torch.Tensor):
            parts = value.split([q, kv, kv], dim=0)
        else:  # a shape tuple (inspect)
            parts = [(n, *value[1:]) for n in (q, kv, kv)] if value[0] == q + 2 * kv else \
                [value] * 3
        out.update({f"{prefix}{p}.weight": t for p, t in zip(SPLIT, parts, strict=True)})
    return out


def laguna_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors -> the Laguna format's: q/k/v rows fused into ``qkv_proj`` (vLLM's
    ``DFlashLagunaModel.load_weights`` has no stacked-parameter mapping)."""
    out = {k: v for k, v in state.items()
           if not any(k.endswith(f"self_attn.{p}.weight") for p in SPLIT)}
    for name in state:
        if name.endswith("self_attn.q_proj.weight"):
            prefix = name[: -len("q_proj.weight")]
            out[prefix + "qkv_proj.weight"] = torch.cat(
                [state[f"{prefix}{p}.weight"] for p in SPLIT], dim=0)
    return out
