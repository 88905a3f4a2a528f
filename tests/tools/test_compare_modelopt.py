"""The ModelOpt arm of the comparison (issue 45: ``variant=lilicorr|lilicorr_conv``'s ``theirs``
arm is NVIDIA ModelOpt's own LiLiCorr trainer, benchmarks/modelopt_train.py in .venv-modelopt):
the driver names its files as every other peer's and refuses the knobs ModelOpt's recipe cannot
follow; the plan's fields map onto their recipe's keys and a plan their config cannot express is
refused naming the field; their export's names become the engines'; their trainer (its own venv,
slow) trains a tiny plan offline on the capture's states and our reader loads and drafts with
its saves, and scores their saved lattice exactly as their head does (tests/tools/
modelopt_scores.py, run in their venv)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks import modelopt_train
from benchmarks.peer_quality import checkpoints, parse_others
from dflash_lab.paths import REPO_ROOT
from tests.tools.compare_driver import driver_paths, in_peer_venv, run_bridge, run_driver
from tests.tools.test_peer_quality import (  # noqa: F401 (dist_capture: a fixture)
    both_sides_rows,
    dist_capture,
    tiny_plan,
)

MODELOPT_PYTHON = REPO_ROOT / ".venv-modelopt" / "bin" / "python"
#: the knobs ModelOpt's arm needs (the every-head table's contract)
KNOBS = {"distribution": "last_hidden", "optimizer": "muon"}
#: the tiny plan's lattice: 32 wide, 16 factors (4 heads of 8)
TINY_LATTICE = ("drafter.lilicorr_hidden_size=32", "drafter.lilicorr_factor_dim=16")
SHAPE = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "intermediate_size": 1536, "num_hidden_layers": 30}


@pytest.mark.parametrize("variant", ["lilicorr", "lilicorr_conv"])
def test_lilicorr_has_a_modelopt_theirs_arm_named_as_every_peer(tmp_path, variant):
    out = str(tmp_path / "cmp")
    got = driver_paths(tmp_path / "cmp", variant=variant, seeds="[0,2]", **KNOBS)
    assert got["plan"] == f"{out}/plan_{variant}.json"
    assert got["theirs.0"] == f"{out}/theirs_{variant}_fixed-exp-decay"
    assert got["stage_train_theirs.2"] == f"train_theirs_{variant}_fixed-exp-decay_seed2"
    assert got["eval_theirs_T1.2"] == f"{out}/eval_theirs_{variant}_fixed-exp-decay_seed2_T1"
    # our arm's names are what they were without a peer (arms=[ours])
    alone = driver_paths(tmp_path / "cmp", variant=variant, seeds="[0,2]", arms="[ours]",
                         **KNOBS)
    assert {k: v for k, v in got.items() if "theirs" not in k} == \
        {k: v for k, v in alone.items() if "theirs" not in k}


@pytest.mark.parametrize("knob, value", [("distribution", "none"), ("optimizer", "adamw"),
                                         ("their_weighting", "dpace")])
def test_a_knob_modelopts_recipe_cannot_follow_is_refused_naming_it(tmp_path, knob, value):
    done = run_driver(tmp_path / "cmp", "capture", variant="lilicorr", **{**KNOBS, knob: value})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{knob}={value}" in done.stdout and "ModelOpt" in done.stdout
    assert not (tmp_path / "cmp").exists()


def test_train_theirs_runs_modelopt_py_and_names_its_make_target(tmp_path):
    done = run_driver(tmp_path / "cmp", "train_theirs", variant="lilicorr",
                      modelopt_py=str(tmp_path / "none" / "python"), **KNOBS)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "make modelopt-venv" in done.stdout
    assert not (tmp_path / "cmp" / "done").exists()


def _plan(**fields) -> dict:
    """The SmolLM2 LiLiCorr plan's drafter (3 layers, block 8, LILICORR_SET) at 3 taps."""
    d = {"variant": "lilicorr", "num_hidden_layers": 3, "block_size": 8,
         "target_layer_ids": [1, 14, 27], "mask_token_id": 16, "hidden_size": 576,
         "vocab_size": 49152, "trainable_params": 1, "lilicorr_candidate_topk": 8,
         "lilicorr_hidden_size": 256, "lilicorr_num_layers": 2, "lilicorr_num_heads": 4,
         "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 64, "lilicorr_vector_eps": 1e-4,
         "lilicorr_logit_scale": 8.0, "conv_kernel_size": None, "conv_group_size": None,
         "sample_from_anchor": False}
    return {"num_anchors_per_sequence": 32, "gamma": 4.0, "drafter": {**d, **fields}}


def test_the_plan_fields_map_onto_their_recipe_keys():
    got = modelopt_train.dflash_fields(_plan(), "lilicorr", SHAPE)
    arch = "dflash.dflash_architecture_config."
    assert got == {
        "dflash.dflash_block_size": 8, "dflash.dflash_num_anchors": 32,
        "dflash.dflash_mask_token_id": 16, "dflash.dflash_loss_decay_factor": 4.0,
        **{arch + k: v for k, v in {
            "lilicorr_candidate_topk": 8, "lilicorr_hidden_size": 256,
            "lilicorr_num_layers": 2, "lilicorr_num_heads": 4, "lilicorr_mlp_ratio": 2.0,
            "lilicorr_factor_dim": 64, "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 8.0,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "intermediate_size": 1536, "num_hidden_layers": 3,
            "target_layer_ids": [1, 14, 27]}.items()}}
    conv = modelopt_train.dflash_fields(_plan(conv_kernel_size=2, conv_group_size=16),
                                        "lilicorr_conv", SHAPE)
    assert (conv[arch + "conv_kernel_size"], conv[arch + "conv_group_size"]) == (2, 16)
    assert modelopt_train.dotlist({"a.b": [1, 3], "c": 1e-4}) == ["a.b=[1, 3]", "c=0.0001"]


@pytest.mark.parametrize("variant, fields, named", [
    # the SmolLM2 recipe's five taps on three layers: their config takes one tap per layer
    ("lilicorr", {"target_layer_ids": [1, 8, 14, 20, 27]}, "target_layer_ids=[1, 8, 14, 20, 27]"),
    ("lilicorr", {"conv_kernel_size": 2, "conv_group_size": 16}, "conv_kernel_size=2"),
    ("lilicorr_conv", {}, "conv_kernel_size=None"),
    ("lilicorr", {"sample_from_anchor": True}, "sample_from_anchor=True"),
    ("lilicorr", {"variant": "domino"}, "variant=lilicorr"),
])
def test_a_plan_their_config_cannot_express_is_refused_naming_the_field(variant, fields, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        modelopt_train.dflash_fields(_plan(**fields), variant, SHAPE)


def test_their_export_is_rewritten_in_the_engines_names(tmp_path):
    names = ["lilicorr.feature_mlp.0.weight", "lilicorr.feature_mlp.1.bias",
             "lilicorr.feature_mlp.3.weight", "lilicorr.layers.1.mlp.0.weight",
             "lilicorr.layers.1.mlp.2.bias", "layers.0.mlp.gate_proj.weight", "fc.weight"]
    save_file({n: torch.zeros(1) for n in names}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_target_layers": 0, "dflash_config": {
        "lilicorr_enabled": True, "projector_type": "lilicorr", "lilicorr_logit_scale": 8.0}}))
    modelopt_train.engine_layout(tmp_path, 30)
    assert sorted(load_file(str(tmp_path / "model.safetensors"))) == sorted([
        "lilicorr.feature_norm.weight", "lilicorr.feature_mlp.up_proj.bias",
        "lilicorr.feature_mlp.down_proj.weight", "lilicorr.layers.1.mlp.up_proj.weight",
        "lilicorr.layers.1.mlp.down_proj.bias", "layers.0.mlp.gate_proj.weight", "fc.weight"])
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg == {"num_target_layers": 30, "dflash_config": {"lilicorr_logit_scale": 8.0}}


@pytest.fixture(scope="module")
def lilicorr_plan(tiny_target, tiny_target_dir, dist_capture, tmp_path_factory):  # noqa: F811
    """(overrides, plan) of the driver's LiLiCorr run on the tiny target, 3 steps, a 32-wide
    lattice; the plan is also written to ``plan.json`` in its own folder (returned third)."""
    return tiny_plan(tmp_path_factory.mktemp("plan"), "lilicorr", tiny_target, tiny_target_dir,
                     dist_capture, TINY_LATTICE, **KNOBS)


NEEDS_VENV = pytest.mark.skipif(not MODELOPT_PYTHON.exists(),
                                reason="needs .venv-modelopt: make modelopt-venv")


@NEEDS_VENV
@pytest.mark.slow
def test_their_lilicorr_trains_the_plan_and_our_reader_drafts_with_its_saves(
        tiny_target, tiny_target_dir, dist_capture, lilicorr_plan, tmp_path):  # noqa: F811
    from dflash_lab.eval.loading import load_drafter

    args, plan, plan_file = lilicorr_plan
    theirs = tmp_path / "theirs"
    run = run_bridge(MODELOPT_PYTHON, "benchmarks.modelopt_train", plan_file, tiny_target_dir,
                     theirs, "lilicorr")
    assert run["offline"] and run["trainable_params"] == plan["drafter"]["trainable_params"]
    assert run["argmax_agreement"]["fraction"] == 1.0  # float32 tiny target: no near-ties
    assert run["objective"]["dflash_lilicorr_w_ce"] == 0.25  # their recipe's, read at run time
    assert run["objective"]["dflash_lilicorr_w_pen"] == 0.25
    assert (run["optimizer"]["lr"], run["optimizer"]["lr_scheduler_type"]) == (6e-4, "cosine")
    forced = run["lilicorr_not_default"]
    assert forced["dflash.dflash_block_size"] == 8
    assert forced["dflash.dflash_architecture_config.lilicorr_hidden_size"] == 32
    log = [line.split("\t") for line in (theirs / "train_log.tsv").read_text().splitlines()]
    assert [int(r[0]) for r in log] == [1, 2, 3] and all(0 < float(r[1]) < 100 for r in log)
    assert sorted(p.name for p in theirs.glob("step-*")) == ["step-2", "step-3"]
    dc = load_drafter(theirs / "step-3").drafter.config
    assert (dc.variant, dc.block_size, dc.target_layer_ids, dc.lilicorr_hidden_size,
            dc.lilicorr_factor_dim, dc.lilicorr_logit_scale) == ("lilicorr", 8, [1, 3, 5], 32,
                                                                 16, 8.0)
    rows = both_sides_rows(args, tiny_target, tiny_target_dir, dist_capture, theirs, tmp_path)
    assert all(1.0 <= r["tau_mean"] <= 8 and r["num_blocks"] > 0 for r in rows)


@NEEDS_VENV
@pytest.mark.slow
def test_our_reader_scores_their_saved_lattice_as_their_head_does(
        tiny_target, tiny_target_dir, lilicorr_plan, tmp_path):
    """Their head's logit-scaled start and pair factors on seeded inputs, with every tensor
    perturbed off its init, equal our LiLiCorrLattice's on the saved step (the renamed
    tensors and the fused anchor row included)."""
    from dflash_lab.eval.loading import load_drafter

    in_peer_venv(MODELOPT_PYTHON, "-m", "tests.tools.modelopt_scores", str(lilicorr_plan[2]),
                 str(tiny_target_dir), str(tmp_path))
    x = load_file(str(tmp_path / "scores.safetensors"))
    drafter = load_drafter(tmp_path / "step-0").drafter.float()
    with torch.no_grad():
        anchor = drafter.fuse(x["taps"][None, None])[:, 0]
        scores = drafter.lilicorr(tiny_target.pieces().embed_tokens(x["ids"])[None],
                                  x["lp"][None], x["pass"][None], anchor, torch.ones(1))[0]
    assert scores.abs().max() > 0.5  # not a collapsed lattice
    torch.testing.assert_close(scores[0], x["start"][None].expand_as(scores[0]),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores[1:], x["pair"], atol=1e-5, rtol=1e-5)


def test_curves_name_modelopts_saves_modelopt(tmp_path):
    """Their step-N saves are side ``modelopt`` in the curves TSV (the driver passes
    ``--theirs-side``), speculators' stay ``speculators``; neither is an --other side."""
    for step in (2, 3):
        (tmp_path / "theirs" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "theirs" / f"step-{step}" / "config.json").write_text("{}")
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "step3.ckpt").write_text("")
    found = [(s, n) for s, n, _ in checkpoints(tmp_path / "ours", tmp_path / "theirs",
                                               theirs_side="modelopt")]
    assert found == [("modelopt", 2), ("modelopt", 3), ("ours", 3)]
    with pytest.raises(ValueError, match="modelopt"):
        parse_others(["modelopt=DIR"])
