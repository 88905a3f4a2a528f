"""Two drafters' acceptance by context length on the same prompts, with its noise: per context
bucket each drafter's pooled tau, the difference B - A and its 95% interval from a paired cluster
bootstrap over prompts; writes ``OUT.md`` and ``OUT.png`` (docs/eval.md, "Two drafters by context").
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from dflash_lab.eval.records import bucket_name
from dflash_lab.paths import atomic_write_text

#: per prompt: per bucket [rounds, tokens]
PromptBuckets = list[list[list[int]]]


def prompt_buckets(report: dict[str, Any], edges: list[int], where: str) -> PromptBuckets:
    """Each response's rounds and committed tokens per context bucket (prompt + tokens so far)."""
    out = []
    for r in report.get("records") or []:
        if r.get("prompt_tokens") is None or r.get("acceptance_lengths") is None:
            raise ValueError(f"{where}: a record without prompt_tokens / acceptance_lengths; "
                             "compare reports of dflash-eval mode=generate backend=local")
        cells = [[0, 0] for _ in range(len(edges) + 1)]
        context = int(r["prompt_tokens"])
        for n in r["acceptance_lengths"]:
            cell = cells[bisect.bisect_right(edges, context)]
            cell[0] += 1
            cell[1] += int(n)
            context += int(n)
        out.append(cells)
    if not out:
        raise ValueError(f"{where}: the report has no records")
    return out


def _pooled(prompts: PromptBuckets, picks: list[int], b: int) -> float | None:
    rounds = sum(prompts[i][b][0] for i in picks)
    return sum(prompts[i][b][1] for i in picks) / rounds if rounds else None


def compare(a: PromptBuckets, b: PromptBuckets, edges: list[int], *, samples: int = 2000,
            seed: int = 0) -> list[dict[str, Any]]:
    """One row per bucket that holds rounds on both sides: prompts, rounds and tau of each,
    the difference B - A and its paired-bootstrap 95% interval (``samples`` resamples)."""
    if len(a) != len(b):
        raise ValueError(f"the reports hold {len(a)} and {len(b)} responses: compare two runs "
                         "of the same prompt set (same data, num_prompts, max_new_tokens)")
    rng = random.Random(seed)
    every = list(range(len(a)))
    resamples = [[rng.randrange(len(a)) for _ in every] for _ in range(samples)]
    rows = []
    for k in range(len(edges) + 1):
        tau_a, tau_b = _pooled(a, every, k), _pooled(b, every, k)
        if tau_a is None or tau_b is None:
            continue
        pairs = [(_pooled(a, picks, k), _pooled(b, picks, k)) for picks in resamples]
        diffs = [db - da for da, db in pairs if da is not None and db is not None]
        rows.append({
            "context": bucket_name(tuple(edges), k),
            "prompts": sum(1 for i in every if a[i][k][0] or b[i][k][0]),
            "rounds_a": sum(p[k][0] for p in a), "rounds_b": sum(p[k][0] for p in b),
            "tau_a": tau_a, "tau_b": tau_b, "diff": tau_b - tau_a,
            "ci_low": float(np.quantile(diffs, 0.025)),
            "ci_high": float(np.quantile(diffs, 0.975))})
    return rows


def table(rows: list[dict[str, Any]], names: tuple[str, str]) -> str:
    """The markdown table of :func:`compare`'s rows."""
    a, b = names
    lines = [f"| context (tokens) | prompts | rounds {a} | tau {a} | rounds {b} | tau {b} | "
             f"{b} - {a} | 95% CI (paired bootstrap) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['prompts']} | {r['rounds_a']} | {r['tau_a']:.3f} | "
                     f"{r['rounds_b']} | {r['tau_b']:.3f} | {r['diff']:+.3f} | "
                     f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], names: tuple[str, str], path: Path) -> None:
    """tau per bucket for both drafters (PNG), the difference's interval as error bars on B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(xs, [r["tau_a"] for r in rows], "o-", label=names[0])
    ax.errorbar(xs, [r["tau_b"] for r in rows], fmt="s-", capsize=3, label=f"{names[1]} "
                f"(bars: 95% CI of {names[1]} - {names[0]}, about {names[0]})",
                yerr=[[max(0.0, r["diff"] - r["ci_low"]) for r in rows],
                      [max(0.0, r["ci_high"] - r["diff"]) for r in rows]])
    ax.set_xticks(xs, [r["context"] for r in rows])
    ax.set(xlabel="context the drafter read (tokens)", ylabel="tau (tokens per verify round)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def read_report(path: Path) -> dict:
    """A dflash-eval report.json; ValueError naming the path and the fix if unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such report; pass the report.json of a dflash-eval run "
                         "(OUTPUT_DIR/report.json)") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err}); pass the report.json of a dflash-eval "
                         "run") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs=2, type=Path, help="report.json of A, then of B")
    parser.add_argument("--names", nargs=2, default=["A", "B"],
                        help="labels of A and B in the table and plot (default: A B)")
    parser.add_argument("--buckets", nargs="+", type=int, default=[1024, 2048, 4096, 8192],
                        help="context bucket edges in tokens (default: 1024 2048 4096 8192)")
    parser.add_argument("--samples", type=int, default=2000,
                        help="bootstrap resamples of the prompts (default: 2000)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    parser.add_argument("--out", type=Path, required=True,
                        help="writes OUT.md, OUT.json and OUT.png")
    args = parser.parse_args(argv)
    edges = sorted(args.buckets)
    try:
        a, b = (prompt_buckets(read_report(p), edges, str(p)) for p in args.reports)
        rows = compare(a, b, edges, samples=args.samples, seed=args.seed)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    names = (args.names[0], args.names[1])
    text = table(rows, names)
    atomic_write_text(args.out.with_suffix(".md"), text)
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(rows, indent=2) + "\n")
    plot(rows, names, args.out.with_suffix(".png"))
    print(text, end="")


if __name__ == "__main__":
    main()
