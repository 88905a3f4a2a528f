"""Draw the README's picture from docs/results.md, so the two cannot disagree.

Reads the table of docs/results.md, "What a CPU hour buys" (SmolLM2-135M + ShareGPT on 2 CPU
cores, the recorded runs of docs/experiments/smollm2_cpu.md and one_hour_cpu.md) and draws
the acceptance length tau of each run on held-out ShareGPT and HumanEval prompts.

    .venv/bin/python -m scripts.readme_figure [--out docs/img/readme_cpu_hour.png]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

SECTION = "## What a CPU hour buys"


def table_rows(results_md: Path) -> list[tuple[str, float, float]]:
    """(run, ShareGPT tau, HumanEval tau) for every row of the section's table with both."""
    text = results_md.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[2].replace(".", "").isdigit() or not cells[3]:
            continue  # header, separator or a row without both taus
        rows.append((cells[0], float(cells[2]), float(cells[3])))
    if not rows:
        raise SystemExit(f"error: no tau rows under {SECTION!r} in {results_md}; "
                         "restore the table's columns run | steps | ShareGPT tau | HumanEval tau")
    return rows


def draw(rows: list[tuple[str, float, float]], out: Path) -> None:
    """Grouped bars, one group per run; written to a temp name, then renamed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.2), dpi=120)
    xs = range(len(rows))
    for shift, col, name in ((-0.2, 1, "ShareGPT held-out"), (0.2, 2, "HumanEval")):
        bars = ax.bar([x + shift for x in xs], [r[col] for r in rows], width=0.4, label=name)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(list(xs), [r[0].replace(", ", ",\n", 1) for r in rows], fontsize=8)
    ax.set_ylim(1.0, max(max(r[1], r[2]) for r in rows) + 0.08)
    ax.set_ylabel("tau (tokens per verify round)")
    ax.set_title("SmolLM2-135M drafters trained on 2 CPU cores (docs/results.md)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("docs/results.md"))
    parser.add_argument("--out", type=Path, default=Path("docs/img/readme_cpu_hour.png"))
    args = parser.parse_args()
    draw(table_rows(args.results), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
