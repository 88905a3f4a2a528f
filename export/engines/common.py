"""What an engine rule set returns, and the config view every engine starts from:
:func:`hf_view`, a pure-Python copy of ``Qwen3Config``'s two rewrites (``sliding_window`` nulled
without ``use_sliding_window``; an absent ``layer_types`` invented from ``max_window_layers``)
(docs/export.md, "Engine rule table").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"

#: How an engine bounds the RIGHT side of a bidirectional sliding window inside the block.
SYMMETRIC = "symmetric"  #: (W-1, W-1): vLLM, and our training mask
LEFT_ONLY = "left-only"  #: (W-1, unbounded): SGLang's window_left (flashinfer)
#: every query sees the W keys ending at the block's last slot (SGLang's trtllm_mha)
END_ANCHORED = "block-end"

QWEN3_DEFAULT_SLIDING_WINDOW = 4096
QWEN3_DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True)
class Artifacts:
    """Optional features a serving directory ships besides the plain Qwen3 weights."""

    mask_embedding_file: bool = False  #: ``mask_embedding.pt`` present
    sink_weights: bool = False  #: ``layers.*.self_attn.attention_sink_bias`` tensors present
    #: DFlash 2 codebooks named ``candidate_selector.*_codebook.weight`` (z-lab save_pretrained)
    suffixed_codebooks: bool = False
    #: how mask_embedding.pt is stored (formats/base.py ``mask_file_form``); ours is "dict"
    mask_file_form: str = "dict"
    #: the target model's class (``architectures[0]`` of --target, or what the training
    #: checkpoint recorded); None = unknown. SGLang feeds Gemma 4 block inputs scaled.
    target_architecture: str | None = None


NO_ARTIFACTS = Artifacts()


@dataclass(frozen=True)
class LayerReading:
    """How one engine runs one draft layer."""

    window: int | None  #: W (keys counting the query itself), None = full attention
    causal: bool
    bidir_window: str = SYMMETRIC  #: meaning of a bidirectional window inside the block

    def label(self) -> str:
        kind = "causal" if self.causal else "bidir"
        if self.window is None:
            return f"full {kind}"
        extra = "" if self.causal or self.bidir_window == SYMMETRIC else f" {self.bidir_window}"
        return f"W={self.window} {kind}{extra}"


@dataclass
class EngineReading:
    """Result of one rule set on one config: per-layer readings, or why the engine refuses."""

    rule_set: str
    layers: list[LayerReading] | None  #: None when the engine refuses to load the drafter
    refusal: str | None = None  #: the engine's own load-time error, in words
    dropped: list[str] = field(default_factory=list)  #: features silently ignored
    notes: list[str] = field(default_factory=list)  #: how to serve it (not problems)
    #: drafter config fields the engine runs with another value than config.json declares
    #: (a dropped scale runs as "off"); the self-check builds the engine's drafter with them
    overrides: dict[str, Any] = field(default_factory=dict)
    #: the drafter's rotary as the engine builds it, in words (export/engines/rope.py)
    rope: str = ""
    #: the engine runs the shipped learned mask embedding / sink logits (vLLM always does)
    serves_learned_mask: bool = False
    serves_sinks: bool = False

    @property
    def loads(self) -> bool:
        return self.layers is not None


@dataclass(frozen=True)
class HFView:
    """The fields DFlash loaders read, after transformers' Qwen3Config rewrites."""

    num_layers: int
    layer_types: list[str]  #: never None: an absent key is invented as Qwen3Config does
    sliding_window: int | None
    is_causal: Any  #: top-level value, None when absent
    dflash: dict[str, Any]
    #: top-level ``draft_vocab_size`` when below ``vocab_size`` (a reduced draft vocabulary)
    draft_vocab_size: int | None = None


def hf_view(config: dict[str, Any]) -> HFView:
    """Apply Qwen3Config's rewrites (see module docstring) to a raw config.json dict."""
    num_layers = int(config["num_hidden_layers"])
    use_swa_top = bool(config.get("use_sliding_window", False))
    window = config.get("sliding_window", QWEN3_DEFAULT_SLIDING_WINDOW) if use_swa_top else None
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers", QWEN3_DEFAULT_MAX_WINDOW_LAYERS)
        layer_types = [SLIDING if window is not None and i >= first else FULL
                       for i in range(num_layers)]
    draft = config.get("draft_vocab_size")
    reduced = draft if draft is not None and draft != config.get("vocab_size") else None
    return HFView(num_layers, list(layer_types), window, config.get("is_causal"),
                  dict(config.get("dflash_config") or {}), reduced)


def architecture_of(target: dict[str, Any] | None,
                    identity: dict[str, Any] | None = None) -> str | None:
    """The target's class: ``architectures[0]`` of its config.json, else the ``architecture`` a
    training checkpoint recorded (``dflash_target``); None when neither is known."""
    archs = (target or {}).get("architectures") or []
    return archs[0] if archs else (identity or {}).get("architecture")


def same_attention(a: LayerReading, b: LayerReading, block_size: int) -> bool:
    """Whether two readings of a layer attend to exactly the same keys. Symmetric and left-only
    bidirectional windows agree only when W >= B (the own block is whole under both, and the
    context bound is query - W + 1); a block-end window (bound last slot - W + 1 for every
    query) agrees with neither unless B = 1."""
    if a.window != b.window or a.causal != b.causal:
        return False
    if a.window is None or a.causal or a.bidir_window == b.bidir_window:
        return True
    if END_ANCHORED in (a.bidir_window, b.bidir_window):
        return block_size == 1  # other queries lose context keys the symmetric window keeps
    return a.window >= block_size


def layouts_agree(a: list[LayerReading] | None, b: list[LayerReading] | None,
                  block_size: int) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(same_attention(x, y, block_size) for x, y in zip(a, b))
