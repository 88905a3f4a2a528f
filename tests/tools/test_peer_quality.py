"""Issue 20's and 27's side-by-side machinery (benchmarks/peer_quality.py,
benchmarks/speculators_train.py, scripts/compare_speculators.py): the plan holds exactly the
batches a real Lightning loop serves our module, step by step across epochs; the packed batches
are speculators' collator layout; the curve table pairs the sides by step; the one-hot verifier
head makes speculators' CE label the stored argmax. DFlash 2 (``variant=dflash2``): the driver's
overrides compose our DFlash 2 drafter and plan the same batches; speculators' dflash2 trainer
(its own venv) trains a tiny plan, and our importer reads its saves into DFlash 2 drafters whose
held-out curve rows are computed beside ours. Issue 27: on a capture with
``capture.distribution=[last_hidden]`` their verifier head gives the target's real logits, the
same their own data path gives (their norm on the pre-norm state), and their kl_div on them is
the hand-computed KL, not the CE; seeds get their own directories and keep the plan's batches;
the summary aggregates arms over seeds; a bad knob exits 2 naming it."""

import json
import os
import subprocess

import lightning as L
import pytest
import torch

from benchmarks import speculators_train
from benchmarks.peer_quality import (
    build_plan,
    checkpoints,
    compose_train,
    curve_rows,
    curve_table,
    schedule_lrs,
    step_batches,
)
from dflash_lab.data.module import BlockDataModule
from dflash_lab.paths import REPO_ROOT
from tests.tools.compare_driver import driver_lines, driver_paths, run_driver

SPEC_PYTHON = REPO_ROOT / ".venv-speculators" / "bin" / "python"


class _Numbers(BlockDataModule):
    """23 one-token samples whose token is the sample number (a short last batch)."""

    def load_samples(self):
        return [{"input_ids": torch.tensor([i]), "loss_mask": torch.tensor([1])}
                for i in range(23)]


class _Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"][:, 0].tolist())
        return (self.w * batch["input_ids"].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _data():
    return _Numbers(batch_size=4, val_fraction=0.2, max_val_samples=5, seed=3)


def test_plan_batches_are_the_batches_lightning_trains_on_across_epochs():
    steps = 13  # 18 train samples -> 5 batches per epoch (the last of 2): 2 epochs and a bit
    trainer = L.Trainer(max_steps=steps, max_epochs=100, logger=False, accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0)
    module = _Recorder()
    trainer.fit(module, datamodule=_data())
    data = _data()
    data.setup("fit")
    planned = step_batches(data, steps)
    assert module.seen == planned  # sample number == dataset index here
    assert [len(b) for b in planned[:5]] == [4, 4, 4, 4, 2]
    assert planned[:5] != planned[5:10]  # a new order every epoch


def test_schedule_lrs_follow_the_configured_warmup_cosine():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"module": {
        "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3},
        "scheduler": {"_target_": "dflash_lab.train.schedule.warmup_cosine", "_partial_": True,
                      "warmup_ratio": 0.2}}})
    lrs = schedule_lrs(cfg, 10)
    assert lrs[:2] == [5e-4, 1e-3]  # 2 warmup steps
    assert lrs[2] == 1e-3 and all(a > b for a, b in zip(lrs[2:], lrs[3:]))


def test_pack_is_speculators_collator_layout():
    samples = [{"input_ids": torch.tensor([5, 6, 7], dtype=torch.int32),
                "loss_mask": torch.tensor([0, 1, 1], dtype=torch.uint8),
                "target_argmax": torch.tensor([6, 7, 9], dtype=torch.int32),
                "hidden": torch.ones(3, 4, dtype=torch.bfloat16)},
               {"input_ids": torch.tensor([8, 9], dtype=torch.int32),
                "loss_mask": torch.tensor([1, 1], dtype=torch.uint8),
                "target_argmax": torch.tensor([9, 2], dtype=torch.int32),
                "hidden": torch.zeros(2, 4, dtype=torch.bfloat16)}]
    b = speculators_train.pack(samples)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert b["hidden_states"].shape == (1, 5, 4) and b["hidden_states"].dtype == torch.float32
    head = speculators_train.OneHotVerifierHead(10)
    logits = head(b["verifier_last_hidden_states"])
    assert logits.shape == (1, 5, 10)
    assert logits.argmax(-1).tolist() == [[6, 7, 9, 9, 2]]
    # a point mass under softmax: their kl_div (DFlash 2's default) is then the CE on the id
    assert torch.equal(logits.softmax(-1), torch.nn.functional.one_hot(
        torch.tensor([[6, 7, 9, 9, 2]]), 10).float())
    draft = torch.randn(1, 5, 10)
    kl = torch.nn.functional.kl_div(draft.log_softmax(-1), logits.softmax(-1),
                                    reduction="none").sum(-1)
    ce = torch.nn.functional.cross_entropy(draft[0], torch.tensor([6, 7, 9, 9, 2]),
                                           reduction="none")
    torch.testing.assert_close(kl[0], ce)


def test_their_loss_is_their_configs_default_per_variant():
    assert speculators_train.their_loss("dflash1", None) == ("ce", "dpace")
    assert speculators_train.their_loss("dflash1", "fixed-exp-decay") == ("ce", "fixed-exp-decay")
    assert speculators_train.their_loss("dflash2", None) == ("kl_div", "fixed-exp-decay")
    assert speculators_train.their_loss("dflash2", "dpace") == ("ce", "dpace")  # dpace needs ce
    with pytest.raises(ValueError, match="variant=dflash2"):
        speculators_train.dflash2_fields({"drafter": {"variant": "dflash1"}})


def test_curve_table_pairs_sides_by_step_and_checkpoints_sort(tmp_path):
    rows = [{"side": "ours", "step": 10, "tau_mean": 1.2}, {"side": "ours", "step": 20,
            "tau_mean": 1.3}, {"side": "speculators", "step": 20, "tau_mean": 1.1}]
    assert curve_table(rows) == [(10, 1.2, None), (20, 1.3, 1.1)]
    (tmp_path / "ours").mkdir()
    for n in (100, 25):
        (tmp_path / "ours" / f"step{n}.ckpt").write_bytes(b"")
        (tmp_path / "theirs" / f"step-{n}").mkdir(parents=True)
        (tmp_path / "theirs" / f"step-{n}" / "config.json").write_text("{}")
    (tmp_path / "theirs" / ".step-50.tmp").mkdir()  # an unfinished save is not listed
    found = [(s, n) for s, n, _ in checkpoints(tmp_path / "ours", tmp_path / "theirs")]
    assert found == [("ours", 25), ("ours", 100), ("speculators", 25), ("speculators", 100)]


# ------------------------------------------------------------------------------ DFlash 2
def script_overrides(variant: str, tmp_path, stage: str = "args", **knobs) -> list[str]:
    """Our side's dflash-train overrides as scripts/compare_speculators.py composes them
    (``stage`` args: the CE arm; args_loss: the distribution-loss arm), one per line."""
    return driver_lines(tmp_path / "cmp", stage, variant=variant, **knobs)


def on_tiny(overrides: list[str], target_dir, capture, mask_id: int, steps: int) -> list[str]:
    """The script's overrides pointed at the tiny target and a tiny capture, ``steps`` steps."""
    replaced = {"data.path", "trainer.max_steps"}
    kept = [o for o in overrides if o.split("=", 1)[0] not in replaced]
    return kept + [f"data.path={capture}", f"trainer.max_steps={steps}",
                   f"target.name_or_path={target_dir}", "drafter.target_layer_ids=[1,3,5]",
                   f"drafter.mask_token_id={mask_id}", "data.batch_size=2", "data.num_workers=0",
                   "data.val_fraction=0.2", "module.num_anchors=4"]


def tiny_plan(tmp, variant: str, target, target_dir, capture, extra: tuple[str, ...] = (),
              **knobs) -> tuple[list[str], dict, object]:
    """(overrides, plan, plan.json) of the driver's ``variant`` run on the tiny target, 3 steps,
    ``extra`` overrides appended; the plan is written to ``plan.json`` in ``tmp``."""
    args = on_tiny(driver_lines(tmp / "cmp", "args", variant=variant, **knobs), target_dir,
                   capture, target.token_id("<|mask|>"), 3) + list(extra)
    plan = build_plan(args)
    (tmp / "plan.json").write_text(json.dumps(plan))
    return args, plan, tmp / "plan.json"


@pytest.fixture(scope="module")
def tiny_capture(tiny_target, tmp_path_factory):
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.targets.demo_corpus import demo_conversations

    out = tmp_path_factory.mktemp("capture")
    rows = [{"messages": c} for c in demo_conversations(10, seed=5)]
    settings = CaptureSettings(out_dir=str(out), target_layer_ids=[1, 3, 5], shard_size=4,
                               max_length=64)
    assert run_capture(tiny_target, rows, settings, {"path": "demo"}, progress=False)
    return out


def on_the_dflash1_batches(plan: dict, tmp_path, target, target_dir, capture) -> dict:
    """The driver's DFlash 1 plan on the tiny target (3 steps), after asserting that ``plan``
    (another variant's, same knobs) has its batches and lrs step by step and more trainable
    parameters (the variant's own layers or heads)."""
    one = build_plan(on_tiny(script_overrides("dflash1", tmp_path), target_dir, capture,
                             target.token_id("<|mask|>"), 3))
    assert plan["steps"] == one["steps"]  # same batches and lrs as the DFlash 1 run
    assert plan["drafter"]["trainable_params"] > one["drafter"]["trainable_params"]
    return one


def train_theirs(plan: dict, target_dir, tmp_path, variant: str, *extra: str) -> tuple:
    """(out dir, its run.json) of speculators' trainer (benchmarks/speculators_train.py in
    .venv-speculators) on ``plan`` for ``--variant VARIANT``, a save every 2 steps, offline,
    one thread; ``extra``: more of its options. It must exit 0."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    theirs = tmp_path / "theirs"
    done = subprocess.run(
        [str(SPEC_PYTHON), str(REPO_ROOT / "benchmarks" / "speculators_train.py"), "--plan",
         str(tmp_path / "plan.json"), "--target", str(target_dir), "--out", str(theirs),
         "--save-every", "2", "--variant", variant, *extra],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return theirs, json.loads((theirs / "run.json").read_text())


def both_sides_rows(args, target, target_dir, capture, theirs, tmp_path) -> list[dict]:
    """The curve rows of our drafter composed from ``args`` (untrained, saved as our step-3
    checkpoint) beside their saves in ``theirs`` (steps 2 and 3), paired in that order."""
    from hydra.utils import instantiate

    from tests.export_doubles import write_checkpoint

    ours = instantiate(compose_train(args).drafter, _partial_=True)(target=target)
    write_checkpoint(tmp_path / "ours" / "step3.ckpt", ours.config, ours.state_dict())
    rows = curve_rows(str(capture), str(target_dir), str(tmp_path / "ours"), str(theirs),
                      num_anchors=4)
    assert [(r["side"], r["step"]) for r in rows] == [
        ("ours", 3), ("speculators", 2), ("speculators", 3)]
    return rows


@pytest.fixture(scope="module")
def dflash2_plan(tiny_target, tiny_target_dir, tiny_capture, tmp_path_factory):
    """(overrides, plan) of the script's DFlash 2 run on the tiny target, 3 steps."""
    tmp = tmp_path_factory.mktemp("plan")
    args = on_tiny(script_overrides("dflash2", tmp), tiny_target_dir, tiny_capture,
                   tiny_target.token_id("<|mask|>"), 3)
    return args, build_plan(args)


def test_dflash2_overrides_compose_our_dflash2_drafter_on_the_same_batches(
        tiny_target, tiny_target_dir, tiny_capture, dflash2_plan, tmp_path):
    from hydra.utils import instantiate

    args, plan = dflash2_plan
    assert "drafter=dflash2" in args
    cfg = compose_train(args)
    assert cfg.module.selector.alpha == 1.0 and cfg.module.selector.missing_gold == "exclude"
    drafter = instantiate(cfg.drafter, _partial_=True)(target=tiny_target)
    assert drafter.config.variant == "dflash2"
    released = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                "selector_top_k": 16}  # conf/drafter/dflash2.yaml; speculators' defaults too
    assert {k: getattr(drafter.config, k) for k in released} == released
    assert plan["drafter"] == {**plan["drafter"], "variant": "dflash2", **released}
    one = on_the_dflash1_batches(plan, tmp_path, tiny_target, tiny_target_dir, tiny_capture)
    assert one["drafter"]["variant"] == "dflash1" and "selector_rank" not in one["drafter"]


@pytest.mark.skipif(not SPEC_PYTHON.exists(),
                    reason="needs .venv-speculators (make speculators-venv): speculators 0.9.0")
@pytest.mark.slow
def test_their_dflash2_trains_the_plan_and_both_sides_curves_score_dflash2(
        tiny_target, tiny_target_dir, tiny_capture, dflash2_plan, tmp_path):
    from dflash_lab.eval.loading import load_drafter

    args, plan = dflash2_plan
    theirs, run = train_theirs(plan, tiny_target_dir, tmp_path, "dflash2", "--optimizer", "plan")
    assert (run["variant"], run["loss_fn"], run["weighting"]) == (
        "dflash2", "kl_div", "fixed-exp-decay")
    log = [line.split("\t") for line in (theirs / "train_log.tsv").read_text().splitlines()]
    assert [int(r[0]) for r in log] == [1, 2, 3]
    assert all(0 < float(r[1]) < 100 for r in log)
    # --optimizer plan: our AdamW at the plan's lr of every step
    assert [float(r[2]) for r in log] == [float(f"{e['lr']:.3e}") for e in plan["steps"]]
    assert run["optimizer"]["name"] == "plan"
    assert sorted(p.name for p in theirs.glob("step-*")) == ["step-2", "step-3"]
    for step in (2, 3):
        loaded = load_drafter(theirs / f"step-{step}")
        assert loaded.drafter.config.variant == "dflash2"
        assert loaded.drafter.config.selector_rank == 256
    # ours: a DFlash 2 drafter of the composed config, saved as our checkpoints are
    rows = both_sides_rows(args, tiny_target, tiny_target_dir, tiny_capture, theirs, tmp_path)
    assert all(1.0 <= r["tau_mean"] <= 8 and r["num_blocks"] > 0 for r in rows)


# ------------------------------------------------- issue 27: real logits, seeds, the summary
def script_paths(tmp_path, **knobs) -> dict[str, str]:
    """The driver's ``paths`` with OUT in tmp_path (``out=None``: OUT's default)."""
    out = knobs.pop("out", tmp_path / "cmp")
    return driver_paths(out, **knobs)


def test_muon_by_default_names_its_runs_and_adamw_keeps_the_earlier_names(tmp_path):
    out = str(tmp_path / "cmp")
    muon = script_paths(tmp_path, distribution="last_hidden", steps="160")
    assert muon["run.0"] == "outputs/runs/compare_speculators_dist_muon_ours_s160"
    assert muon["theirs.0"] == f"{out}/theirs_dpace"  # OUT itself is named _muon by default
    assert script_paths(tmp_path, out=None)["out"] == "outputs/compare_speculators_muon_s200"
    adamw = script_paths(tmp_path, distribution="last_hidden", steps="160", optimizer="adamw")
    assert adamw["run.0"] == "outputs/runs/compare_speculators_dist_ours_s160"


def test_seed_0_keeps_todays_names_and_every_seed_gets_its_own(tmp_path):
    out = str(tmp_path / "cmp")
    one = script_paths(tmp_path, optimizer="adamw")  # issue 20's single-seed names
    assert one["capture"] == "outputs/capture/smollm2_sharegpt_n320"
    assert one["run.0"] == "outputs/runs/compare_speculators_ours_s200"
    assert (one["theirs.0"], one["curves.0"]) == (f"{out}/theirs_dpace", f"{out}/curves_dpace.tsv")
    assert (one["eval_ours.0"], one["eval_theirs.0"]) == (f"{out}/eval_ours",
                                                          f"{out}/eval_theirs_dpace")
    assert one["stage_train_ours.0"] == "train_ours" and "run_loss.0" not in one
    got = script_paths(tmp_path, seeds="[0,1,2]", distribution="last_hidden", optimizer="adamw")
    assert got["capture"] == "outputs/capture/smollm2_sharegpt_n320_dist"  # never mixed
    assert got["heldout"] == "outputs/capture/smollm2_sharegpt_heldout_n32_dist"
    assert got["run_loss.0"] == "outputs/runs/compare_speculators_dist_ours_loss-kl1.0_s200"
    per_seed = [k.rsplit(".", 1)[0] for k in got if k.endswith(".0")]
    assert {"run", "run_loss", "theirs", "curves", "eval_ours", "eval_ours_T1", "eval_loss",
            "eval_loss_T1", "eval_theirs", "eval_theirs_T1", "stage_train_ours",
            "stage_train_ours_loss", "stage_train_theirs"} <= set(per_seed)
    for key in per_seed:  # every directory and stage mark differs from seed to seed
        values = [got[f"{key}.{s}"] for s in (0, 1, 2)]
        assert len(set(values)) == 3, (key, values)
    assert got["run.2"] == "outputs/runs/compare_speculators_dist_ours_s200_seed2"
    assert got["stage_train_theirs.1"] == "train_theirs_dpace_seed1"
    assert got["eval_theirs_T1.1"] == f"{out}/eval_theirs_dpace_seed1_T1"
    two = script_paths(tmp_path, seeds="[3]", variant="dflash2", distribution="last_hidden",
                       our_loss="{ce: 0.1, tv: 0.9}", optimizer="adamw")
    assert two["run_loss.3"] == (
        "outputs/runs/compare_speculators_dist_ours_loss-ce0.1_tv0.9_dflash2_s200_seed3")


@pytest.mark.parametrize("knobs,named", [
    ({"seeds": "[0,one]"}, "seeds=[0, 'one']"), ({"seeds": "[1,1]"}, "seeds=[1, 1]"),
    ({"optimizer": "sgd"}, "optimizer=sgd"),
    ({"seeds": "[]"}, "seeds=[]"),
    ({"distribution": "topk"}, "distribution=topk"),
    ({"our_loss": "{kl: 1.0}"}, "our_loss={kl: 1.0}"),  # an argmax-only capture cannot
    ({"distribution": "last_hidden", "our_loss": "{kl_div: 1.0}"}, "our_loss={kl_div: 1.0}"),
    ({"distribution": "last_hidden", "our_loss": "kl=1"}, "our_loss=kl=1"),
    ({"distribution": "last_hidden", "our_loss": "ce"}, "our_loss=ce"),
    ({"steps": "0"}, "steps=0"), ({"policy": "maybe"}, "policy=maybe"),
    ({"variant": "dflash3"}, "variant=dflash3"), ({"arms": "[ours,mine]"}, "mine is not an arm"),
    ({"stpes": "160"}, "stpes=160: not a knob")])
def test_a_bad_knob_exits_2_naming_it_before_any_work(tmp_path, knobs, named):
    done = run_driver(tmp_path / "cmp", "capture", **knobs)
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stdout
    assert not (tmp_path / "cmp").exists()


def test_an_unknown_stage_is_refused_naming_it_and_the_stages(tmp_path):
    done = run_driver(tmp_path / "cmp", "capture", "trian_ours")
    assert done.returncode == 2
    assert "unknown stage trian_ours" in done.stdout and "train_ours_loss" in done.stdout
    assert not (tmp_path / "cmp").exists()


def test_a_failed_stage_is_not_marked_and_a_done_one_is_skipped(tmp_path):
    """Resumability: a stage whose command fails leaves no done mark (a rerun redoes it) and
    its log; a stage with a done mark is skipped, saying so."""
    out = tmp_path / "cmp"
    done = run_driver(out, "train_theirs", spec_py=str(tmp_path / "no_python"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "done already" not in done.stdout and "no_python missing" in done.stdout
    assert not (out / "done" / "train_theirs_dpace").exists()
    assert "no_python missing" in (out / "logs" / "train_theirs_dpace.log").read_text()
    (out / "done").mkdir(exist_ok=True)
    (out / "done" / "train_theirs_dpace").write_text("x\n")
    (out / "done" / "plan").write_text("x\n")
    again = run_driver(out, "plan", "train_theirs", spec_py=str(tmp_path / "no_python"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "== plan: done already" in again.stdout
    assert "== train_theirs_dpace: done already" in again.stdout


def test_loss_names_are_the_trainers(tmp_path):
    """The driver's copy of the loss names (no torch import for a knob check) is the trainer's."""
    from dflash_lab.train.distill import LOSS_NAMES
    from scripts.compare_speculators import LOSS_NAMES as DRIVER_NAMES

    assert tuple(DRIVER_NAMES) == tuple(LOSS_NAMES)


def test_pack_gives_their_verifier_the_stored_last_hidden_state_in_real_mode(tmp_path):
    h = torch.randn(5, 4).bfloat16()
    samples = [{"input_ids": torch.arange(3), "loss_mask": torch.ones(3, dtype=torch.uint8),
                "target_argmax": torch.arange(3), "hidden": torch.zeros(3, 8),
                "target_last_hidden": h[:3]},
               {"input_ids": torch.arange(2), "loss_mask": torch.ones(2, dtype=torch.uint8),
                "target_argmax": torch.arange(2), "hidden": torch.zeros(2, 8),
                "target_last_hidden": h[3:]}]
    b = speculators_train.pack(samples)
    assert b["verifier_last_hidden_states"].dtype == torch.float32
    assert torch.equal(b["verifier_last_hidden_states"], h.float()[None])


def _manifest(root, distribution=None):
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(
        {"format_version": 1, **({"distribution": distribution} if distribution else {})}))
    return root


def test_verifier_mode_is_chosen_from_the_manifest_and_said(tmp_path, capsys):
    real = _manifest(tmp_path / "dist", {"last_hidden": True, "topk": 0})
    old = _manifest(tmp_path / "old")
    topk = _manifest(tmp_path / "topk", {"last_hidden": False, "topk": 8})
    assert speculators_train.verifier_mode(real) == "real"
    assert "verifier logits: real" in capsys.readouterr().out
    for root in (old, topk):  # top-k alone is not the distribution their head computes
        assert speculators_train.verifier_mode(root) == "point-mass"
        said = capsys.readouterr().out
        assert "point mass" in said and "capture.distribution=[last_hidden]" in said
    assert speculators_train.verifier_mode(real, "point-mass") == "point-mass"
    with pytest.raises(ValueError, match=r"capture.distribution=\[last_hidden\]"):
        speculators_train.verifier_mode(old, "real")
    with pytest.raises(FileNotFoundError, match="manifest.json missing"):
        speculators_train.verifier_mode(tmp_path / "none")


def test_argmax_agreement_counts_loss_positions_and_refuses_a_foreign_head():
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 10, bias=False)
    h = torch.randn(6, 4)
    argmax = head(h).argmax(-1)
    mask = torch.tensor([0, 1, 1, 1, 1, 0])
    found = speculators_train.argmax_agreement(head, h, argmax, mask)
    assert found == {"agree": 4, "positions": 4, "fraction": 1.0}
    wrong = speculators_train.argmax_agreement(head, h, (argmax + 1) % 10, mask)
    assert wrong["fraction"] == 0.0
    with pytest.raises(ValueError, match="do not belong together"):
        speculators_train.check_agreement(wrong, "CAP", "TARGET")
    speculators_train.check_agreement(found, "CAP", "TARGET")


def test_read_tsv_keeps_rows_written_before_tau_t1(tmp_path):
    from benchmarks.peer_quality import read_tsv, write_tsv

    old = tmp_path / "old.tsv"
    old.write_text("side\tstep\ttau_mean\tacc_pos1\tnum_blocks\tpath\n"
                   "ours\t20\t1.1\t0.1\t30\tx\n")
    rows = read_tsv(old)
    assert rows[0]["tau_T1"] is None
    rows.append({"side": "speculators", "step": 20, "tau_mean": 1.2, "acc_pos1": 0.2,
                 "num_blocks": 30, "path": "y", "tau_T1": 1.05})
    write_tsv(old, rows)
    assert [r["tau_T1"] for r in read_tsv(old)] == [None, 1.05]


def _fake_arm(tmp_path, seed: int, sides: dict[str, tuple[float, float | None, float, float]]):
    """A curves TSV (steps 2 and 4) and T=0 / T=1 reports per side at ``seed``: values
    (held-out T0, held-out T1, decoding T0, decoding T1)."""
    from benchmarks.peer_quality import SeedRun, write_tsv

    curves = tmp_path / f"curves_seed{seed}.tsv"
    rows, runs = [], []
    for side, (h0, h1, d0, d1) in sides.items():
        for step, tau in ((2, h0 - 0.05), (4, h0)):
            rows.append({"side": side, "step": step, "tau_mean": tau, "acc_pos1": 0.1,
                         "num_blocks": 9, "path": "p", "tau_T1": h1 if step == 4 else None})
        e0, e1 = tmp_path / f"{side}_{seed}_t0.json", tmp_path / f"{side}_{seed}_t1.json"
        e0.write_text(json.dumps({"tau_mean": d0, "lossless": True}))
        e1.write_text(json.dumps({"tau_mean": d1, "lossless": None,
                                  "settings": {"temperature": 1.0, "sampling": "rejection"}}))
        runs.append(SeedRun(side, side, seed, curves, e0, e1))
    write_tsv(curves, rows)
    return runs


def test_summary_gives_mean_and_spread_over_seeds_and_says_when_arms_are_not_apart(tmp_path):
    from benchmarks.peer_quality import summarize

    runs = []
    for seed, (a, b) in enumerate([(1.30, 1.10), (1.34, 1.12), (1.32, 1.30)]):
        runs += _fake_arm(tmp_path, seed, {"ours": (a, a - 0.1, a, a - 0.2),
                                           "speculators": (b, b - 0.1, 1.0 + seed / 100, 1.0)})
    text, numbers = summarize(runs, 4, "dflash1", heldout_holds=True)
    ours = numbers["stats"]["ours"]["heldout_T0"]
    assert ours["n"] == 3 and ours["min"] == 1.30 and ours["max"] == 1.34
    assert abs(ours["mean"] - 1.32) < 1e-9 and abs(ours["std"] - 0.02) < 1e-9
    assert "1.320 ± 0.020 [1.300..1.340]" in text
    assert "| ours | 0 1 2 |" in text and "yes (3/3)" in text
    assert "within the seed spread" in text  # held-out: theirs' 1.30 at seed 2 overlaps
    assert "separated: the seed ranges do not overlap" in text  # decoding T=0: 1.32 vs ~1.01
    assert "| 2 | 1.270 ± 0.020 [1.250..1.290] |" in text  # the mean learning curve
    assert '"temperature": 1.0' in text and not numbers["missing"]


def test_summary_marks_t1_not_measured_and_names_missing_inputs(tmp_path):
    from benchmarks.peer_quality import SeedRun, summarize

    runs = _fake_arm(tmp_path, 0, {"ours": (1.2, None, 1.1, 1.0),
                                   "speculators": (1.1, None, 1.0, 1.0)})
    runs.append(SeedRun("ours", "ours", 1, tmp_path / "nope.tsv", tmp_path / "a.json",
                        tmp_path / "b.json"))
    text, numbers = summarize(runs, 4, "dflash1", heldout_holds=False)
    assert "n/a (needs a held-out capture with capture.distribution=[last_hidden]" in text
    assert "(1 of 2 seeds)" in text and "one seed: spread unknown" in text
    assert {str(tmp_path / n) for n in ("nope.tsv", "a.json", "b.json")} <= set(
        numbers["missing"])
    assert "Missing inputs" in text
    text2, _ = summarize(runs[:2], 4, "dflash2", heldout_holds=True)
    assert "n/a (DFlash 2 drafts from its selector" in text2


@pytest.mark.parametrize(("variant", "walk"), [
    ("dspark", "DSpark drafts from its Markov walk"), ("domino", "Domino drafts from its GRU walk"),
    ("lilicorr", "LiLiCorr drafts from its lattice walk"),
    ("lilicorr_conv", "LiLiCorr drafts from its lattice walk"),
    ("xpress", "XPress drafts from its Jacobi walk")])
def test_a_walk_heads_summary_says_why_t1_is_not_held_out(tmp_path, variant, walk):
    from benchmarks.peer_quality import main, t1_reason

    assert t1_reason(variant, heldout_holds=True).startswith(f"n/a ({walk}: features mode")
    # argparse takes the variant (a refused choice exits); the empty held-out capture fails next
    with pytest.raises(ValueError, match="manifest"):
        main(["summary", "--variant", variant, "--step", "1", "--heldout", str(tmp_path),
              "--run", "a", "ours", "0", "c", "e0", "e1", "--out", "o", "--plot", "p"])


@pytest.mark.parametrize(("fields", "declared"), [
    ({"variant": "domino", "gru_hidden_dim": 8, "emb_dim": 4},
     {"projector_type": "domino", "shift_label": False, "pure_draft_prefix_len": 1,
      "gru_hidden_dim": 8, "emb_dim": 4}),
    ({"variant": "lilicorr", "lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 16,
      "lilicorr_num_layers": 1, "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 2.0,
      "lilicorr_factor_dim": 8, "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 8.0,
      "conv_kernel_size": 2, "conv_group_size": 16}, None),
    ({"variant": "xpress", "xpress_rank": 8, "xpress_mlp_hidden": 16, "xpress_topc": 0},
     {"xpress_rank": 8, "xpress_mlp_hidden": 16, "xpress_topc": 0, "xpress_num_passes": 6,
      "xpress_block_size": 4})])
def test_the_plan_records_each_heads_declared_fields(fields, declared):
    from benchmarks.peer_quality import variant_fields
    from tests.doubles import tiny_drafter_config

    recorded = variant_fields(tiny_drafter_config(**fields))
    expected = {k: v for k, v in fields.items() if k != "variant"} if declared is None \
        else declared
    assert recorded == {"variant": fields["variant"], **expected, "sample_from_anchor": False}


@pytest.fixture(scope="module")
def dist_capture(tiny_target, tmp_path_factory):
    """The tiny target's capture with capture.distribution=[last_hidden] (what
    DISTRIBUTION=last_hidden captures)."""
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.targets.demo_corpus import demo_conversations

    out = tmp_path_factory.mktemp("dist_capture")
    rows = [{"messages": c} for c in demo_conversations(10, seed=5)]
    settings = CaptureSettings(out_dir=str(out), target_layer_ids=[1, 3, 5], shard_size=4,
                               max_length=64, distribution=("last_hidden",))
    assert run_capture(tiny_target, rows, settings, {"path": "demo"}, progress=False)
    return out


def test_seeds_and_the_loss_arm_keep_the_plans_batches(tiny_target, tiny_target_dir,
                                                       dist_capture, tmp_path):
    mask = tiny_target.token_id("<|mask|>")
    env = {"distribution": "last_hidden", "seeds": "[2]"}
    base = build_plan(on_tiny(script_overrides("dflash1", tmp_path, distribution="last_hidden"),
                              tiny_target_dir, dist_capture, mask, 3))
    ce2 = on_tiny(script_overrides("dflash1", tmp_path, **env), tiny_target_dir, dist_capture,
                  mask, 3)
    loss2 = on_tiny(script_overrides("dflash1", tmp_path, "args_loss", **env), tiny_target_dir,
                    dist_capture, mask, 3)
    for args in (ce2, loss2):
        cfg = compose_train(args)
        assert (cfg.seed, cfg.module.seed, cfg.data.seed) == (2, 2, 0)
        assert build_plan(args)["steps"] == base["steps"]
    assert dict(compose_train(loss2).module.loss) == {"kl": 1.0}
    assert compose_train(ce2).module.loss == "ce"


#: Run in .venv-speculators: argv = target, distribution capture, plan, argmax-only capture, out.
#: Prints one JSON line of findings (the test asserts on them).
_REAL_LOGITS_CHECK = r"""
import contextlib, io, json, sys
from pathlib import Path
import torch
from benchmarks import speculators_train as st  # run with the repository root as cwd
from speculators.losses import resolve_loss_config
from speculators.models.dflash.metrics import compute_metrics
from transformers import AutoModelForCausalLM

target, capture, plan_path, argmax_capture, out = sys.argv[1:6]
plan = json.loads(Path(plan_path).read_text())
res = {}
shards = st.Shards(capture, st.SAMPLE_KEYS + ("target_last_hidden",))
samples = [shards.sample(*r) for r in plan["steps"][0]["rows"]]
# 1. their data path (their norm on the last decoder layer's output) against ours
hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
pre = {}
hf.model.layers[-1].register_forward_hook(
    lambda m, i, o: pre.setdefault("x", o[0] if isinstance(o, tuple) else o))
with torch.no_grad():
    normed = hf.model(input_ids=samples[0]["input_ids"].long()[None]).last_hidden_state[0]
orig = st.their_model(target, plan, 0)
ours = st.build_model(target, plan, 0, logits="real")
with torch.no_grad():
    theirs_z = orig.verifier_lm_head(orig.verifier_norm(pre["x"][0]))
    ours_z = ours.verifier_lm_head(ours.verifier_norm(normed))
    stored_z = ours.verifier_lm_head(samples[0]["target_last_hidden"].float())
    double_z = orig.verifier_lm_head(orig.verifier_norm(normed))
res["head_is_the_targets"] = torch.equal(ours.verifier_lm_head.weight, hf.lm_head.weight)
res["their_path_vs_ours"] = (theirs_z - ours_z).abs().max().item()
res["stored_vs_ours"] = (stored_z - ours_z).abs().max().item()
res["norm_twice_vs_ours"] = (double_z - ours_z).abs().max().item()
res["logit_scale"] = ours_z.abs().max().item()
# 2. their losses on a real batch, against a hand computation
torch.manual_seed(0)
b = st.pack(samples)
with torch.no_grad():
    _, z, t, mask, idx = ours._backbone_forward(
        b["hidden_states"], b["input_ids"], b["loss_mask"], b["verifier_last_hidden_states"],
        b["document_ids"], b["position_ids"],
        max_anchors=plan["num_anchors_per_sequence"] * plan["batch_size"])
    n_tok = b["input_ids"].shape[1]
    by_hand = ours.verifier_lm_head(b["verifier_last_hidden_states"][0, (idx - 1) % n_tok])
    res["targets_are_lm_head_of_the_previous_state"] = torch.equal(t[0], by_hand)
    def theirs(name):
        return compute_metrics(z, t, mask, ours.block_size, gamma=plan["gamma"],
                               loss_config=resolve_loss_config(name, "eager"),
                               per_position_loss_weight="fixed-exp-decay")[0].item()
    p, logp, logq = t.softmax(-1), t.log_softmax(-1), z.log_softmax(-1)
    pos = torch.arange(z.shape[1]) % ours.block_size
    w = torch.exp(-(pos - 1).clamp(min=0) / plan["gamma"]) * (pos != 0)
    m = mask.float()
    def reduce(per_slot):
        return ((per_slot * m * w).sum() / (m.sum() + 1e-5)).item()
    res["kl_theirs"], res["ce_theirs"] = theirs("kl_div"), theirs("ce")
    res["kl_hand"] = reduce((p * (logp - logq)).sum(-1))
    res["ce_hand"] = reduce(-logq.gather(-1, t.argmax(-1, keepdim=True))[..., 0])
    res["entropy"] = reduce(-(p * logp).sum(-1))
# 3. their trainer in real mode: 2 steps at seed 3
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    st.main(["--plan", plan_path, "--target", target, "--out", out, "--save-every", "2",
             "--seed", "3"])
res["main_log"] = buf.getvalue()
# 4. an argmax-only capture: point mass, said so
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    res["argmax_mode"] = st.verifier_mode(argmax_capture)
res["argmax_log"] = buf.getvalue()
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def real_logits_run(tiny_target, tiny_target_dir, dist_capture, tiny_capture,
                    tmp_path_factory):
    """One .venv-speculators process running :data:`_REAL_LOGITS_CHECK` on the tiny target
    (about 15 s, most of it importing speculators): (findings, their output directory)."""
    if not SPEC_PYTHON.exists():
        pytest.skip("needs .venv-speculators (make speculators-venv): speculators 0.9.0")
    tmp = tmp_path_factory.mktemp("real_logits")
    args = on_tiny(script_overrides("dflash1", tmp, distribution="last_hidden"), tiny_target_dir,
                   dist_capture, tiny_target.token_id("<|mask|>"), 2)
    (tmp / "plan.json").write_text(json.dumps(build_plan(args)))
    done = subprocess.run(
        [str(SPEC_PYTHON), "-c", _REAL_LOGITS_CHECK, str(tiny_target_dir), str(dist_capture),
         str(tmp / "plan.json"), str(tiny_capture), str(tmp / "theirs")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), tmp / "theirs"


@pytest.mark.slow
def test_real_logits_are_what_their_own_data_path_gives(real_logits_run):
    found, _ = real_logits_run
    assert found["head_is_the_targets"]  # their loader's lm_head.weight of the target dir
    # their trainer on the pre-norm state == their head on our final-normed state (float32)
    assert found["their_path_vs_ours"] < 1e-4 * max(1.0, found["logit_scale"])
    # the stored state is the normed one, rounded to bfloat16 (measured: 0.008 of 11)
    assert found["stored_vs_ours"] < 0.01 * found["logit_scale"]
    # their norm once more is another computation (measured: 0.10, 12x the rounding)
    assert found["norm_twice_vs_ours"] > 1e-3 * found["logit_scale"]
    assert found["norm_twice_vs_ours"] > 100 * max(found["their_path_vs_ours"], 1e-6)


@pytest.mark.slow
def test_their_kl_div_sees_the_real_distribution_and_equals_the_hand_kl(real_logits_run):
    found, _ = real_logits_run
    assert found["targets_are_lm_head_of_the_previous_state"]
    assert abs(found["kl_theirs"] - found["kl_hand"]) < 1e-4 * max(1.0, found["kl_hand"])
    assert abs(found["ce_theirs"] - found["ce_hand"]) < 1e-4 * max(1.0, found["ce_hand"])
    assert found["entropy"] > 0.05  # a real distribution, not a point mass
    assert abs(found["kl_theirs"] - found["ce_theirs"]) > 0.05  # so KL is not the argmax CE


@pytest.mark.slow
def test_their_trainer_picks_real_logits_by_itself_and_records_it(real_logits_run):
    found, theirs = real_logits_run
    assert "verifier logits: real" in found["main_log"]
    run = json.loads((theirs / "run.json").read_text())
    assert (run["verifier_logits"], run["seed"], run["loss_fn"]) == ("real", 3, "ce")
    agree = run["argmax_agreement"]
    assert agree["positions"] > 0 and agree["fraction"] > 0.9
    assert (theirs / "step-2" / "config.json").is_file()
    assert found["argmax_mode"] == "point-mass" and "point mass" in found["argmax_log"]


@pytest.mark.slow
def test_their_side_runs_their_default_optimizer_and_schedule(real_logits_run):
    """--optimizer default (the default): their build_optimizers at their CLI's defaults, Muon
    on the 2-D weights and AdamW on the rest, both at lr 1e-3, and their linear schedule over
    the plan's 2 steps (warmup 2 // 100 = 0): lr 1e-3, then 5e-4."""
    _, theirs = real_logits_run
    opt = json.loads((theirs / "run.json").read_text())["optimizer"]
    assert opt["name"] == "default" and opt["optimizers"] == ["Muon", "AdamW"]
    assert (opt["optimizer"], opt["lr"], opt["muon_lr"]) == ("muon", 1e-3, 1e-3)
    assert (opt["muon_adjust_lr_fn"], opt["scheduler_type"]) == ("match_rms_adamw", "linear")
    assert (opt["warmup_steps"], opt["total_steps"]) == (0, 2)
    log = [line.split("\t") for line in (theirs / "train_log.tsv").read_text().splitlines()]
    assert [float(r[2]) for r in log] == [1e-3, 5e-4]
