"""The DSpark arm of the comparison against speculators 0.9.0 (``variant=dspark``:
scripts/compare_speculators.py, benchmarks/peer_quality.py, benchmarks/speculators_train.py):
the driver names every file _dspark and composes our drafter=dspark with module.loss=ce, adds a
distribution-loss arm only when our_loss names one, refuses to serve; the plan carries our DSpark
heads on the DFlash 1 run's batches; their side resolves their DSpark defaults (kl_div,
fixed-exp-decay) and refuses a plan of another variant; their trainer (its own venv, slow) trains
a tiny plan whose saves our importer reads as DSpark drafters scored beside ours."""

import pytest

from benchmarks import speculators_train
from benchmarks.peer_quality import build_plan, compose_train, t1_reason
from dflash_lab.paths import REPO_ROOT
from tests.tools.compare_driver import (
    assert_their_three_steps,
    driver_lines,
    driver_paths,
    run_driver,
)
from tests.tools.test_peer_quality import (  # noqa: F401 (tiny_capture: a fixture)
    both_sides_rows,
    on_the_dflash1_batches,
    on_tiny,
    tiny_capture,
    train_theirs,
)

SPEC_PYTHON = REPO_ROOT / ".venv-speculators" / "bin" / "python"
#: conf/drafter/dspark.yaml: speculators' DSparkSpeculatorConfig defaults
DSPARK_HEADS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                "confidence_head_with_markov": True, "sample_from_anchor": True}


def test_dspark_names_every_file_and_composes_our_dspark_drafter(tmp_path):
    out = str(tmp_path / "cmp")
    got = driver_paths(tmp_path / "cmp", variant="dspark", steps="40", seeds="[0,2]")
    assert got["plan"] == f"{out}/plan_dspark.json"
    assert got["run.0"] == "outputs/runs/compare_speculators_muon_ours_dspark_s40"
    assert got["run.2"] == "outputs/runs/compare_speculators_muon_ours_dspark_s40_seed2"
    # their default weighting for dspark is fixed-exp-decay (their TrainConfig)
    assert got["theirs.0"] == f"{out}/theirs_dspark_fixed-exp-decay"
    assert got["eval_ours_T1.2"] == f"{out}/eval_ours_dspark_seed2_T1"
    assert got["stage_train_theirs.2"] == "train_theirs_dspark_fixed-exp-decay_seed2"
    assert "run_loss.0" not in got
    args = driver_lines(tmp_path / "cmp", "args", variant="dspark")
    assert "drafter=dspark" in args and not any(a.startswith("module.loss") for a in args)
    # with the target's distribution captured the loss arm still waits for an explicit our_loss
    dist = driver_paths(tmp_path / "cmp", variant="dspark", distribution="last_hidden")
    assert "run_loss.0" not in dist and dist["capture"].endswith("_dist")


@pytest.mark.parametrize("variant,knobs", [
    ("dspark", {"our_loss": "{kl: 1.0}", "distribution": "last_hidden"}),
    ("domino", {"our_loss": "tv", "distribution": "last_hidden", "arms": "[ours,loss]"}),
    ("xpress", {"our_loss": "{kl: 1.0}", "distribution": "last_hidden", "arms": "[ours,loss]"})])
def test_every_head_takes_a_distribution_loss_arm(tmp_path, variant, knobs):
    """The heads with trainable LM-head columns train with module.loss (docs/losses.md): the
    loss arm composes its module.loss beside the head's drafter group."""
    args = driver_lines(tmp_path / "cmp", "args_loss", variant=variant, **knobs)
    loss = knobs["our_loss"]
    assert f"drafter={variant}" in args, args
    assert any(a.startswith("module.loss=") and a.split("=", 1)[1].replace(" ", "") ==
               loss.replace(" ", "") for a in args), args
    assert "run_loss.0" in driver_paths(tmp_path / "cmp", variant=variant, **knobs)


def test_serve_refuses_dspark_saying_why(tmp_path):
    done = run_driver(tmp_path / "out", "serve", variant="dspark")
    assert done.returncode != 0
    assert "cannot serve DSpark" in done.stdout and "V2 GPU runner" in done.stdout
    assert not (tmp_path / "out" / "done").exists()


def test_their_dspark_loss_and_fields_are_their_defaults_and_the_plans():
    assert speculators_train.their_loss("dspark", None) == ("kl_div", "fixed-exp-decay")
    assert speculators_train.their_loss("dspark", "dpace") == ("ce", "dpace")
    with pytest.raises(ValueError, match="variant=dspark"):
        speculators_train.dspark_fields({"drafter": {"variant": "dflash1"}})
    plan = {"drafter": {"variant": "dspark", "num_hidden_layers": 3, **DSPARK_HEADS}}
    assert speculators_train.dspark_fields(plan) == DSPARK_HEADS
    assert "Markov walk" in t1_reason("dspark", heldout_holds=True)


@pytest.fixture(scope="module")
def dspark_plan(tiny_target, tiny_target_dir, tiny_capture, tmp_path_factory):  # noqa: F811
    """(overrides, plan) of the driver's DSpark run on the tiny target, 3 steps (rank 16)."""
    tmp = tmp_path_factory.mktemp("plan")
    args = on_tiny(driver_lines(tmp / "cmp", "args", variant="dspark"), tiny_target_dir,
                   tiny_capture, tiny_target.token_id("<|mask|>"), 3)
    return args + ["drafter.markov_rank=16"], build_plan(args + ["drafter.markov_rank=16"])


def test_dspark_plan_carries_our_heads_on_the_dflash1_batches(
        tiny_target, tiny_target_dir, tiny_capture, dspark_plan, tmp_path):  # noqa: F811
    args, plan = dspark_plan
    assert compose_train(args).module.loss == "ce"
    assert plan["drafter"] == {**plan["drafter"], "variant": "dspark",
                               **DSPARK_HEADS, "markov_rank": 16}
    one = on_the_dflash1_batches(plan, tmp_path, tiny_target, tiny_target_dir, tiny_capture)
    assert "markov_rank" not in one["drafter"]


@pytest.mark.skipif(not SPEC_PYTHON.exists(),
                    reason="needs .venv-speculators (make speculators-venv): speculators 0.9.0")
@pytest.mark.slow
def test_their_dspark_trains_the_plan_and_both_sides_curves_score_dspark(
        tiny_target, tiny_target_dir, tiny_capture, dspark_plan, tmp_path):  # noqa: F811
    from dflash_lab.eval.loading import load_drafter

    args, plan = dspark_plan
    theirs, run = train_theirs(plan, tiny_target_dir, tmp_path, "dspark")
    assert (run["variant"], run["loss_fn"], run["weighting"]) == (
        "dspark", "kl_div", "fixed-exp-decay")
    assert run["dspark_defaults"]["confidence_head_alpha"] == 1.0
    assert run["dspark_not_default"] == {"markov_rank": 16}  # the plan's rank, said so
    assert_their_three_steps(theirs, run)
    for step in (2, 3):
        dc = load_drafter(theirs / f"step-{step}").drafter.config
        assert dc.variant == "dspark" and dc.markov_rank == 16 and dc.sample_from_anchor
    rows = both_sides_rows(args, tiny_target, tiny_target_dir, tiny_capture, theirs, tmp_path)
    # sample_from_anchor: B drafts + the bonus
    assert all(1.0 <= r["tau_mean"] <= 9 and r["num_blocks"] > 0 for r in rows)


def test_taps_knob_names_its_own_capture_and_trains_those_layers(tmp_path):
    """A tap-layer study (docs/taps.md): the set's own captures, OUT and drafter layers; the
    default names are unchanged."""
    got = driver_paths(None, taps="[0,4,7,10,14]", distribution="last_hidden", steps="160")
    assert got["capture"].endswith("_n320_dist_taps0-4-7-10-14")
    assert got["heldout"].endswith("_heldout_n32_dist_taps0-4-7-10-14")
    assert got["out"] == "outputs/compare_speculators_dist_muon_taps0-4-7-10-14_s160"
    args = driver_lines(None, "args", taps="[0,4,7,10,14]")
    assert "drafter.target_layer_ids=[0,4,7,10,14]" in args
    assert driver_paths(None, distribution="last_hidden", steps="160")["capture"] == \
        "outputs/capture/smollm2_sharegpt_n320_dist"
    done = run_driver(tmp_path / "cmp", "capture", taps="[7,3]")
    assert done.returncode == 2 and "taps=[7, 3]: expected increasing distinct" in done.stdout
