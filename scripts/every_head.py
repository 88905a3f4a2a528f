"""Every head on one contract (issue 45): the table of docs/results.md, "Which head".

Reads what ``scripts/compare_speculators.py`` left for each head's CE arm at the same knobs
(the same SmolLM2 capture, plan batches and step budget; a file OUT lacks is read from the
comparison's archive, as its ``table`` stage does) and writes one row per head: held-out tau at
T = 0 and expected T = 1 (curves, features mode), decoding tau at T = 0 and T = 1 (dflash-eval),
losslessness, the drafter's trained parameters (the plan), the draft and verify cost of a round
and the target's cost per token (each T = 0 eval measures the three side by side), and the
speedup those costs give: ``tau_T0 * target_ms_per_token / (draft_ms + verify_ms)``.

    python -m scripts.every_head [--heads dflash1,dflash2,...] [--seeds 0,1,2] \
        [--out docs/every_head.md] [--json every_head.json] [KNOB=VALUE ...]

KNOB=VALUE are compare_speculators knobs (defaults: the table's contract, :data:`CONTRACT`).
Each cell is mean ± std [min..max] over the seeds found, with "(k of n seeds)" where some are
missing, and every missing input file is listed under the table: no silent gaps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.peer_quality import _cell, read_tsv, separation, spread
from dflash_lab.paths import atomic_write_text
from scripts.compare_speculators import VARIANTS, Driver, Knobs, load_knobs

#: the contract every head is trained and measured on (docs/results.md, "Which head")
CONTRACT = ("distribution=last_hidden", "optimizer=muon", "steps=160", "eval_every=80",
            "num_prompts=8", "arms=[ours]", "our_loss=none")
#: the table's columns: (key, title)
COLUMNS = (("heldout_T0", "held-out tau T=0"), ("heldout_T1", "held-out expected tau T=1"),
           ("decode_T0", "decoding tau T=0"), ("decode_T1", "decoding tau T=1"),
           ("draft_ms", "draft ms / round"), ("verify_ms", "verify ms / round"),
           ("speedup", "speedup from costs"))
#: where docs/results.md holds the table (``--page`` replaces what lies between them)
PAGE_MARKERS = ("<!-- every-head table: python -m scripts.every_head (BEGIN) -->", "<!-- (END) -->")
TITLES = {"dflash1": "DFlash 1", "dflash2": "DFlash 2", "dspark": "DSpark", "domino": "Domino",
          "lilicorr": "LiLiCorr", "lilicorr_conv": "LiLiCorr+conv", "xpress": "XPress"}


def _read_json(path: Path, missing: list[str]) -> dict | None:
    if path.is_file():
        return json.loads(path.read_text())
    missing.append(str(path))
    return None


def seed_row(driver: Driver, seed: int, missing: list[str]) -> dict[str, Any]:
    """One head at one seed: every :data:`COLUMNS` value (None where not measured) and
    ``lossless``; inputs that do not exist are appended to ``missing``."""
    k = driver.k
    s = k.at(seed)
    curves = Path(driver.kept(s.curves))
    final = None
    if curves.is_file():
        final = next((r for r in read_tsv(curves) if r["side"] == "ours" and r["step"] == k.steps),
                     None)
        if final is None:
            missing.append(f"{curves}: no ours row at step {k.steps}")
    else:
        missing.append(str(curves))
    t0 = _read_json(Path(driver.kept(f"{k.out}/eval_{s.ours_name}/report.json")), missing)
    t1 = _read_json(Path(driver.kept(f"{k.out}/eval_{s.ours_name}_T1/report.json")), missing)
    row = {"heldout_T0": final and final["tau_mean"], "heldout_T1": final and final["tau_T1"],
           "decode_T0": t0 and t0["tau_mean"], "decode_T1": t1 and t1["tau_mean"],
           "draft_ms": t0 and t0.get("draft_ms_per_round"),
           "verify_ms": t0 and t0.get("verify_ms_per_round"),
           "lossless": t0 and t0.get("lossless"), "speedup": None}
    if t0 and row["draft_ms"] and row["verify_ms"] and t0.get("baseline_tpot_ms"):
        row["speedup"] = (t0["tau_mean"] * t0["baseline_tpot_ms"]
                          / (row["draft_ms"] + row["verify_ms"]))
    return row


def head_params(driver: Driver, missing: list[str]) -> int | None:
    """The drafter's trained parameters, as the head's plan recorded them."""
    plan = _read_json(Path(driver.kept(driver.k.plan)), missing)
    return plan and plan["drafter"]["trainable_params"]


def head_stats(variant: str, seeds: list[int], knobs: list[str],
               missing: list[str]) -> dict[str, Any]:
    """Every column's :func:`~benchmarks.peer_quality.spread` over ``seeds`` for one head,
    its parameters, the seeds found and losslessness."""
    driver = Driver(Knobs(load_knobs([*CONTRACT, f"variant={variant}", *knobs])))
    rows = [seed_row(driver, seed, missing) for seed in seeds]
    found = [seed for seed, r in zip(seeds, rows) if r["decode_T0"] is not None
             or r["heldout_T0"] is not None]
    checked = [r["lossless"] for r in rows if r["lossless"] is not None]
    return {"variant": variant, "params": head_params(driver, missing), "seeds": found,
            "lossless": None if not checked else all(checked), "lossless_n": len(checked),
            **{key: spread([r[key] for r in rows if r[key] is not None]) for key, _ in COLUMNS}}


def _number_cell(st: dict[str, float] | None, of: int, nd: int) -> str:
    if st is None:
        return "-"
    text = f"{st['mean']:.{nd}f}" if st["n"] == 1 else f"{st['mean']:.{nd}f} ± {st['std']:.{nd}f}"
    return text + ("" if st["n"] == of else f" ({st['n']} of {of})")


def table(stats: list[dict[str, Any]], num_seeds: int) -> str:
    """The markdown table (one row per head) and, per tau column, each head against DFlash 1."""
    head = ("| head | params (M) | seeds | " + " | ".join(t for _, t in COLUMNS)
            + " | lossless T=0 |")
    lines = [head, "|---" * (len(COLUMNS) + 4) + "|"]
    for st in stats:
        cells = []
        for key, _ in COLUMNS:
            if key.endswith("_ms") or key == "speedup":
                cells.append(_number_cell(st[key], num_seeds, 1 if key.endswith("_ms") else 2))
            else:
                cells.append(_cell(st[key], num_seeds, "n/a" if key == "heldout_T1" else "-"))
        params = "-" if st["params"] is None else f"{st['params'] / 1e6:.1f}"
        lossless = ("-" if st["lossless"] is None else
                    f"{'yes' if st['lossless'] else 'NO'} ({st['lossless_n']} of "
                    f"{num_seeds} evals)")
        lines.append(f"| {TITLES[st['variant']]} | {params} | "
                     f"{' '.join(map(str, st['seeds'])) or '-'} | {' | '.join(cells)} | "
                     f"{lossless} |")
    base = next((st for st in stats if st["variant"] == "dflash1"), None)
    if base is not None:
        taus = [(k, t) for k, t in COLUMNS if k.startswith(("heldout", "decode"))]
        lines += ["", "Against DFlash 1 (difference of the means; separated when the seed "
                  "ranges do not overlap):", "",
                  "| head | " + " | ".join(t for _, t in taus) + " |",
                  "|---" * (len(taus) + 1) + "|"]
        for st in stats:
            if st is not base:
                lines.append(f"| {TITLES[st['variant']]} | " + " | ".join(
                    separation(st[k], base[k]) for k, _ in taus) + " |")
    return "\n".join(lines) + "\n"


def fill_page(page: Path, table_text: str) -> None:
    """Replace the table between :data:`PAGE_MARKERS` in ``page`` (the missing-input list stays
    out of the page); the page is rewritten atomically."""
    text = page.read_text() if page.is_file() else ""
    begin, end = PAGE_MARKERS
    if begin not in text or end not in text[text.find(begin):]:
        raise SystemExit(f"error: --page {page}: no '{begin}' ... '{end}' markers in it; give "
                         "docs/results.md, or add the two marker lines where the table goes")
    i, j = text.index(begin) + len(begin), text.index(end, text.index(begin))
    atomic_write_text(page, text[:i] + "\n" + table_text.strip() + "\n" + text[j:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default=",".join(TITLES),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=None, help="write the markdown here (default: stdout)")
    p.add_argument("--json", default=None, help="write the numbers here")
    p.add_argument("--page", default=None, help="replace the table between the markers of this "
                   "page (docs/results.md)")
    p.add_argument("knobs", nargs="*", help="compare_speculators KNOB=VALUE overrides")
    a = p.parse_args(argv)
    heads = [h for h in a.heads.split(",") if h]
    unknown = [h for h in heads if h not in VARIANTS]
    if unknown:
        print(f"error: --heads {a.heads}: {', '.join(unknown)} not a head of "
              f"scripts/compare_speculators.py (one of {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    seeds = [int(s) for s in a.seeds.split(",")]
    missing: list[str] = []
    stats = [head_stats(h, seeds, a.knobs, missing) for h in heads]
    text = table(stats, len(seeds))
    if a.page:
        fill_page(Path(a.page), text)
    if missing:
        text += "\nMissing inputs (their stages have not run):\n" + "".join(
            f"- {m}\n" for m in missing)
    if a.out:
        atomic_write_text(Path(a.out), text)
    else:
        print(text, end="")
    if a.json:
        atomic_write_text(Path(a.json), json.dumps({"stats": stats, "missing": missing}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
