"""The eval report: metrics from per-round acceptance lengths (per response:
:mod:`dflash_lab.eval.records`) and the files in the output dir: ``report.json`` (every field,
docs/eval.md), ``report.md`` (per-dataset tables with both taus, TTFT, TPOT and the decode
speedup, text histograms, the command) and the PNG plots (:func:`write_plots`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflash_lab.eval.loop import Generation
from dflash_lab.eval.records import (
    CONTEXT_BUCKETS,
    ResponseRecord,
    histogram,
    mean_of,
    per_dataset,
    per_position_acceptance,
    record_from_generation,
    summarize,
    tau_by_context,
)
from dflash_lab.model import heads
from dflash_lab.paths import atomic_write_text

log = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
HISTOGRAM_PNG = "acceptance_histogram.png"
CURVE_PNG = "per_position_acceptance.png"


def acceptance_summary(per_prompt: list[list[int]], block_size: int) -> dict[str, Any]:
    """tau and per-position acceptance pooled over every round of every prompt."""
    pooled = [n for lengths in per_prompt for n in lengths]
    return {
        "tau_mean": mean_of(pooled),
        "tau_per_prompt": [mean_of(lengths) for lengths in per_prompt],
        "acceptance_lengths": per_prompt,
        "per_position_acceptance": per_position_acceptance(pooled, block_size),
        "acceptance_histogram": histogram(pooled, block_size),
        "num_rounds": len(pooled),
    }


def _own_walk(settings: dict[str, Any]) -> bool:
    """Whether the report's head has a walk whose tau replaces the unary one (DFlash 2's)."""
    try:
        return heads.get(settings.get("variant")).walk_metrics() is not None
    except KeyError:  # a report of a head this process does not know
        return False


def unary_summary(spec: list[Generation], block_size: int) -> dict[str, Any]:
    """DFlash 2 drafters: the unary argmax draft's acceptance in the same rounds as the selector
    path (``tau_mean``), for the side-by-side comparison; every value None at T > 0, where the
    loop does not measure it (``Generation.unary_acceptance_lengths`` is None)."""
    keys = ("tau_mean", "tau_per_prompt", "acceptance_lengths", "per_position_acceptance")
    if any(g.acceptance_lengths and g.unary_acceptance_lengths is None for g in spec):
        return {f"unary_{k}": None for k in keys}
    summary = acceptance_summary([g.unary_acceptance_lengths or [] for g in spec], block_size)
    return {f"unary_{k}": summary[k] for k in keys}


def _rate(gens: list[Generation]) -> float | None:
    seconds = sum(g.seconds for g in gens)
    return sum(len(g.output_ids) for g in gens) / seconds if seconds > 0 else None


def records_report(records: list[ResponseRecord], block_size: int,
                   buckets: list[int] | None = None) -> dict[str, Any]:
    """The fields every backend fills from its response records: both taus, TTFT/TPOT and the
    decode speedup over all responses, one row per dataset, acceptance by context length
    (``buckets``: edges, default :data:`CONTEXT_BUCKETS`), and the records themselves."""
    overall = summarize(records, block_size)
    keys = ("tau_macro", "tau_pooled", "ttft_ms", "tpot_ms", "baseline_ttft_ms",
            "baseline_tpot_ms", "decode_speedup")
    return {**{k: overall[k] for k in keys}, "datasets": per_dataset(records, block_size),
            "tau_by_context": tau_by_context(records, buckets or CONTEXT_BUCKETS),
            "records": [asdict(r) for r in records]}


#: Marks an accepted draft span in ``output_marked`` (report.json) and report.md's Responses.
OPEN, CLOSE = "\u00ab", "\u00bb"


def draft_spans(gen: Generation) -> list[tuple[int, int]]:
    """[start, end) token spans of ``gen.output_ids`` that were accepted drafts: the first token
    is the prefill's; a round of length n commits n - 1 drafts, then the target's bonus token
    (a round cut at the budget or a stop token may end on a draft: counted as the bonus)."""
    spans, pos = [], 1
    for n in gen.acceptance_lengths:
        if n > 1:
            spans.append((pos, pos + n - 1))
        pos += n
    return spans


def marked_text(ids: list[int], spans: list[tuple[int, int]],
                decode: Callable[[list[int]], str]) -> str:
    """``decode(ids)`` with each span wrapped in the markers; each piece is the difference of two
    decoded prefixes, so a tokenizer merging across tokens still reads as the plain decode."""
    cuts = sorted({0, len(ids), *(i for span in spans for i in span)})
    prefix = {c: decode(ids[:c]) for c in cuts}
    starts, ends = {s for s, _ in spans}, {e for _, e in spans}
    parts = []
    for c, nxt in zip(cuts, [*cuts[1:], None]):
        parts += [CLOSE if c in ends else "", OPEN if c in starts else ""]
        if nxt is not None:
            parts.append(prefix[nxt][len(prefix[c]):])
    return "".join(parts)


def response_texts(spec: list[Generation], baseline: list[Generation] | None,
                   prompt_ids: list[list[int]], decode: Callable[[list[int]], str],
                   ) -> list[dict[str, Any]]:
    """Per response: the decoded prompt, the target's output (the baseline's when run, else the
    speculative output, which equals it when lossless), the speculative output, and that output
    with its accepted draft spans marked (:data:`OPEN` ... :data:`CLOSE`)."""
    rows = []
    for i, (ids, gen) in enumerate(zip(prompt_ids, spec)):
        target = baseline[i] if baseline is not None else gen
        rows.append({"prompt_text": decode(ids), "target_output_text": decode(target.output_ids),
                     "output_text": decode(gen.output_ids),
                     "output_marked": marked_text(gen.output_ids, draft_spans(gen), decode)})
    return rows


def generation_report(spec: list[Generation], baseline: list[Generation] | None,
                      prompt_ids: list[list[int]], block_size: int,
                      settings: dict[str, Any],
                      records: list[ResponseRecord] | None = None,
                      decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
    """Every field of report.json for a generation run (greedy losslessness only at T = 0).
    ``records``: one per response (default: one per generation, dataset ``prompts``);
    ``decode``: token ids -> text, for the ``responses`` texts (none without it)."""
    rounds = sum(len(g.acceptance_lengths) for g in spec)
    tps, base_tps = _rate(spec), _rate(baseline) if baseline is not None else None
    greedy = settings.get("temperature", 0) == 0
    mismatched = ([i for i, (s, b) in enumerate(zip(spec, baseline))
                   if s.output_ids != b.output_ids] if baseline is not None else [])
    if records is None:
        records = [record_from_generation("prompts", i, 0, s, b, greedy) for i, (s, b) in
                   enumerate(zip(spec, baseline or [None] * len(spec)))]
    report: dict[str, Any] = {"mode": "generate"}
    report.update(acceptance_summary([g.acceptance_lengths for g in spec], block_size))
    report.update(records_report(records, block_size, settings.get("context_buckets")))
    if _own_walk(settings):  # the walk's (selector path's) tau beside the unary argmax's
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
        "responses": (response_texts(spec, baseline, prompt_ids, decode)
                      if decode is not None else None),
        "settings": settings,
    })
    return report


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


_ROW_COLUMNS = (("responses", "num_responses", 0), ("tau macro", "tau_macro", 3),
                ("tau pooled", "tau_pooled", 3), ("rounds", "num_rounds", 0),
                ("TTFT ms", "ttft_ms", 1), ("TPOT ms", "tpot_ms", 2),
                ("baseline TPOT ms", "baseline_tpot_ms", 2),
                ("decode speedup", "decode_speedup", 2), ("lossless", "lossless", 0))


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: its header cells, then one line per row of cells."""
    return [f"| {' | '.join(head)} |", "|---" * len(head) + "|",
            *(f"| {' | '.join(row)} |" for row in rows)]


def suite_table(datasets: dict[str, dict[str, Any]]) -> list[str]:
    """The paper's layout: datasets as columns, tau (macro) and decode speedup rows, their mean."""
    names = list(datasets)
    lines = ["| | " + " | ".join(names) + " | mean |", "|---" * (len(names) + 2) + "|"]
    for label, key in (("tau", "tau_macro"), ("speedup", "decode_speedup")):
        values = [datasets[n][key] for n in names]
        known = [v for v in values if v is not None]
        mean = sum(known) / len(known) if len(known) == len(values) else None
        lines.append(f"| {label} | " + " | ".join(_fmt(v, 2) for v in values)
                     + f" | {_fmt(mean, 2)} |")
    return lines


def histogram_table(datasets: dict[str, dict[str, Any]], block_size: int) -> list[str]:
    """Per dataset, the share of rounds of each acceptance length 1..B (text histogram)."""
    rows = []
    for name, row in datasets.items():
        total = sum(row["acceptance_histogram"]) or 1
        rows.append([name, *(f"{100 * c / total:.1f}%" for c in row["acceptance_histogram"])])
    return _table(["dataset", *(str(n) for n in range(1, block_size + 1))], rows)


def _dataset_sections(report: dict[str, Any]) -> list[str]:
    datasets, b = report.get("datasets"), report["settings"]["block_size"]
    if not datasets:
        return []
    lines = ["## Per dataset", "", "tau macro: mean over responses of each response's tokens "
             "per verify round (the reference's); tau pooled: all tokens over all rounds (the "
             "engines' counters). TPOT: decode time / output tokens; decode speedup: baseline "
             "TPOT / TPOT.", "",
             *_table(["dataset", *(c for c, _, _ in _ROW_COLUMNS)],
                     [[n, *(_fmt(r[k], d) for _, k, d in _ROW_COLUMNS)]
                      for n, r in datasets.items()]), ""]
    if len(datasets) > 1:
        lines += [*suite_table(datasets), ""]
    lines += ["Acceptance length histogram (share of verify rounds):", "",
              *histogram_table(datasets, b), ""]
    if len(datasets) > 1:
        lines += ["Per-position acceptance per dataset:", "",
                  *_table(["dataset", *(str(t) for t in range(1, b))],
                          [[n, *(_fmt(v, 2) for v in r["per_position_acceptance"])]
                           for n, r in datasets.items()]), ""]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """A short human-readable summary of ``report``."""
    s = report["settings"]
    lines = [f"# dflash-eval report ({report['mode']})", "",
             f"- target: `{s.get('target')}`", f"- drafter: `{s.get('drafter')}`",
             f"- data: `{s.get('data')}`", f"- block size: {s.get('block_size')}"]
    if report.get("command"):
        lines.append(f"- command: `{report['command']}`")
    if report.get("timing"):
        t = report["timing"]
        lines.append(f"- timing: {t['threads']} threads on {t['cpus']} CPUs, load average "
                     f"{t['load_average']} (before, after); {t['order']}")
        lines += [f"- **warning**: {t['warning']}"] if t.get("warning") else []
    lines += ["", *_dataset_sections(report)]
    keys = ["tau_mean", "tau_macro", "tau_pooled", "selector_tau_mean", "unary_tau_mean",
            "oracle_tau_mean", "recall_at_k", "num_rounds", "lossless", "ttft_ms", "tpot_ms",
            "baseline_tpot_ms", "decode_speedup", "tokens_per_second",
            "baseline_tokens_per_second", "speedup", "draft_ms_per_round", "verify_ms_per_round",
            "num_prompts", "num_output_tokens", "num_samples", "num_blocks"]
    lines += ["## All responses", "",
              *_table(["metric", "value"], [[k, _fmt(report[k])] for k in keys if k in report])]
    # (row name, report key) of each curve: DFlash 2 reports name the selector path, unary beside
    curves = ([("acc", "per_position_acceptance")]
              if report.get("unary_per_position_acceptance") is None else
              [("selector", "per_position_acceptance"), ("unary", "unary_per_position_acceptance")])
    lines += ["", "Per-position acceptance (fraction of rounds accepting at least t drafts):", "",
              *_table(["t", *(str(t) for t in range(1, s["block_size"]))],
                      [[name, *(_fmt(v, 2) for v in report[key])] for name, key in curves])]
    lines += _context_section(report.get("tau_by_context"))
    lines += _responses_section(report)
    lines += ["", "Settings:", "", "```json", json.dumps(s, indent=2, default=str), "```"]
    return "\n".join(lines) + "\n"


#: report.md shows at most this many characters of a prompt (its end: the question asked)
PROMPT_CHARS = 600


def _responses_section(report: dict[str, Any]) -> list[str]:
    """Each response's prompt (its last :data:`PROMPT_CHARS` characters) and output with the
    accepted draft spans marked; a line more when the target's own output differs."""
    rows = report.get("responses")
    if not rows:
        return []
    taus = report.get("tau_per_prompt") or [None] * len(rows)
    lines = ["", "## Responses", "", f"Accepted draft tokens are marked {OPEN}like this{CLOSE}; "
             "the rest are the target's own tokens (the first token and each round's bonus).",
             ""]
    for i, (row, tau) in enumerate(zip(rows, taus), 1):
        prompt = row["prompt_text"]
        shown = prompt if len(prompt) <= PROMPT_CHARS else "..." + prompt[-PROMPT_CHARS:]
        lines += [f"### Response {i} (tau {_fmt(tau, 2)})", "", "Prompt:", "", "```text",
                  shown, "```", "", "Output:", "", "```text", row["output_marked"], "```", ""]
        if row["target_output_text"] != row["output_text"]:
            lines += ["The target alone wrote:", "", "```text", row["target_output_text"],
                      "```", ""]
    return lines


def _context_section(rows: list[dict[str, Any]] | None) -> list[str]:
    """The acceptance-by-context-length table (nothing when no record knew its prompt)."""
    if not rows:
        return []
    return ["", "Acceptance by context length (tokens the drafter read: prompt + committed so "
                "far; basis `responses`: an engine's totals, counted at the prompt length):", "",
            *_table(["context", "rounds", "tau", "basis"],
                    [[r["context"], str(r["rounds"]), _fmt(r["tau"]), r["basis"]] for r in rows])]


def _plot_pair(plt, hist: list[int], curve: list[float | None], title: str, out_dir: Path,
               prefix: str = "") -> list[str]:
    """Histogram and per-position curve of one set of rounds -> [histogram file, curve file]."""
    b = len(hist)
    (hist_fig, hist_ax), (curve_fig, curve_ax) = [plt.subplots(figsize=(6, 3.5)) for _ in range(2)]
    hist_ax.bar(range(1, b + 1), hist, color="tab:blue")
    hist_ax.set(xlabel="acceptance length (tokens per round)", ylabel="rounds", title=title,
                xticks=range(1, b + 1))
    curve_ax.plot(range(1, b), [math.nan if v is None else v for v in curve], marker="o")
    curve_ax.set(xlabel="draft position t", ylabel="P(accept >= t drafts)", ylim=(0, 1.02),
                 title=f"per-position acceptance{' (' + prefix[:-1] + ')' if prefix else ''}",
                 xticks=range(1, b))
    files = [f"{prefix}{HISTOGRAM_PNG}", f"{prefix}{CURVE_PNG}"]
    for fig, name in zip((hist_fig, curve_fig), files):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
    return files


def write_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """The two PNG plots over all rounds, and (several datasets) the pair of each dataset,
    ``<dataset>_acceptance_histogram.png`` etc.; returns their file names ([] when matplotlib
    is missing, logged: report.md keeps the histogram as a table)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG plots (pip install matplotlib)")
        return []
    files = _plot_pair(plt, report["acceptance_histogram"], report["per_position_acceptance"],
                       f"tau = {_fmt(report['tau_mean'], 2)}", out_dir)
    datasets = report.get("datasets") or {}
    if len(datasets) > 1:
        for name, row in datasets.items():
            safe = "".join(c if c.isalnum() or c in "-." else "_" for c in name)  # file prefix
            files += _plot_pair(plt, row["acceptance_histogram"], row["per_position_acceptance"],
                                f"{name}: tau macro = {_fmt(row['tau_macro'], 2)}", out_dir,
                                prefix=f"{safe}_")
    return files


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Write report.json, report.md and the plots into ``out_dir``; returns report.json's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, out_dir)
    atomic_write_text(out_dir / REPORT_MD, markdown(report))
    path = out_dir / REPORT_JSON
    atomic_write_text(path, dumps(report))
    return path


def dumps(report: dict[str, Any]) -> str:
    """JSON with one top-level field per line (long id lists stay on their line)."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, default=str)}"
                      for k, v in report.items())
    return "{\n" + body + "\n}\n"
