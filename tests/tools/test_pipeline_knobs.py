"""The knobs of the comparison pipeline (scripts/compare_speculators.sh) as a user sets them: the
serve stage refuses DFlash 2 with the reason. (The SmolLM2 end-to-end pipeline is a recipe now,
``dflash-lab run recipe=smollm2_sharegpt_cpu``: tests/tools/test_pipeline.py and
tests/recipes/test_recipes_run.py.)"""

import os
import subprocess

from dflash_lab.paths import REPO_ROOT

COMPARE = REPO_ROOT / "scripts" / "compare_speculators.sh"


def run(script, tmp_path, *stages, **env):
    return subprocess.run([str(script), *stages], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path / "out"), **env})


def test_serve_refuses_dflash2_saying_why(tmp_path):
    done = run(COMPARE, tmp_path, "serve", VARIANT="dflash2")
    assert done.returncode != 0
    assert "cannot serve DFlash 2" in done.stdout
    assert not (tmp_path / "out" / "done").exists()
