"""Keep a comparison's per-seed results past the machine that made them (issue 27).

``outputs/`` is not kept between sessions, while a three-seed comparison takes longer than one:
the ``archive`` stage of ``scripts/compare_speculators.py`` copies the small files its ``table``
stage reads (each seed's learning-curve TSV and every arm's ``dflash-eval`` report.json at T = 0
and T = 1, the plan, the held-out capture's manifest) into a committed folder
(``results_archive/<OUT's name>/``, the same relative paths as under OUT), and ``table`` reads a
file from there when OUT does not hold it. Seeds measured on different machines are only combined
when they trained on the same batches: ``check-plans`` refuses plans whose steps differ.

    python -m benchmarks.run_archive save --out OUT --archive DIR --heldout CAPTURE FILE ...
    python -m benchmarks.run_archive check-plans PLAN.json PLAN.json ...
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path

from dflash_lab.data.shards import MANIFEST_FILE
from dflash_lab.paths import atomic_path, atomic_write_text
from dflash_lab.runinfo import git_sha

PROVENANCE = "provenance.json"
HELDOUT_DIR = "heldout"  # the archived held-out manifest: a folder read_manifest() reads


def plan_steps(path: Path) -> list:
    """The per-step batches and lrs of a plan.json (what must match for seeds to combine)."""
    try:
        return json.loads(path.read_text())["steps"]
    except (OSError, json.JSONDecodeError, KeyError) as err:
        raise ValueError(f"{path}: not a plan.json with 'steps' ({err}); rerun the plan "
                         "stage") from err


def check_plans(paths: list[Path]) -> None:
    """ValueError naming both files when two existing plans give other batches or lrs (missing
    files are skipped: a fresh machine has no archive yet, an archive-only table no plan)."""
    found = [p for p in paths if p.is_file()]
    for other in found[1:]:
        if plan_steps(other) != plan_steps(found[0]):
            raise ValueError(
                f"{other} and {found[0]}: other batches or lrs, so their seeds do not combine; "
                "rerun the capture and plan stages with the archive's knobs (its "
                f"{PROVENANCE} lists them), or give the table another ARCHIVE")


def _relative(path: Path, out: Path) -> Path:
    try:
        return path.resolve().relative_to(out.resolve())
    except ValueError:
        raise ValueError(f"{path}: not under OUT={out}; the archive keeps OUT's layout") from None


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def save(out: Path, archive: Path, heldout: Path, files: list[Path], knobs: dict) -> list[Path]:
    """Copy ``files`` (each under ``out``) to the same relative paths under ``archive``, the
    held-out manifest to ``archive/heldout/``, and write ``provenance.json`` (when, git SHA,
    the knobs, every file archived so far). Every file is checked to exist before any copy
    (no half archive); a plan already archived must equal the new one. Returns the copies."""
    files = list(dict.fromkeys(files))  # the arms of a seed share its curves file
    missing = [str(f) for f in files if not f.is_file()]
    manifest = heldout / MANIFEST_FILE
    if not manifest.is_file():
        missing.append(str(manifest))
    if missing:
        raise ValueError("archive: missing " + ", ".join(missing) + "; run the stages that "
                         "write them (train, curves, eval) for every seed of SEEDS first")
    pairs = [(f, archive / _relative(f, out)) for f in files]
    for src, dst in pairs:
        if src.name.startswith("plan"):
            check_plans([dst, src])
    pairs.append((manifest, archive / HELDOUT_DIR / MANIFEST_FILE))
    for src, dst in pairs:
        _copy(src, dst)
    record_path = archive / PROVENANCE
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"saves": []}
    record["saves"].append({"when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            "git_sha": git_sha(), "knobs": knobs,
                            "files": [str(dst.relative_to(archive)) for _, dst in pairs]})
    atomic_write_text(record_path, json.dumps(record, indent=1) + "\n")
    return [dst for _, dst in pairs]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ps = sub.add_parser("save")
    for k in ("out", "archive", "heldout"):
        ps.add_argument(f"--{k}", required=True, type=Path)
    ps.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the run, recorded in provenance.json")
    ps.add_argument("files", nargs="+", type=Path)
    pc = sub.add_parser("check-plans")
    pc.add_argument("plans", nargs="+", type=Path)
    a = p.parse_args(argv)
    try:
        if a.cmd == "save":
            knobs = dict(k.split("=", 1) for k in a.knob)
            copies = save(a.out, a.archive, a.heldout, a.files, knobs)
            print(f"archive: {len(copies)} files -> {a.archive} (commit them: outputs/ is not "
                  "kept)")
        else:
            check_plans(a.plans)
    except ValueError as err:
        sys.exit(str(err))


if __name__ == "__main__":
    main()
