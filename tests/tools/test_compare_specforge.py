"""The SpecForge arm of the comparison (issue 45: ``variant=domino``'s ``theirs`` arm is
SpecForge 0.2.0's own Domino trainer, benchmarks/specforge_train.py in .venv-specforge): the
driver names its files as every other peer's and refuses the knobs their trainer cannot follow;
the plan's fields map onto their draft config and TrainingConfig keys and a plan their config
cannot express is refused naming the field; their trainer (its own venv, slow) trains a tiny
plan on the capture's states and our reader loads and drafts with its saves."""


import pytest
import torch

from benchmarks import specforge_train
from benchmarks.peer_quality import checkpoints
from dflash_lab.paths import REPO_ROOT
from tests.tools.compare_driver import driver_paths, in_peer_venv, run_bridge, run_driver
from tests.tools.test_peer_quality import (  # noqa: F401 (tiny_capture: a fixture)
    both_sides_rows,
    tiny_capture,
    tiny_plan,
)

SPECFORGE_PYTHON = REPO_ROOT / ".venv-specforge" / "bin" / "python"
#: the SmolLM2 target's fields their draft layers take (outputs/smollm2_target/config.json)
TARGET = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
          "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 49152,
          "max_position_embeddings": 8192, "hidden_act": "silu", "num_hidden_layers": 30,
          "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


def test_domino_has_a_specforge_theirs_arm_named_as_every_peer(tmp_path):
    out = str(tmp_path / "cmp")
    got = driver_paths(tmp_path / "cmp", variant="domino", seeds="[0,2]")
    assert got["plan"] == f"{out}/plan_domino.json"
    assert got["theirs.0"] == f"{out}/theirs_domino_fixed-exp-decay"
    assert got["stage_train_theirs.2"] == "train_theirs_domino_fixed-exp-decay_seed2"
    assert got["eval_theirs_T1.2"] == f"{out}/eval_theirs_domino_fixed-exp-decay_seed2_T1"
    # our arm's names are what they were without a peer (arms=[ours], the archived runs)
    alone = driver_paths(tmp_path / "cmp", variant="domino", seeds="[0,2]", arms="[ours]")
    assert {k: v for k, v in got.items() if "theirs" not in k} == \
        {k: v for k, v in alone.items() if "theirs" not in k}
    assert alone["curves.0"] == f"{out}/curves_domino_fixed-exp-decay.tsv"


@pytest.mark.parametrize("knob, value", [("optimizer", "adamw"), ("their_weighting", "dpace")])
def test_a_knob_specforges_trainer_cannot_follow_is_refused_naming_it(tmp_path, knob, value):
    done = run_driver(tmp_path / "cmp", "capture", variant="domino", **{knob: value})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{knob}={value}" in done.stdout and "SpecForge" in done.stdout
    assert not (tmp_path / "cmp").exists()


def test_train_theirs_runs_specforge_py_and_names_its_make_target(tmp_path):
    done = run_driver(tmp_path / "cmp", "train_theirs", variant="domino",
                      specforge_py=str(tmp_path / "none" / "python"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "make specforge-venv" in done.stdout
    assert not (tmp_path / "cmp" / "done").exists()


def test_curves_name_specforges_saves_specforge(tmp_path):
    (tmp_path / "theirs" / "step-2").mkdir(parents=True)
    (tmp_path / "theirs" / "step-2" / "config.json").write_text("{}")
    (tmp_path / "ours").mkdir()
    found = [(s, n) for s, n, _ in checkpoints(tmp_path / "ours", tmp_path / "theirs",
                                               theirs_side="specforge")]
    assert found == [("specforge", 2)]


def _plan(**fields) -> dict:
    """The SmolLM2 Domino plan (plan_domino.json of compare_speculators_dist_muon_s160)."""
    d = {"variant": "domino", "num_hidden_layers": 3, "block_size": 8,
         "target_layer_ids": [1, 8, 14, 20, 27], "mask_token_id": 16, "hidden_size": 576,
         "vocab_size": 49152, "trainable_params": 30188416, "projector_type": "domino",
         "shift_label": False, "pure_draft_prefix_len": 1, "gru_hidden_dim": 1024,
         "emb_dim": 256, "sample_from_anchor": False}
    return {"num_anchors_per_sequence": 32, "gamma": 4.0, "batch_size": 4, "num_steps": 160,
            "drafter": {**d, **fields}}


def test_the_plan_fields_map_onto_their_draft_config_and_training_keys():
    got = specforge_train.draft_config_fields(_plan(), TARGET)
    assert got["dflash_config"] == {
        "projector_type": "domino", "target_layer_ids": [1, 8, 14, 20, 27], "mask_token_id": 16,
        "emb_dim": 256, "gru_hidden_dim": 1024, "pure_draft_prefix_len": 1, "shift_label": False}
    assert (got["num_hidden_layers"], got["layer_types"], got["block_size"],
            got["num_target_layers"]) == (3, ["full_attention"] * 3, 8, 30)
    assert {k: got[k] for k in specforge_train.SHAPE} == \
        {k: TARGET[k] for k in specforge_train.SHAPE}
    assert specforge_train.training_fields(_plan(), 2) == {
        "training.num_anchors": 32, "training.loss_decay_gamma": 4.0, "training.batch_size": 4,
        "training.total_steps": 160, "training.seed": 2, "training.attention_backend": "sdpa",
        "model.torch_dtype": "float32"}


@pytest.mark.parametrize("fields, named", [
    ({"variant": "dspark"}, "variant=domino"),
    ({"projector_type": "lilicorr"}, "projector_type='lilicorr'"),
    ({"sample_from_anchor": True}, "sample_from_anchor=True"),
    ({"draft_vocab_size": 8192}, "draft_vocab_size=8192"),
    ({"hidden_size": 64}, "hidden_size=64"),
    ({"block_size": 1}, "block_size=1"),
])
def test_a_plan_their_config_cannot_express_is_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        specforge_train.draft_config_fields(_plan(**fields), TARGET)


@pytest.fixture(scope="module")
def domino_plan(tiny_target, tiny_target_dir, tiny_capture, tmp_path_factory):  # noqa: F811
    """(overrides, plan, plan.json) of the driver's Domino run on the tiny target, 3 steps, a
    16-wide GRU and 8-wide correction."""
    return tiny_plan(tmp_path_factory.mktemp("plan"), "domino", tiny_target, tiny_target_dir,
                     tiny_capture, ("drafter.gru_hidden_dim=16", "drafter.emb_dim=8"))


NEEDS_VENV = pytest.mark.skipif(not SPECFORGE_PYTHON.exists(),
                                reason="needs .venv-specforge: make specforge-venv")


@NEEDS_VENV
@pytest.mark.slow
def test_their_domino_trains_the_plan_and_our_reader_drafts_with_its_saves(
        tiny_target, tiny_target_dir, tiny_capture, domino_plan, tmp_path):  # noqa: F811
    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.export.formats import format_at

    args, plan, plan_file = domino_plan
    theirs = tmp_path / "theirs"
    run = run_bridge(SPECFORGE_PYTHON, "benchmarks.specforge_train", plan_file, tiny_target_dir,
                     theirs, "domino")
    assert run["trainable_params"] == plan["drafter"]["trainable_params"]
    opt = run["optimizer"]  # their TrainingConfig and BF16Optimizer defaults, read at run time
    assert (opt["lr"], opt["weight_decay"], opt["lr_scheduler"], opt["max_grad_norm"]) == \
        (1e-4, 0.0, "cosine", 0.5)
    forced = run["domino_not_default"]
    assert forced["training.num_anchors"] == 4 and forced["training.attention_backend"] == "sdpa"
    assert forced["dflash_config.pure_draft_prefix_len"] == 1
    log = [line.split("\t") for line in (theirs / "train_log.tsv").read_text().splitlines()]
    assert [int(r[0]) for r in log] == [1, 2, 3] and all(0 < float(r[1]) < 100 for r in log)
    assert sorted(p.name for p in theirs.glob("step-*")) == ["step-2", "step-3"]
    assert format_at(theirs / "step-3").name == "z-lab"
    dc = load_drafter(theirs / "step-3").drafter.config
    assert (dc.variant, dc.block_size, dc.target_layer_ids, dc.gru_hidden_dim, dc.emb_dim,
            dc.pure_draft_prefix_len) == ("domino", 8, [1, 3, 5], 16, 8, 1)
    rows = both_sides_rows(args, tiny_target, tiny_target_dir, tiny_capture, theirs, tmp_path)
    assert all(1.0 <= r["tau_mean"] <= 8 and r["num_blocks"] > 0 for r in rows)


@NEEDS_VENV
@pytest.mark.slow
def test_our_domino_head_scores_their_saved_weights_as_their_head_does(
        tiny_target, tiny_target_dir, domino_plan, tmp_path):
    """Their teacher-forced final logits (base + GRU correction from slot 2 on) on seeded
    inputs, with the GRU and correction tensors perturbed off their init, equal our Domino
    head's (``correction_inputs`` over the same block tokens) on the saved step."""
    from safetensors.torch import load_file

    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.heads.domino import correction_inputs

    in_peer_venv(SPECFORGE_PYTHON, "-m", "tests.tools.specforge_scores", str(domino_plan[2]),
                 str(tiny_target_dir), str(tmp_path))
    x = load_file(str(tmp_path / "scores.safetensors"))
    drafter = load_drafter(tmp_path / "step-0").drafter.float()
    pieces = tiny_target.pieces()
    ids, hidden = x["ids"], x["hidden"][None, None]
    prev = torch.cat([ids[:1], ids[:-1]])  # the token before each slot (slot 1: the anchor)
    with torch.no_grad():
        c = correction_inputs(drafter, pieces.embed_tokens, hidden, prev[None, None])
        ours = pieces.lm_head(hidden) + drafter.embed_proj[2](c)
    assert (x["final"] - pieces.lm_head(hidden)[0, 0]).abs()[2:].max() > 0.1  # a live head
    torch.testing.assert_close(ours[0, 0], x["final"], atol=1e-5, rtol=1e-5)
