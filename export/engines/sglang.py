"""SGLang's DFlash rules by release (:class:`Release`) and, for a bidirectional sliding layer's
window, by draft attention backend (:data:`BACKENDS`): every rule set names the release and files
it was read from (docs/export.md, "Engine rule table", "SGLang by release"). DFlash 2 and the
scales: :mod:`dflash_lab.export.engines.variant`; RoPE: :mod:`dflash_lab.export.engines.rope`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dflash_lab.export.engines.common import (
    END_ANCHORED,
    FULL,
    LEFT_ONLY,
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
from dflash_lab.export.engines.streams import sglang_width
from dflash_lab.export.engines.variant import declared_scales, drop_scale, sglang_variant


@dataclass(frozen=True)
class Release:
    """What one SGLang release does with the parts of a DFlash export that changed over time."""

    name: str  #: the ``--sglang_version`` value
    source: str  #: where the rules were read
    causal_era: str  #: "after-34524" | "between" | "before-34262"
    # what came with 0.5.23 (the older releases have none of it)
    plain_sinks: bool = False  #: ``dflash_config.attention_sink_bias`` served for plain DFlash
    merges_mask: bool = False  #: ``mask_embedding.pt`` merged into the target's embedding table
    dflash2: bool = False  #: ``DFlash2DraftModel`` exists


RELEASES: dict[str, Release] = {r.name: r for r in (
    Release("0.5.23", "sglang==0.5.23 (PyPI wheel): srt/models/dflash.py, "
            "srt/speculative/dflash_utils.py, srt/speculative/dflash_worker_v2.py, "
            "srt/layers/attention/{flashattention,flashinfer,triton,trtllm_mha}_backend.py",
            "after-34524", plain_sinks=True, merges_mask=True, dflash2=True),
    Release("#34524", "sgl-project/sglang main after PR #34524, before 0.5.23, as this project "
            "read it then: no plain-DFlash sinks, no mask merge, no DFlash 2", "after-34524"),
    Release("#34262..#34524", "sgl-project/sglang PR #34262 (regression fixed by #34524)",
            "between"),
    Release("<#34262", "sgl-project/sglang models/dflash.py before #34262 (no is_causal)",
            "before-34262"),
)}
DEFAULT_RELEASE = "0.5.23"

#: How each DFlash draft backend of 0.5.23 bounds a bidirectional sliding layer (window_left
#: W-1), and the files read (docs/export.md, "SGLang by release").
BACKENDS: dict[str, str] = {"fa3": SYMMETRIC, "fa4": SYMMETRIC, "triton": SYMMETRIC,
                            "flashinfer": LEFT_ONLY, "trtllm_mha": END_ANCHORED}
#: backends grouped into one rule set each (same reading)
BACKEND_GROUPS: dict[str, tuple[str, ...]] = {
    "fa3/fa4/triton": ("fa3", "fa4", "triton"), "flashinfer": ("flashinfer",),
    "trtllm_mha": ("trtllm_mha",)}

#: Gemma targets (SGLang EntryClass names): the scaled embedding module, or no DFlash hook at all
GEMMA_SCALED = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
GEMMA_NO_HOOK = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                 "Gemma3ForConditionalGeneration", "Gemma3nForCausalLM",
                 "Gemma3nForConditionalGeneration")


def _dropped(view: HFView, artifacts: Artifacts, release: Release) -> list[str]:
    dropped = []
    if artifacts.mask_embedding_file and not release.merges_mask:
        dropped.append("mask_embedding.pt (learned mask embedding; SGLang uses "
                       "embed_tokens[mask_token_id])")
    sinks = artifacts.sink_weights or view.dflash.get("attention_sink_bias")
    if sinks and not (release.plain_sinks and view.dflash.get("attention_sink_bias") is True):
        dropped.append("attention_sink_bias (per-head sink logits; weights skipped on load"
                       + ("" if not release.plain_sinks else
                          " unless dflash_config.attention_sink_bias is true") + ")")
    if view.dflash.get("use_swa"):
        dropped.append("dflash_config.use_swa (not read: only layer_types decides sliding)")
    if view.draft_vocab_size is not None:
        dropped.append(f"draft_vocab_size={view.draft_vocab_size} with its lm_head and d2t "
                       "(SGLang drafts every DFlash drafter through the target's lm_head over "
                       "the whole vocabulary, speculative/dflash_worker_v2.py "
                       "_DflashDraftSampler: tokens the drafter was never trained over would be "
                       "drafted); fix: export with --engine vllm, or train with "
                       "drafter.draft_vocab_size=null for SGLang")
    return dropped


def _causal(view: HFView, layer_type: str, era: str) -> bool:
    """Causality of one layer in each SGLang era."""
    if era != "before-34262" and view.is_causal is not None:
        return bool(view.is_causal)
    if era == "between":
        return False
    return layer_type == SLIDING


def _uses_trtllm(view: HFView) -> bool:
    """``_resolve_dflash_draft_attention_backend`` keeps trtllm_mha only for these drafters."""
    all_sliding = len(view.layer_types) == view.num_layers and set(view.layer_types) == {SLIDING}
    return all_sliding or view.is_causal is True


def _layers(view: HFView, release: Release, bidir: str,
            reading: EngineReading) -> list[LayerReading] | None:
    if len(view.layer_types) < view.num_layers:
        reading.refusal = "raises ValueError: layer_types needs one entry per draft layer"
        return None
    layers = []
    for i, layer_type in enumerate(view.layer_types[: view.num_layers]):
        if layer_type not in (FULL, SLIDING):
            reading.refusal = f"raises ValueError: unsupported layer_types[{i}]={layer_type!r}"
            return None
        window = view.sliding_window if layer_type == SLIDING else None
        if layer_type == SLIDING and window is None:
            reading.refusal = ("raises ValueError: sliding_attention layers require a top-level "
                               "sliding_window (with use_sliding_window: true)")
            return None
        layers.append(LayerReading(window, _causal(view, layer_type, release.causal_era), bidir))
    return layers


#: what ``_maybe_merge_trained_mask_embedding`` (dflash_worker_v2.py) does with each file form
_MASK_FORM_REFUSAL = {
    "tensor": "raises at start-up: mask_embedding.pt is a bare tensor and the merge reads "
              "saved['embedding'] and saved['mask_token_id']; re-export with this tool",
    "no_token_id": "raises KeyError at start-up: mask_embedding.pt has no 'mask_token_id'; "
                   "re-export with this tool",
    "per_position": "raises NotImplementedError at start-up: per-position mask embeddings "
                    "(per_position=True) are not supported",
}


def _sinks_refusal(view: HFView, release: Release, backend: str | None) -> str | None:
    value = view.dflash.get("attention_sink_bias", False)
    if release.plain_sinks and not isinstance(value, bool):
        return ("raises ValueError: dflash_config.attention_sink_bias must be a bool "
                f"(got {value!r})")
    if release.plain_sinks and value is True and backend == "flashinfer":
        return ("raises TypeError at the first draft forward: FlashInferAttnBackend."
                "forward_extend() takes no 'sinks'; serve with "
                "--speculative-draft-attention-backend fa3, fa4 or triton")
    return None


def _embedding_scale(config: dict[str, Any], artifacts: Artifacts,
                     reading: EngineReading) -> None:
    """What the block inputs are multiplied by on SGLang, against the trained scale."""
    arch = artifacts.target_architecture
    trained = declared_scales(config).get("input_embedding_scale", 1.0)
    if arch in GEMMA_NO_HOOK:
        reading.refusal = (f"raises ValueError at start-up: the target class {arch} implements "
                           "no set_dflash_layers_to_capture (SGLang serves DFlash for Gemma 4 "
                           "only among the Gemma families)")
    elif arch in GEMMA_SCALED:
        fed = math.sqrt(int(config["hidden_size"]))
        if not math.isclose(trained, fed, rel_tol=1e-3):
            reading.dropped.append(
                f"the trained block-input scale input_embedding_scale={trained} (the target's "
                f"embedding module, {arch}.get_input_embeddings(), multiplies every block "
                f"input, the merged mask row included, by sqrt(hidden_size)={fed:.4f} instead: "
                f"every draft differs); fix: export with --engine vllm, or retrain with "
                f"drafter.input_embedding_scale={fed:.6g} for SGLang")
            reading.overrides["input_embedding_scale"] = fed
    elif trained != 1.0:
        drop_scale(reading, "input_embedding_scale",
                   "SGLang never reads it, block inputs come from the target's embedding module")


def read(config: dict[str, Any], artifacts: Artifacts = NO_ARTIFACTS, *, rule_set: str,
         release: str, backend: str | None = None) -> EngineReading:
    """Per-layer (window, causal) as one SGLang release (and draft backend) builds its
    RadixAttention layers, what it drops, or its refusal. ``backend`` None = not read."""
    rel, view = RELEASES[release], hf_view(config)
    reading = EngineReading(rule_set, None, dropped=_dropped(view, artifacts, rel))
    reading.serves_learned_mask = artifacts.mask_embedding_file and rel.merges_mask
    reading.serves_sinks = rel.plain_sinks and view.dflash.get("attention_sink_bias") is True
    if backend == "trtllm_mha" and not _uses_trtllm(view):
        reading.notes.append("SGLang replaces trtllm_mha by flashinfer (fa4 on SM100) for "
                             "this layout: read as flashinfer")
        backend = "flashinfer"
    sglang_variant(config, artifacts, reading, current=rel.dflash2)
    sglang_width(config, reading)
    if not reading.refusal:
        _embedding_scale(config, artifacts, reading)
    if not reading.refusal:
        apply_rope(reading, config, "sglang")
    if reading.serves_learned_mask:
        reading.refusal = reading.refusal or _MASK_FORM_REFUSAL.get(artifacts.mask_file_form)
    reading.refusal = reading.refusal or _sinks_refusal(view, rel, backend)
    if reading.refusal:
        return reading
    bidir = BACKENDS[backend] if backend is not None else LEFT_ONLY  # backends not read
    reading.layers = _layers(view, rel, bidir, reading)
    return reading


def rule_set_name(release: str, backend_group: str | None = None) -> str:
    """``sglang==0.5.23`` (fa3/fa4/triton), ``sglang==0.5.23+flashinfer``, ``sglang#34524`` ..."""
    base = f"sglang=={release}" if release[0].isdigit() else f"sglang{release}"
    return base if backend_group in (None, "fa3/fa4/triton") else f"{base}+{backend_group}"
