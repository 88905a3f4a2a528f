"""What `make demo` (``dflash-train recipe=tiny_cpu``) prints, at toy size: every line once, no
third-party advertisement or expected-notice warning, and the summary block last (tau before ->
after, the run, the export, the next commands)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash_lab.paths import REPO_ROOT

TOY = ["data.demo_rows=24", "data.max_length=96", "data.batch_size=8", "trainer.max_epochs=1",
       "logger=csv", "export.self_check=false"]
NOISE = ("litlogger", "\U0001f4a1", "module(s) in eval mode", "DeprecationWarning", "INFO: ")


def demo(tmp_path, target_dir) -> tuple[list[str], list[str]]:
    """The demo's (stdout lines, stdout + stderr lines); progress bars' lines dropped."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DFLASH_DEBUG": ""}
    env.pop("DFLASH_PROGRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", "from dflash_lab.train.cli import main; main()",
         "recipe=tiny_cpu", f"target.path={target_dir}", f"paths.output_dir={tmp_path / 'run'}",
         f"data.demo_file={tmp_path / 'demo.jsonl'}", *TOY],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    def lines(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.strip() and "\r" not in ln and "|" not in ln]

    return lines(proc.stdout), lines(proc.stdout + "\n" + proc.stderr)


@pytest.mark.slow
def test_demo_prints_each_line_once_without_noise_and_ends_with_the_summary(tiny_target_dir,
                                                                           tmp_path):
    stdout, lines = demo(tmp_path, tiny_target_dir)
    repeated = {ln for ln in lines if lines.count(ln) > 1}
    assert not repeated, f"printed twice: {sorted(repeated)}"
    noisy = [ln for ln in lines if any(n in ln for n in NOISE)]
    assert not noisy, noisy
    out = summary_tail(stdout)
    assert out[0] == "== dflash-train summary"
    assert out[1].startswith("val tau: untrained ") and " -> trained " in out[1]
    assert out[2].startswith("best checkpoint: ") and out[3].startswith("run directory: ")
    assert out[4] == f"export: {tmp_path / 'run' / 'export'}"
    assert out[5].startswith("next: dflash-eval target=tiny ")
    assert "drafter.path=" in out[5] and out[6].startswith("next: make prepare-smollm2")


def summary_tail(lines: list[str]) -> list[str]:
    """Stdout from the summary's heading on: the block must be the last thing printed."""
    starts = [i for i, ln in enumerate(lines) if ln == "== dflash-train summary"]
    assert starts, "no summary block"
    tail = lines[starts[-1]:]
    assert len(tail) == 7, tail  # nothing after the block
    return tail
