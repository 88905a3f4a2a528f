"""The comparison's archive (benchmarks/run_archive.py, the archive and table stages of
scripts/compare_speculators.py): seeds measured on a machine whose outputs/ is gone still reach
the table, only when they trained on the same batches, and a half archive is never written."""

import json
import os

import pytest

from benchmarks.run_archive import HELDOUT_DIR, PROVENANCE, check_plans, save
from dflash_lab.data.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE
from tests.tools.compare_driver import driver_paths, run_driver


def _heldout(tmp_path):
    d = tmp_path / "heldout_capture"
    d.mkdir()
    (d / MANIFEST_FILE).write_text(json.dumps({
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "distribution": {"last_hidden": True}}))
    return d


def _plan(path, steps):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"steps": steps, "num_steps": len(steps)}))
    return path


def test_save_keeps_outs_layout_and_records_the_knobs(tmp_path):
    out, arch = tmp_path / "out", tmp_path / "arch"
    plan = _plan(out / "plan.json", [[1, 2], [3, 4]])
    report = out / "eval_ours" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text('{"tau_mean": 1.2}')
    copies = save(out, arch, _heldout(tmp_path), [plan, report, report], {"SEEDS": "1"})
    assert (arch / "eval_ours" / "report.json").read_text() == '{"tau_mean": 1.2}'
    assert (arch / HELDOUT_DIR / MANIFEST_FILE).is_file() and len(copies) == 3
    record = json.loads((arch / PROVENANCE).read_text())
    assert record["saves"][0]["knobs"] == {"SEEDS": "1"}
    assert record["saves"][0]["files"] == ["plan.json", "eval_ours/report.json",
                                           f"{HELDOUT_DIR}/{MANIFEST_FILE}"]
    save(out, arch, tmp_path / "heldout_capture", [plan], {"SEEDS": "2"})
    assert len(json.loads((arch / PROVENANCE).read_text())["saves"]) == 2  # appended


def test_a_missing_input_writes_nothing_and_is_named(tmp_path):
    out, arch = tmp_path / "out", tmp_path / "arch"
    plan = _plan(out / "plan.json", [[1]])
    with pytest.raises(ValueError, match=r"missing .*eval_theirs_T1/report.json"):
        save(out, arch, _heldout(tmp_path), [plan, out / "eval_theirs_T1" / "report.json"], {})
    assert not arch.exists()


def test_other_batches_never_combine(tmp_path):
    out, arch = tmp_path / "out", tmp_path / "arch"
    heldout = _heldout(tmp_path)
    save(out, arch, heldout, [_plan(out / "plan.json", [[1, 2]])], {})
    _plan(out / "plan.json", [[1, 3]])
    with pytest.raises(ValueError, match="other batches or lrs"):
        save(out, arch, heldout, [out / "plan.json"], {})
    with pytest.raises(ValueError, match="other batches or lrs"):
        check_plans([out / "plan.json", arch / "plan.json"])
    check_plans([tmp_path / "none.json", arch / "plan.json"])  # a fresh machine: no plan yet


def _archive_two_seeds(tmp_path):
    """Two seeds of ours and theirs archived from an OUT whose files are then deleted: the
    driver's knobs (OUT included) and the archive directory."""
    out, arch = tmp_path / "cmp", tmp_path / "arch"
    knobs = {"out": str(out), "archive": str(arch), "plot_dir": str(tmp_path), "seeds": "[0,1]",
             "distribution": "last_hidden", "our_loss": "none", "steps": "4"}
    got = driver_paths(None, **knobs)
    files = [_plan(out / "plan.json", [[0]])]
    for seed, (ours, theirs) in enumerate([(1.30, 1.20), (1.34, 1.22)]):
        curves = out / os.path.relpath(got[f"curves.{seed}"], out)
        curves.parent.mkdir(parents=True, exist_ok=True)
        lines = ["side\tstep\ttau_mean\tacc_pos1\tnum_blocks\tpath\ttau_T1"]
        lines += [f"{side}\t4\t{tau}\t0.1\t9\tp\t{tau - 0.1}"
                  for side, tau in (("ours", ours), ("speculators", theirs))]
        curves.write_text("\n".join(lines) + "\n")
        files.append(curves)
        for key, tau in ((f"eval_ours.{seed}", ours), (f"eval_theirs.{seed}", theirs)):
            for suffix, body in (("", {"tau_mean": tau, "lossless": True}),
                                 ("_T1", {"tau_mean": tau - 0.2, "lossless": None,
                                          "settings": {"temperature": 1.0,
                                                       "sampling": "rejection"}})):
                report = out / os.path.relpath(got[key] + suffix, out) / "report.json"
                report.parent.mkdir(parents=True, exist_ok=True)
                report.write_text(json.dumps(body))
                files.append(report)
    save(out, arch, _heldout(tmp_path), files, {})
    for f in files:
        f.unlink()
    return knobs, arch


def _table(knobs):
    return run_driver(None, "table", timeout=120, **knobs)


def test_table_reads_archived_seeds_when_outputs_are_gone(tmp_path):
    """Two seeds archived from an OUT that is then deleted: the table stage still gives both
    seeds' numbers, read from the archive."""
    knobs, _ = _archive_two_seeds(tmp_path)
    done = _table(knobs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1.320 ± 0.028 [1.300..1.340]" in done.stdout  # ours held out, both seeds
    assert "Missing inputs" not in done.stdout


def test_arms_selects_what_table_reads(tmp_path):
    """arms names the arms table (and archive) read: with our arm's reports gone, the default
    table lists them as missing, arms=[theirs] reads none of them; an unknown arm exits 2."""
    knobs, arch = _archive_two_seeds(tmp_path)
    for d in arch.glob("eval_ours*"):
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    assert "Missing inputs" in _table(knobs).stdout
    done = _table({**knobs, "arms": "[theirs]"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Missing inputs" not in done.stdout
    assert "speculators" in done.stdout and "ours ce" not in done.stdout
    bad = _table({**knobs, "arms": "[ours,mine]"})
    assert bad.returncode == 2 and "mine is not an arm" in bad.stdout
