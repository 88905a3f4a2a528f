"""Human-readable tables: EXPORT_REPORT.md and the ``--inspect`` printout share them."""

from __future__ import annotations

from dflash_lab.attention.mask import LayerSpec
from export.checks import REFUSE, Finding, layer_matches, spec_label
from export.engines import EngineReading


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
        for name in names:
            row.append(_cell(readings[name], i, specs[i] if specs else None, block_size))
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


def findings_section(findings: list[Finding]) -> list[str]:
    if not findings:
        return ["- none"]
    return [f"- {'REFUSED' if f.severity == REFUSE else 'WARNING'}: {f.message}"
            for f in findings]


def export_report(*, header: dict[str, str], specs: list[LayerSpec],
                  readings: dict[str, EngineReading], block_size: int,
                  findings: list[Finding], self_check: list[str], files: list[str]) -> str:
    """The EXPORT_REPORT.md text."""
    lines = ["# DFlash drafter export report", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "## Per-layer attention: trained vs each engine rule set", "",
              "`W=n` sliding window of n keys (counting the query), `full` no window; "
              "`bidir` bidirectional inside the block; `left-only` = SGLang's window_left "
              "(no right bound); `**! ...**` = differs from training.", ""]
    lines += layer_table(specs, readings, block_size)
    lines += ["", "## Engine refusals and silently dropped features", ""]
    lines += engine_notes(readings)
    lines += ["", "## Findings", ""] + findings_section(findings)
    lines += ["", "## Self-check (reload as an engine would, compare draft logits)", ""]
    lines += self_check or ["- skipped"]
    lines += ["", "## Files", ""] + [f"- {f}" for f in files]
    return "\n".join(lines) + "\n"
