"""The eval report: metrics from per-round acceptance lengths, and the files in the output dir.

Files: ``report.json`` (every field, see docs/eval.md), ``report.md`` (a readable summary) and PNG
plots ``acceptance_histogram.png`` and ``per_position_acceptance.png`` (matplotlib, Agg backend).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from dflash_lab.eval.loop import Generation

log = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
HISTOGRAM_PNG = "acceptance_histogram.png"
CURVE_PNG = "per_position_acceptance.png"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def per_position_acceptance(lengths: list[int], block_size: int) -> list[float | None]:
    """Fraction of rounds that accepted at least t drafts (length >= t + 1), t = 1..B-1."""
    if not lengths:
        return [None] * (block_size - 1)
    return [sum(n >= t + 1 for n in lengths) / len(lengths) for t in range(1, block_size)]


def histogram(lengths: list[int], block_size: int) -> list[int]:
    """Counts of acceptance length 1..B (index 0 = length 1)."""
    counts = [0] * block_size
    for n in lengths:
        counts[min(max(n, 1), block_size) - 1] += 1
    return counts


def acceptance_summary(per_prompt: list[list[int]], block_size: int) -> dict[str, Any]:
    """tau and per-position acceptance pooled over every round of every prompt."""
    pooled = [n for lengths in per_prompt for n in lengths]
    return {
        "tau_mean": _mean(pooled),
        "tau_per_prompt": [_mean(lengths) for lengths in per_prompt],
        "acceptance_lengths": per_prompt,
        "per_position_acceptance": per_position_acceptance(pooled, block_size),
        "acceptance_histogram": histogram(pooled, block_size),
        "num_rounds": len(pooled),
    }


def unary_summary(spec: list[Generation], block_size: int) -> dict[str, Any]:
    """DFlash 2 drafters: the unary argmax draft's acceptance in the same rounds as the selector
    path (``tau_mean``), for the side-by-side comparison; every value None at T > 0, where the
    loop does not measure it (``Generation.unary_acceptance_lengths`` is None)."""
    if any(g.acceptance_lengths and g.unary_acceptance_lengths is None for g in spec):
        return {"unary_tau_mean": None, "unary_tau_per_prompt": None,
                "unary_acceptance_lengths": None, "unary_per_position_acceptance": None}
    per_prompt = [g.unary_acceptance_lengths or [] for g in spec]
    summary = acceptance_summary(per_prompt, block_size)
    return {"unary_tau_mean": summary["tau_mean"],
            "unary_tau_per_prompt": summary["tau_per_prompt"],
            "unary_acceptance_lengths": per_prompt,
            "unary_per_position_acceptance": summary["per_position_acceptance"]}


def _rate(gens: list[Generation]) -> float | None:
    seconds = sum(g.seconds for g in gens)
    return sum(len(g.output_ids) for g in gens) / seconds if seconds > 0 else None


def generation_report(spec: list[Generation], baseline: list[Generation] | None,
                      prompt_ids: list[list[int]], block_size: int,
                      settings: dict[str, Any]) -> dict[str, Any]:
    """Every field of report.json for a generation run (greedy losslessness only at T = 0)."""
    rounds = sum(len(g.acceptance_lengths) for g in spec)
    tps, base_tps = _rate(spec), _rate(baseline) if baseline is not None else None
    greedy = settings.get("temperature", 0) == 0
    mismatched = ([i for i, (s, b) in enumerate(zip(spec, baseline))
                   if s.output_ids != b.output_ids] if baseline is not None else [])
    report: dict[str, Any] = {"mode": "generate"}
    report.update(acceptance_summary([g.acceptance_lengths for g in spec], block_size))
    if settings.get("variant") == "dflash2":
        report["selector_tau_mean"] = report["tau_mean"]
        report.update(unary_summary(spec, block_size))
    report.update({
        "lossless": (not mismatched) if (greedy and baseline is not None) else None,
        "mismatched_prompts": mismatched,
        "tokens_per_second": tps,
        "baseline_tokens_per_second": base_tps,
        "speedup": tps / base_tps if tps and base_tps else None,
        "draft_ms_per_round": 1e3 * sum(sum(g.draft_seconds) for g in spec) / max(rounds, 1),
        "verify_ms_per_round": 1e3 * sum(sum(g.verify_seconds) for g in spec) / max(rounds, 1),
        "num_prompts": len(spec),
        "num_output_tokens": sum(len(g.output_ids) for g in spec),
        "prompt_ids": prompt_ids,
        "outputs": [g.output_ids for g in spec],
        "baseline_outputs": [g.output_ids for g in baseline] if baseline is not None else None,
        "settings": settings,
    })
    return report


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(report: dict[str, Any]) -> str:
    """A short human-readable summary of ``report``."""
    s = report["settings"]
    lines = [f"# dflash-eval report ({report['mode']})", "",
             f"- target: `{s.get('target')}`", f"- drafter: `{s.get('drafter')}`",
             f"- data: `{s.get('data')}`", f"- block size: {s.get('block_size')}", ""]
    keys = ["tau_mean", "selector_tau_mean", "unary_tau_mean", "oracle_tau_mean", "recall_at_k",
            "num_rounds", "lossless", "tokens_per_second",
            "baseline_tokens_per_second", "speedup", "draft_ms_per_round", "verify_ms_per_round",
            "num_prompts", "num_output_tokens", "num_samples", "num_blocks"]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(report[k])} |" for k in keys if k in report]
    lines += ["", "Per-position acceptance (fraction of rounds accepting at least t drafts):", "",
              "| t | " + " | ".join(str(t) for t in range(1, s["block_size"])) + " |",
              "|---" * s["block_size"] + "|"]
    lines += [f"| {name} | " + " | ".join(_fmt(v, 2) for v in report[key]) + " |"
              for name, key in _curves(report)]
    lines += ["", "Settings:", "", "```json", json.dumps(s, indent=2, default=str), "```"]
    return "\n".join(lines) + "\n"


def _curves(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(row name, report key) of the per-position curves to print: DFlash 2 reports name the
    selector path and add the unary one beside it."""
    if report.get("unary_per_position_acceptance") is None:
        return [("acc", "per_position_acceptance")]
    return [("selector", "per_position_acceptance"), ("unary", "unary_per_position_acceptance")]


def write_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """The two PNG plots; returns their file names ([] when matplotlib is missing, logged)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG plots (pip install matplotlib)")
        return []
    b = report["settings"]["block_size"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(1, b + 1), report["acceptance_histogram"], color="tab:blue")
    ax.set(xlabel="acceptance length (tokens per round)", ylabel="rounds",
           title=f"tau = {_fmt(report['tau_mean'], 2)}", xticks=range(1, b + 1))
    fig.tight_layout()
    fig.savefig(out_dir / HISTOGRAM_PNG, dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    curve = [math.nan if v is None else v for v in report["per_position_acceptance"]]
    ax.plot(range(1, b), curve, marker="o")
    ax.set(xlabel="draft position t", ylabel="P(accept >= t drafts)", ylim=(0, 1.02),
           title="per-position acceptance", xticks=range(1, b))
    fig.tight_layout()
    fig.savefig(out_dir / CURVE_PNG, dpi=100)
    plt.close(fig)
    return [HISTOGRAM_PNG, CURVE_PNG]


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Write report.json, report.md and the plots into ``out_dir``; returns report.json's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, out_dir)
    (out_dir / REPORT_MD).write_text(markdown(report))
    path = out_dir / REPORT_JSON
    path.write_text(dumps(report))
    return path


def dumps(report: dict[str, Any]) -> str:
    """JSON with one top-level field per line (long id lists stay on their line)."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, default=str)}"
                      for k, v in report.items())
    return "{\n" + body + "\n}\n"
