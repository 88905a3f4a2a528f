"""The XPress arm of the comparison against speculators 0.9.0 (``variant=xpress``:
scripts/compare_speculators.py, benchmarks/peer_quality.py, benchmarks/speculators_train.py):
the driver names every file _xpress and gives it their default weighting (a ``theirs`` arm);
the plan carries our refiner's fields on the DFlash 1 run's batches; their side resolves their
XPress defaults ({ce: 0.1, tv: 0.9}, fixed-exp-decay) and refuses a plan whose fields their
schema cannot express, naming the field; their trainer (its own venv, slow) trains a tiny plan
whose saves our format registry reads as XPress drafters that draft beside ours."""

import json

import pytest

from benchmarks import speculators_train
from benchmarks.peer_quality import build_plan, t1_reason
from dflash_lab.paths import REPO_ROOT
from tests.tools.compare_driver import assert_their_three_steps, driver_lines, driver_paths
from tests.tools.test_peer_quality import (  # noqa: F401 (tiny_capture: a fixture)
    both_sides_rows,
    on_the_dflash1_batches,
    on_tiny,
    tiny_capture,
    train_theirs,
)

SPEC_PYTHON = REPO_ROOT / ".venv-speculators" / "bin" / "python"
#: the tiny plan's refiner (rank 8, their MLP ratio 2), vLLM's top-C and passes
TINY_XPRESS = ("drafter.xpress_rank=8", "drafter.xpress_mlp_hidden=16")
THEIR_LOSS = '{"ce": 0.1, "tv": 0.9}'


def test_xpress_names_every_file_and_has_their_arm(tmp_path):
    out = str(tmp_path / "cmp")
    got = driver_paths(tmp_path / "cmp", variant="xpress", steps="40", seeds="[0,2]")
    assert got["plan"] == f"{out}/plan_xpress.json"
    assert got["run.2"] == "outputs/runs/compare_speculators_muon_ours_xpress_s40_seed2"
    # their default weighting for xpress is fixed-exp-decay (their TrainConfig)
    assert got["theirs.0"] == f"{out}/theirs_xpress_fixed-exp-decay"
    assert got["stage_train_theirs.2"] == "train_theirs_xpress_fixed-exp-decay_seed2"
    assert got["eval_theirs_T1.2"] == f"{out}/eval_theirs_xpress_fixed-exp-decay_seed2_T1"
    args = driver_lines(tmp_path / "cmp", "args", variant="xpress")
    assert "drafter=xpress" in args and not any(a.startswith("module.loss") for a in args)


def _plan(**fields) -> dict:
    """A plan whose drafter is our conf/drafter/xpress.yaml on a 2048-token vocabulary."""
    return {"drafter": {"variant": "xpress", "vocab_size": 2048, "xpress_rank": 256,
                        "xpress_mlp_hidden": 512, "xpress_topc": 512, "xpress_num_passes": 6,
                        "xpress_block_size": 16, "block_size": 16, "sample_from_anchor": False,
                        **fields}}


def test_their_xpress_loss_is_their_default_and_dpace_switches_to_ce():
    assert speculators_train.their_loss("xpress", None) == (THEIR_LOSS, "fixed-exp-decay")
    assert speculators_train.their_loss("xpress", "dpace") == ("ce", "dpace")
    assert json.loads(speculators_train.their_loss("xpress", None)[0]) == {"ce": 0.1, "tv": 0.9}
    assert "Jacobi walk" in t1_reason("xpress", heldout_holds=True)


def test_xpress_fields_map_ours_to_their_schema():
    assert speculators_train.xpress_fields(_plan()) == {
        "xpress_rank": 256, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6,
        "sample_from_anchor": False}
    small = _plan(xpress_rank=8, xpress_mlp_hidden=32, xpress_num_passes=3, vocab_size=300,
                  xpress_topc=300)
    assert speculators_train.xpress_fields(small) == {
        "xpress_rank": 8, "xpress_mlp_ratio": 4, "num_jacobi_passes": 3,
        "sample_from_anchor": False}


@pytest.mark.parametrize("fields, named", [
    ({"xpress_mlp_hidden": 384}, "xpress_mlp_hidden=384"),  # 1.5 x rank: no integer ratio
    ({"xpress_topc": 64}, "xpress_topc=64"),  # their checkpoints read back with top-C 512
    ({"xpress_topc": 0}, "xpress_topc=0"),
])
def test_a_plan_their_schema_cannot_express_is_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        speculators_train.xpress_fields(_plan(**fields))


def test_xpress_fields_refuse_another_variants_plan():
    with pytest.raises(ValueError, match="variant=xpress"):
        speculators_train.xpress_fields({"drafter": {"variant": "dspark"}})


@pytest.fixture(scope="module")
def xpress_plan(tiny_target, tiny_target_dir, tiny_capture, tmp_path_factory):  # noqa: F811
    """(overrides, plan) of the driver's XPress run on the tiny target, 3 steps (rank 8)."""
    tmp = tmp_path_factory.mktemp("plan")
    args = on_tiny(driver_lines(tmp / "cmp", "args", variant="xpress"), tiny_target_dir,
                   tiny_capture, tiny_target.token_id("<|mask|>"), 3) + list(TINY_XPRESS)
    return args, build_plan(args)


def test_xpress_plan_carries_our_refiner_on_the_dflash1_batches(
        tiny_target, tiny_target_dir, tiny_capture, xpress_plan, tmp_path):  # noqa: F811
    args, plan = xpress_plan
    d = plan["drafter"]
    assert (d["variant"], d["xpress_rank"], d["xpress_mlp_hidden"], d["xpress_num_passes"],
            d["sample_from_anchor"]) == ("xpress", 8, 16, 6, False)
    assert d["xpress_topc"] == min(512, d["vocab_size"])
    assert speculators_train.xpress_fields(plan)["xpress_mlp_ratio"] == 2
    one = on_the_dflash1_batches(plan, tmp_path, tiny_target, tiny_target_dir, tiny_capture)
    assert "xpress_rank" not in one["drafter"]


@pytest.mark.skipif(not SPEC_PYTHON.exists(),
                    reason="needs .venv-speculators (make speculators-venv): speculators 0.9.0")
@pytest.mark.slow
def test_their_xpress_trains_the_plan_and_both_sides_curves_score_xpress(
        tiny_target, tiny_target_dir, tiny_capture, xpress_plan, tmp_path):  # noqa: F811
    from dflash_lab.eval.loading import load_drafter

    args, plan = xpress_plan
    theirs, run = train_theirs(plan, tiny_target_dir, tmp_path, "xpress")
    assert (run["variant"], run["loss_fn"], run["weighting"]) == (
        "xpress", THEIR_LOSS, "fixed-exp-decay")
    defaults = run["xpress_defaults"]  # their XPressArgs, read from their schema
    assert (defaults["consistency_weight"], defaults["consistency_passes"],
            defaults["base_anchor_weight"], defaults["ce_from_data"]) == (0.3, 3, 0.6, False)
    assert defaults["loss_fn"] == THEIR_LOSS and defaults["sample_from_anchor"] is False
    assert run["xpress_not_default"] == {"xpress_rank": 8}  # the plan's rank, said so
    assert_their_three_steps(theirs, run)
    for step in (2, 3):
        dc = load_drafter(theirs / f"step-{step}").drafter.config
        assert (dc.variant, dc.xpress_rank, dc.xpress_mlp_hidden, dc.xpress_num_passes,
                dc.xpress_topc, dc.sample_from_anchor) == (
            "xpress", 8, 16, 6, plan["drafter"]["xpress_topc"], False)
    rows = both_sides_rows(args, tiny_target, tiny_target_dir, tiny_capture, theirs, tmp_path)
    # fill-in block of 16: at most 15 drafts + the bonus
    assert all(1.0 <= r["tau_mean"] <= 16 and r["num_blocks"] > 0 for r in rows)
