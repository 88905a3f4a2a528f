"""SGLang's DFlash rules, emulated as pure functions of a config.json dict.

Sources: ``python/sglang/srt/models/dflash.py`` (``_get_dflash_layer_attention_params``,
``_get_dflash_attention_type``) and ``python/sglang/srt/speculative/dflash_utils.py``
(``get_dflash_layer_types``, ``get_dflash_attention_sliding_window_size``), sgl-project/sglang.

- after PR #34524: layer_types absent -> every layer full and bidirectional. Otherwise a full layer
  is bidirectional and a sliding layer causal, unless top-level ``is_causal`` is declared, which
  then sets every layer. The window is the top-level ``sliding_window`` (``window_left = W - 1``,
  no right bound for bidirectional layers).
- between PR #34262 and #34524: as above, but an undeclared ``is_causal`` made EVERY layer
  bidirectional (the gemma-4-31B-it-DFlash regression, accept length 5.62 -> 5.27).
- before PR #34262: ``is_causal`` not read; full -> bidirectional, sliding -> causal.

SGLang reads neither ``dflash_config.causal`` nor ``use_swa`` / ``swa_window_size`` (the latter
only for the Nemotron 3.5 layout), never opens ``mask_embedding.pt``, and skips weights it has no
parameter for, which includes ``attention_sink_bias`` outside the Nemotron 3.5 layout.
DFlash 2 (served since PR #35371, in 0.5.23) and the three scales: :mod:`export.engines.variant`.
"""

from __future__ import annotations

from typing import Any

from export.engines.common import (
    FULL,
    LEFT_ONLY,
    NO_ARTIFACTS,
    SLIDING,
    Artifacts,
    EngineReading,
    HFView,
    LayerReading,
    hf_view,
)
from export.engines.variant import sglang_variant


def _dropped(view: HFView, artifacts: Artifacts) -> list[str]:
    dropped = []
    if artifacts.mask_embedding_file:
        dropped.append("mask_embedding.pt (learned mask embedding; SGLang uses "
                       "embed_tokens[mask_token_id])")
    if artifacts.sink_weights or view.dflash.get("attention_sink_bias"):
        dropped.append("attention_sink_bias (per-head sink logits; weights skipped on load)")
    if view.dflash.get("use_swa"):
        dropped.append("dflash_config.use_swa (not read: only layer_types decides sliding)")
    return dropped


def _causal(view: HFView, layer_type: str, era: str) -> bool:
    """Causality of one layer in each SGLang era."""
    if era != "before-34262" and view.is_causal is not None:
        return bool(view.is_causal)
    if era == "between":
        return False
    return layer_type == SLIDING


def read(config: dict[str, Any], artifacts: Artifacts, *, rule_set: str,
         era: str) -> EngineReading:
    """Per-layer (window, causal) as SGLang builds its RadixAttention layers, or its refusal."""
    view = hf_view(config)
    reading = EngineReading(rule_set, None, dropped=_dropped(view, artifacts))
    sglang_variant(config, artifacts, reading, current=era == "after-34524")
    if reading.refusal:
        return reading
    if view.layer_types is None:
        reading.layers = [LayerReading(None, False, LEFT_ONLY)] * view.num_layers
        return reading
    if len(view.layer_types) < view.num_layers:
        reading.refusal = "raises ValueError: layer_types needs one entry per draft layer"
        return reading
    layers = []
    for i, layer_type in enumerate(view.layer_types[: view.num_layers]):
        if layer_type not in (FULL, SLIDING):
            reading.refusal = f"raises ValueError: unsupported layer_types[{i}]={layer_type!r}"
            return reading
        window = view.sliding_window if layer_type == SLIDING else None
        if layer_type == SLIDING and window is None:
            reading.refusal = ("raises ValueError: sliding_attention layers require a top-level "
                               "sliding_window (with use_sliding_window: true)")
            return reading
        layers.append(LayerReading(window, _causal(view, layer_type, era), LEFT_ONLY))
    reading.layers = layers
    return reading


def read_after_34524(config: dict[str, Any], artifacts: Artifacts = NO_ARTIFACTS) -> EngineReading:
    """SGLang after PR #34524 (explicit is_causal wins, else sliding causal / full bidir)."""
    return read(config, artifacts, rule_set="sglang>=#34524", era="after-34524")


def read_between(config: dict[str, Any], artifacts: Artifacts = NO_ARTIFACTS) -> EngineReading:
    """SGLang between PR #34262 and #34524 (undeclared is_causal -> all bidirectional)."""
    return read(config, artifacts, rule_set="sglang#34262..#34524", era="between")


def read_before_34262(config: dict[str, Any], artifacts: Artifacts = NO_ARTIFACTS) -> EngineReading:
    """SGLang before PR #34262 (is_causal ignored; sliding causal / full bidir)."""
    return read(config, artifacts, rule_set="sglang<#34262", era="before-34262")
