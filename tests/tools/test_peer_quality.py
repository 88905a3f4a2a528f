"""Issue 20's side-by-side machinery (benchmarks/peer_quality.py, benchmarks/speculators_train.py):
the plan holds exactly the batches a real Lightning loop serves our module, step by step across
epochs; the packed batches are speculators' collator layout; the curve table pairs the sides by
step; the one-hot verifier head makes speculators' CE label the stored argmax. DFlash 2
(``VARIANT=dflash2``): the script's overrides compose our DFlash 2 drafter and plan the same
batches; speculators' dflash2 trainer (its own venv) trains a tiny plan, and our importer reads
its saves into DFlash 2 drafters whose held-out curve rows are computed beside ours."""

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

SPEC_PYTHON = REPO_ROOT / ".venv-speculators" / "bin" / "python"
SCRIPT = REPO_ROOT / "scripts" / "compare_speculators.sh"


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
    with pytest.raises(ValueError, match="VARIANT=dflash2"):
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
def script_overrides(variant: str, tmp_path) -> list[str]:
    """Our side's dflash-train overrides as scripts/compare_speculators.sh composes them."""
    done = subprocess.run([str(SCRIPT), "args"], capture_output=True, text=True, check=True,
                          env={**os.environ, "VARIANT": variant, "OUT": str(tmp_path / "cmp")})
    return done.stdout.split()


def on_tiny(overrides: list[str], target_dir, capture, mask_id: int, steps: int) -> list[str]:
    """The script's overrides pointed at the tiny target and a tiny capture, ``steps`` steps."""
    replaced = {"data.path", "trainer.max_steps"}
    kept = [o for o in overrides if o.split("=", 1)[0] not in replaced]
    return kept + [f"data.path={capture}", f"trainer.max_steps={steps}",
                   f"target.name_or_path={target_dir}", "drafter.target_layer_ids=[1,3,5]",
                   f"drafter.mask_token_id={mask_id}", "data.batch_size=2", "data.num_workers=0",
                   "data.val_fraction=0.2", "module.num_anchors=4"]


@pytest.fixture(scope="module")
def tiny_capture(tiny_target, tmp_path_factory):
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.data.demo_corpus import demo_conversations

    out = tmp_path_factory.mktemp("capture")
    rows = [{"messages": c} for c in demo_conversations(10, seed=5)]
    settings = CaptureSettings(out_dir=str(out), target_layer_ids=[1, 3, 5], shard_size=4,
                               max_length=64)
    assert run_capture(tiny_target, rows, settings, {"path": "demo"}, progress=False)
    return out


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
    assert drafter.config.is_dflash2
    released = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                "selector_top_k": 16}  # conf/drafter/dflash2.yaml; speculators' defaults too
    assert {k: getattr(drafter.config, k) for k in released} == released
    assert plan["drafter"] == {**plan["drafter"], "variant": "dflash2", **released}
    one = build_plan(on_tiny(script_overrides("dflash1", tmp_path), tiny_target_dir,
                             tiny_capture, tiny_target.token_id("<|mask|>"), 3))
    assert one["drafter"]["variant"] == "dflash1" and "selector_rank" not in one["drafter"]
    assert plan["steps"] == one["steps"]  # same batches and lrs as the DFlash 1 run
    assert plan["drafter"]["trainable_params"] > one["drafter"]["trainable_params"]


@pytest.mark.skipif(not SPEC_PYTHON.exists(),
                    reason="needs .venv-speculators (make speculators-venv): speculators 0.9.0")
@pytest.mark.slow
def test_their_dflash2_trains_the_plan_and_both_sides_curves_score_dflash2(
        tiny_target, tiny_target_dir, tiny_capture, dflash2_plan, tmp_path):
    from hydra.utils import instantiate

    from dflash_lab.eval.loading import load_drafter
    from tests.export_doubles import write_checkpoint

    args, plan = dflash2_plan
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    theirs = tmp_path / "theirs"
    done = subprocess.run(
        [str(SPEC_PYTHON), str(REPO_ROOT / "benchmarks" / "speculators_train.py"), "--plan",
         str(tmp_path / "plan.json"), "--target", str(tiny_target_dir), "--out", str(theirs),
         "--save-every", "2", "--variant", "dflash2"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads((theirs / "run.json").read_text())
    assert (run["variant"], run["loss_fn"], run["weighting"]) == (
        "dflash2", "kl_div", "fixed-exp-decay")
    log = [line.split("\t") for line in (theirs / "train_log.tsv").read_text().splitlines()]
    assert [int(r[0]) for r in log] == [1, 2, 3]
    assert all(0 < float(r[1]) < 100 for r in log)
    assert sorted(p.name for p in theirs.glob("step-*")) == ["step-2", "step-3"]
    for step in (2, 3):
        loaded = load_drafter(theirs / f"step-{step}")
        assert loaded.drafter.config.is_dflash2
        assert loaded.drafter.config.selector_rank == 256
    # ours: a DFlash 2 drafter of the composed config, saved as our checkpoints are
    ours = instantiate(compose_train(args).drafter, _partial_=True)(target=tiny_target)
    write_checkpoint(tmp_path / "ours" / "step3.ckpt", ours.config, ours.state_dict())
    rows = curve_rows(str(tiny_capture), str(tiny_target_dir), str(tmp_path / "ours"),
                      str(theirs), num_anchors=4)
    assert [(r["side"], r["step"]) for r in rows] == [
        ("ours", 3), ("speculators", 2), ("speculators", 3)]
    assert all(1.0 <= r["tau_mean"] <= 8 and r["num_blocks"] > 0 for r in rows)
