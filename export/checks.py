"""Whether an export is safe: what each engine will run against what was trained. A finding is
a refusal (the export stops, unless ``--allow_lossy`` and it is lossy) or a warning (in
EXPORT_REPORT.md and on stderr), naming the layer, rule set, what the engine would do, the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_lab.export.engines import RULE_SETS, EngineReading, LayerReading, RuleSet
from dflash_lab.export.engines.common import END_ANCHORED, SYMMETRIC, same_attention
from dflash_lab.model.config import DrafterConfig, LayerSpec

REFUSE = "refuse"
WARN = "warn"


@dataclass
class Finding:
    """One problem found by the checks."""

    severity: str  #: REFUSE or WARN
    message: str
    rule_set: str | None = None
    layer: int | None = None
    lossy: bool = True  #: --allow_lossy may downgrade a lossy refusal to a warning


def spec_label(spec: LayerSpec) -> str:
    return LayerReading(spec.window, spec.causal).label()  # trained: symmetric windows


def layer_matches(spec: LayerSpec, reading: LayerReading, block_size: int) -> bool:
    """True when the engine's attention for this layer equals the trained one (a symmetric
    in-block window for bidirectional sliding layers; a left-only window agrees only when W >= B,
    the whole block then visible either way)."""
    return same_attention(LayerReading(spec.window, spec.causal, SYMMETRIC), reading, block_size)


def _advice(spec: LayerSpec, reading: LayerReading, block_size: int) -> str:
    same_kind = spec.window == reading.window and spec.causal == reading.causal
    if spec.window is not None and same_kind and reading.bidir_window == END_ANCHORED:
        return ("serve SGLang with --speculative-draft-attention-backend fa3, fa4, triton or "
                "flashinfer and export with --sglang_attention_backend set to it, or make the "
                "sliding layers causal, or export with --engine vllm")
    if spec.window is not None and same_kind:
        return (f"train with sliding_window >= block_size ({block_size}) or make the sliding "
                "layers causal, or serve SGLang with --speculative-draft-attention-backend fa3, "
                "fa4 or triton (symmetric window) and export with --sglang_attention_backend set "
                "to it, or export with --engine vllm (symmetric window, as trained)")
    if spec.window != reading.window:
        return ("check layer_types / sliding_window / dflash_config.swa_window_size in "
                "config.json; re-export with this tool so all three are written")
    return ("declare causality explicitly (top-level is_causal and dflash_config.causal, which "
            "this exporter writes for uniform layouts), or retrain with a layout the engine can "
            "express: uniform causality, or sliding causal + full bidirectional")


def mismatches(specs: list[LayerSpec], reading: EngineReading, block_size: int,
               severity: str) -> list[Finding]:
    """One finding per layer the rule set would run differently from its trained spec."""
    if reading.layers is None:
        return []
    if len(reading.layers) != len(specs):
        return [Finding(severity, f"{reading.rule_set} builds {len(reading.layers)} layers, "
                        f"the drafter has {len(specs)}", reading.rule_set)]
    out = []
    for i, (spec, got) in enumerate(zip(specs, reading.layers, strict=True)):
        if not layer_matches(spec, got, block_size):
            out.append(Finding(
                severity,
                f"layer {i}: {reading.rule_set} would run it as '{got.label()}' but it was "
                f"trained as '{spec_label(spec)}'; fix: {_advice(spec, got, block_size)}",
                reading.rule_set, i))
    return out


def _dropped_findings(reading: EngineReading, severity: str) -> list[Finding]:
    """Items that name their own fix keep it; the mask/sink items get the generic one."""
    generic = ("; fix: export with --engine vllm, or retrain without learned_mask_embedding / "
               "attention_sink_bias")
    return [Finding(severity, f"{reading.rule_set} silently drops {item}"
                    + ("" if "; fix:" in item else generic), reading.rule_set)
            for item in reading.dropped]


def check_layout(config: DrafterConfig) -> list[Finding]:
    """Mixed causality: only 'sliding causal + full bidirectional' is expressible (by defaults)."""
    if config.uniform_causal is not None:
        return []
    specs = config.layer_specs()
    if all(s.causal == (s.window is not None) for s in specs):
        return [Finding(WARN, "mixed causality (sliding causal + full bidirectional) cannot be "
                        "declared with one is_causal flag; it relies on engine defaults and "
                        "needs vLLM's V2 runner (VLLM_USE_V2_MODEL_RUNNER=1) and SGLang >= "
                        "#34524; older SGLang (#34262..#34524) runs the sliding layers "
                        "bidirectionally")]
    layout = ", ".join(f"{i}:{spec_label(s)}" for i, s in enumerate(specs))
    return [Finding(REFUSE, f"mixed causality pattern [{layout}] cannot be declared to any engine "
                    "(one is_causal flag per drafter; defaults give sliding->causal, "
                    "full->bidirectional); fix: retrain with uniform causality or with exactly "
                    "'sliding causal + full bidirectional'")]


def check_engine(config: DrafterConfig, readings: dict[str, EngineReading], engine: str,
                 table: tuple[RuleSet, ...] = RULE_SETS) -> list[Finding]:
    """Refuse on any current-version mismatch or dropped feature; warn for the others
    (``table``: the rule sets with their ``current`` flags, e.g. from ``select_sglang``)."""
    specs, block = config.layer_specs(), config.block_size
    rule_sets = [r for r in table if r.engine == engine and r.name in readings]
    current = [readings[r.name] for r in rule_sets if r.current]
    if current and not any(r.loads for r in current):
        why = "; ".join(f"{r.rule_set} {r.refusal}" for r in current)
        return [Finding(REFUSE, f"no current {engine} version loads this drafter: {why}", engine)]
    out: list[Finding] = []
    for rule_set in rule_sets:
        reading = readings[rule_set.name]
        severity = REFUSE if rule_set.current else WARN
        if not reading.loads:
            out.append(Finding(WARN, f"{reading.rule_set} refuses to load it: {reading.refusal}",
                               reading.rule_set))
            continue
        found = mismatches(specs, reading, block, severity) + _dropped_findings(reading, severity)
        if not rule_set.current:
            for f in found:
                f.message += f" ({rule_set.why_not_current})"
        out += found
    return out


def _target_text_config(target: dict[str, Any]) -> dict[str, Any]:
    """Multimodal targets (gemma-4, Qwen3.5) keep the decoder shape under text_config."""
    return target.get("text_config") or target


def target_vocab_size(target: dict[str, Any] | None) -> int | None:
    """The target's vocabulary size from its config.json dict (None when unknown)."""
    if target is None:
        return None
    vocab = _target_text_config(target).get("vocab_size", target.get("vocab_size"))
    return None if vocab is None else int(vocab)


def check_target(config: DrafterConfig, target: dict[str, Any] | None,
                 source: str = "target config") -> list[Finding]:
    """Hidden size, vocab size and target layer ids must fit the target (not lossy-allowable)."""
    if target is None:
        return [Finding(WARN, "no --target given: hidden_size, vocab_size and target_layer_ids "
                        "were not checked against the target model", lossy=False)]
    text = _target_text_config(target)
    out = []
    for key in ("hidden_size", "vocab_size"):
        want = text.get(key, target.get(key))
        if want is not None and int(want) != getattr(config, key):
            full = (" (DFlash 2 needs the FULL target vocabulary: the selector's codebooks are "
                    "[vocab, rank] and both engines take candidates from the target's whole LM "
                    "head; no reduced draft vocabulary)"
                    if key == "vocab_size" and config.selector_rank is not None else "")
            out.append(Finding(REFUSE, f"drafter {key}={getattr(config, key)} but {source} has "
                               f"{key}={want}: the drafter shares the target's embedding and LM "
                               "head; retrain for this target" + full, lossy=False))
    out += _check_width(config, text, source)
    layers = text.get("num_hidden_layers")
    if layers is not None and max(config.target_layer_ids) >= int(layers):
        out.append(Finding(REFUSE, f"target_layer_ids {config.target_layer_ids} reach past the "
                           f"{layers} layers of {source}; retrain for this target", lossy=False))
    return out


def _check_width(config: DrafterConfig, text: dict[str, Any], source: str) -> list[Finding]:
    """target_hidden_size must be a width the target gives per layer: H, or for a multi-stream
    target (hc_mult / hc_count = n streams) n*H (targets/features.py)."""
    hidden = text.get("hidden_size")
    if hidden is None or int(hidden) != config.hidden_size:  # refused above already
        return []
    streams = int(text.get("hc_mult") or text.get("hc_count") or 1)
    widths = {int(hidden), streams * int(hidden)}
    if config.target_hidden_size in widths:
        return []
    return [Finding(REFUSE, f"drafter target_hidden_size={config.target_hidden_size} but "
                    f"{source} gives features {sorted(widths)} wide per layer ({streams} "
                    "stream(s)); retrain for this target", lossy=False)]


def apply_allow_lossy(findings: list[Finding], allow_lossy: bool) -> list[Finding]:
    """Downgrade lossy refusals to loud warnings when the user accepted the loss."""
    if not allow_lossy:
        return findings
    for f in findings:
        if f.severity == REFUSE and f.lossy:
            f.severity = WARN
            f.message = "ALLOWED LOSSY (--allow_lossy): " + f.message
    return findings


def refusals(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == REFUSE]
