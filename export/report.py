"""Human-readable tables: EXPORT_REPORT.md and the ``--inspect`` printout share them."""

from __future__ import annotations

from dflash_lab.attention.mask import LayerSpec
from dflash_lab.export import formats
from dflash_lab.export.checks import REFUSE, Finding, layer_matches, spec_label
from dflash_lab.export.engines import EngineReading
from dflash_lab.model.config import SCALE_DEFAULTS, DrafterConfig
from dflash_lab.model.rope import describe


def layer_table(specs: list[LayerSpec] | None, readings: dict[str, EngineReading],
                block_size: int) -> list[str]:
    """Markdown table: one row per layer, one column per rule set ('!' marks a mismatch)."""
    names = list(readings)
    head = ["layer"] + (["trained"] if specs is not None else []) + names
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    num = len(specs) if specs is not None else max(
        (len(r.layers) for r in readings.values() if r.layers), default=0)
    for i in range(num):
        row = [str(i)] + ([spec_label(specs[i])] if specs is not None else [])
        row += [_cell(readings[name], i, specs[i] if specs else None, block_size) for name in names]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _cell(reading: EngineReading, i: int, spec: LayerSpec | None, block_size: int) -> str:
    if reading.layers is None:
        return "refuses to load"
    got = reading.layers[i]
    if spec is not None and not layer_matches(spec, got, block_size):
        return f"**! {got.label()}**"
    return got.label()


def engine_notes(readings: dict[str, EngineReading]) -> list[str]:
    """Refusals and silently dropped features, one bullet each."""
    lines = []
    for name, reading in readings.items():
        if reading.refusal:
            lines.append(f"- {name}: {reading.refusal}")
        lines += [f"- {name}: silently drops {item}" for item in reading.dropped]
    return lines or ["- none"]


def drafter_lines(config: DrafterConfig) -> list[str]:
    """The variant, its DFlash 2 modules, Laguna features and the scales, one bullet each."""
    lines = formats.get(formats.OURS).writer_for(config).drafter_lines(config)
    lines.append(f"- fc reads {len(config.target_layer_ids)} target layers x "
                 f"{config.target_hidden_size} = {config.num_features}"
                 + (" (target_hidden_size: a multi-stream target's flattened streams)"
                    if config.target_hidden_size != config.hidden_size else ""))
    lines += formats.features_lines(config)  # drafter=laguna / a Laguna import
    if config.sample_from_anchor:
        lines.append(f"- sample_from_anchor: true (slot k predicts the token at anchor + k + 1: "
                     f"{config.num_draft_tokens} drafts per block)")
    scales = {k: getattr(config, k) for k, off in SCALE_DEFAULTS.items()
              if getattr(config, k) != off}
    return lines + ["- scales: " + (", ".join(f"{k}={v}" for k, v in scales.items())
                                    if scales else "all off"),
                    f"- RoPE: {describe(config.rope_theta, config.rope_scaling)} (max positions "
                    f"{config.max_position_embeddings})"]


def as_trained_lines(specs: list[LayerSpec], readings: dict[str, EngineReading],
                     block_size: int) -> list[str]:
    """Per rule set: does it run this drafter exactly as ``specs`` say, and if not, why."""
    lines = []
    for name, reading in readings.items():
        if reading.refusal:
            why = f"refuses to load: {reading.refusal}"
        elif reading.dropped:
            why = "drops " + "; drops ".join(d.split("; fix:")[0] for d in reading.dropped)
        else:
            bad = [i for i, (s, got) in enumerate(zip(specs, reading.layers, strict=False))
                   if not layer_matches(s, got, block_size)]
            why = f"runs layers {bad} differently" if bad else ""
        lines.append(f"- {name}: " + (f"NO, {why}" if why else "yes"))
        lines += [f"  - RoPE: {reading.rope}"] if reading.rope else []
        lines += [f"  - {note}" for note in reading.notes]
    return lines


def export_report(*, header: dict[str, str], config: DrafterConfig,
                  readings: dict[str, EngineReading], findings: list[Finding],
                  self_check: list[str], files: list[str]) -> str:
    """The EXPORT_REPORT.md text."""
    specs, block_size = config.layer_specs(), config.block_size
    lines = ["# DFlash drafter export report", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "## Drafter", ""] + drafter_lines(config)
    lines += ["", "## Runs the drafter as trained? (every rule set)", ""]
    lines += as_trained_lines(specs, readings, block_size)
    lines += ["", "## Per-layer attention: trained vs each engine rule set", "",
              "`W=n` sliding window of n keys (counting the query), `full` no window; "
              "`bidir` bidirectional inside the block; `left-only` = SGLang's window_left "
              "(no right bound); `**! ...**` = differs from training.", ""]
    lines += layer_table(specs, readings, block_size)
    lines += ["", "## Engine refusals and silently dropped features", ""]
    lines += engine_notes(readings)
    lines += ["", "## Findings", ""] + ([
        f"- {'REFUSED' if f.severity == REFUSE else 'WARNING'}: {f.message}" for f in findings]
        or ["- none"])
    lines += ["", "## Self-check (reload as an engine would, compare draft logits)", ""]
    lines += self_check or ["- skipped"]
    lines += ["", "## Files", ""] + [f"- {f}" for f in files]
    return "\n".join(lines) + "\n"
