"""The knobs of the resumable CPU pipelines (scripts/e2e_smollm2.sh, scripts/compare_speculators.sh)
as a user sets them: a setting other than the default never shares directories with the
default's (a larger data set must not resume a smaller one's shards or checkpoints), a bad value
exits 2 naming it before any work, and the serve stage refuses DFlash 2 with the reason."""

import os
import subprocess

import pytest

from dflash_lab.paths import REPO_ROOT

E2E = REPO_ROOT / "scripts" / "e2e_smollm2.sh"
COMPARE = REPO_ROOT / "scripts" / "compare_speculators.sh"


def run(script, tmp_path, *stages, **env):
    return subprocess.run([str(script), *stages], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path / "out"), **env})


def paths(tmp_path, **env) -> dict[str, str]:
    done = run(E2E, tmp_path, "paths", **env)
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(line.split("=", 1) for line in done.stdout.split())


def test_defaults_keep_the_recipes_directories(tmp_path):
    got = paths(tmp_path)
    assert got["capture"] == "outputs/capture/smollm2_sharegpt"
    assert got["run"] == "outputs/runs/smollm2_sharegpt_cpu"
    assert got["eval_suffix"] == ""


def test_data_size_weighting_and_eval_block_get_their_own_directories(tmp_path):
    got = paths(tmp_path, NUM_CONVERSATIONS="1280", WEIGHTING="dpace", EPOCHS="6",
                EVAL_BLOCK="4")
    assert got["capture"] == "outputs/capture/smollm2_sharegpt_n1280"
    assert got["run"] == "outputs/runs/smollm2_sharegpt_cpu_n1280_e6_dpace"
    assert got["eval_suffix"] == "_b4"
    on = paths(tmp_path, POLICY="on", NUM_CONVERSATIONS="640")
    assert on["capture"] == "outputs/capture/smollm2_sharegpt_onpolicy_n640"


@pytest.mark.parametrize("knob,value", [("NUM_CONVERSATIONS", "many"), ("WEIGHTING", "kl"),
                                        ("EVAL_BLOCK", "0"), ("EPOCHS", "-1")])
def test_a_bad_knob_exits_2_naming_it_before_any_work(tmp_path, knob, value):
    done = run(E2E, tmp_path, "capture", **{knob: value})
    assert done.returncode == 2
    assert f"{knob}={value}" in done.stdout
    assert not (tmp_path / "out").exists()


def test_serve_refuses_dflash2_saying_why(tmp_path):
    done = run(COMPARE, tmp_path, "serve", VARIANT="dflash2")
    assert done.returncode != 0
    assert "cannot serve DFlash 2" in done.stdout
    assert not (tmp_path / "out" / "done").exists()
