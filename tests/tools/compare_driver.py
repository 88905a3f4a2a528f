"""The comparison driver (scripts/compare_speculators.py) as a user runs it in the tests: a
subprocess from the repository root, knobs as ``key=value`` overrides, OUT in a temp folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_lab.paths import REPO_ROOT


def run_driver(out: Path | None, /, *stages: str, timeout: int = 60,
               **knobs: str) -> subprocess.CompletedProcess:
    """``python -m scripts.compare_speculators stages=[STAGES] out=OUT KEY=VALUE...``; ``out``
    None leaves OUT at its default (the knobs' name)."""
    argv = [sys.executable, "-m", "scripts.compare_speculators", f"stages=[{','.join(stages)}]"]
    argv += [] if out is None else [f"out={out}"]
    argv += [f"{k}={v}" for k, v in knobs.items()]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


def driver_lines(out: Path | None, stage: str, /, **knobs: str) -> list[str]:
    """The stdout lines of a printing stage (args, args_loss, paths); it must succeed."""
    done = run_driver(out, stage, **knobs)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def driver_paths(out: Path | None, /, **knobs: str) -> dict[str, str]:
    """The ``paths`` stage's KEY=VALUE lines as a dict."""
    return dict(line.split("=", 1) for line in driver_lines(out, "paths", **knobs))


def assert_their_three_steps(theirs: Path, run: dict) -> None:
    """Their trainer ran a 3-step plan at its default optimizer: a finite loss logged at every
    step, ``step-N`` saves at steps 2 and 3 (``--save-every 2`` and the last)."""
    assert run["optimizer"]["name"] == "default"  # their Muon + AdamW at their defaults
    log = [line.split("\t") for line in (theirs / "train_log.tsv").read_text().splitlines()]
    assert [int(r[0]) for r in log] == [1, 2, 3] and all(0 < float(r[1]) < 100 for r in log)
    assert sorted(p.name for p in theirs.glob("step-*")) == ["step-2", "step-3"]


def in_peer_venv(python: Path, *argv: str) -> None:
    """``PYTHON ARGV`` (a peer venv's interpreter: a bridge, or a test double under
    tests/tools) from the repository root, offline, one thread; it must exit 0."""
    done = subprocess.run([str(python), *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def run_bridge(python: Path, module: str, plan_file: Path, target_dir: Path, out: Path,
               variant: str) -> dict:
    """A peer's bridge (``python -m MODULE``, :func:`in_peer_venv`) on ``plan_file`` for
    ``--variant VARIANT``, a save every 2 steps into ``out``; its run.json."""
    in_peer_venv(python, "-m", module, "--plan", str(plan_file), "--target", str(target_dir),
                 "--out", str(out), "--save-every", "2", "--variant", variant)
    return json.loads((out / "run.json").read_text())
