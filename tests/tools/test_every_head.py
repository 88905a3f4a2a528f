"""The every-head table (scripts/every_head.py): it reads each head's CE arm of the comparison
at one contract, computes the speedup from the measured costs, and names what is missing."""

import json
from pathlib import Path

import pytest

from scripts.compare_speculators import REPO
from scripts.every_head import PAGE_MARKERS, main

HEADER = "side\tstep\ttau_mean\tacc_pos1\tnum_blocks\tpath\ttau_T1\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _seed(out: Path, curves: str, name: str, tau: float, t1: str, draft: float) -> None:
    _write(out / curves, HEADER + f"ours\t160\t{tau}\t0.1\t100\tx\t{t1}\n")
    report = {"tau_mean": tau + 0.01, "lossless": True, "draft_ms_per_round": draft,
              "verify_ms_per_round": 100.0, "baseline_tpot_ms": 80.0}
    _write(out / f"eval_{name}" / "report.json", json.dumps(report))
    _write(out / f"eval_{name}_T1" / "report.json", json.dumps({"tau_mean": tau + 0.02}))


def test_rows_speedup_and_missing(tmp_path):
    out = tmp_path / "cmp"
    plan = {"drafter": {"trainable_params": 12_300_000}}
    _write(out / "plan.json", json.dumps(plan))
    _write(out / "plan_domino.json", json.dumps({"drafter": {"trainable_params": 30_200_000}}))
    _seed(out, "curves_dpace.tsv", "ours", 1.2, "1.1", 20.0)
    _seed(out, "curves_dpace_seed1.tsv", "ours_seed1", 1.3, "1.2", 20.0)
    _seed(out, "curves_domino_fixed-exp-decay.tsv", "ours_domino", 1.5, "None", 60.0)
    md = tmp_path / "t.md"
    assert main(["--heads", "dflash1,domino", "--seeds", "0,1", "--out", str(md),
                 "--json", str(tmp_path / "t.json"), f"out={out}",
                 f"archive={tmp_path / 'none'}"]) == 0
    text = md.read_text()
    dflash1 = next(ln for ln in text.splitlines() if ln.startswith("| DFlash 1 |"))
    assert "| 12.3 | 0 1 |" in dflash1 and "1.250 ± 0.071 [1.200..1.300]" in dflash1
    # speedup = tau_T0 x target ms per token / (draft + verify): 1.21 x 80 / 120 and 1.31 x 80 / 120
    assert f"{(1.21 + 1.31) / 2 * 80 / 120:.2f}" in dflash1
    domino = next(ln for ln in text.splitlines() if ln.startswith("| Domino |"))
    assert "| 30.2 | 0 |" in domino and "1.500 (1 of 2 seeds)" in domino and "| n/a |" in domino
    assert f"{1.51 * 80 / 160:.2f} (1 of 2)" in domino
    # Domino's seed 1 is missing, and said so
    assert "curves_domino_fixed-exp-decay_seed1.tsv" in text
    assert "+0.250 (one seed: spread unknown)" in text
    stats = json.loads((tmp_path / "t.json").read_text())["stats"]
    assert [s["seeds"] for s in stats] == [[0, 1], [0]]


def test_unknown_head_is_refused(tmp_path, capsys):
    assert main(["--heads", "dflash3"]) == 2
    assert "dflash3" in capsys.readouterr().err


ARCHIVE = REPO / "results_archive" / "compare_speculators_dist_muon_s160"


def test_the_results_page_table_is_what_the_committed_archive_gives(tmp_path):
    """docs/results.md's every-head table is what the committed archive alone gives (no
    outputs/, as on a fresh clone): every number on the page can be recomputed."""
    md = tmp_path / "t.md"
    assert main(["--out", str(md), f"out={tmp_path / 'fresh'}", f"archive={ARCHIVE}"]) == 0
    want = md.read_text().split("Missing inputs")[0].strip()
    page = (REPO / "docs" / "results.md").read_text()
    begin, end = PAGE_MARKERS
    got = page[page.index(begin) + len(begin):page.index(end)].strip()
    assert got == want, ("docs/results.md's every-head table differs from what "
                         f"{ARCHIVE.relative_to(REPO)} gives: archive the runs "
                         "(stages=[archive]) and refill the table: `python -m "
                         "scripts.every_head --page docs/results.md`")


def test_page_fill_replaces_only_the_table(tmp_path):
    """--page rewrites what lies between the markers and nothing else."""
    begin, end = PAGE_MARKERS
    page = tmp_path / "results.md"
    page.write_text(f"intro\n{begin}\nold table\n{end}\nafter\n")
    assert main(["--heads", "dflash1", "--page", str(page), f"out={tmp_path / 'none'}",
                 f"archive={tmp_path / 'none'}"]) == 0
    text = page.read_text()
    assert text.startswith(f"intro\n{begin}\n| head |") and text.endswith(f"{end}\nafter\n")
    assert "old table" not in text and "Missing inputs" not in text


def test_page_without_markers_is_refused_by_name(tmp_path):
    page = tmp_path / "notes.md"
    page.write_text("no table here\n")
    with pytest.raises(SystemExit, match="notes.md: no '<!-- every-head table"):
        main(["--heads", "dflash1", "--page", str(page), f"out={tmp_path / 'none'}",
              f"archive={tmp_path / 'none'}"])
    assert page.read_text() == "no table here\n"
