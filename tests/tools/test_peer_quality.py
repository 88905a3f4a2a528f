"""Issue 20's side-by-side machinery (benchmarks/peer_quality.py, benchmarks/speculators_train.py):
the plan holds exactly the batches a real Lightning loop serves our module, step by step across
epochs; the packed batches are speculators' collator layout; the curve table pairs the sides by
step; the one-hot verifier head makes speculators' CE label the stored argmax."""

import lightning as L
import torch

from benchmarks import speculators_train
from benchmarks.peer_quality import checkpoints, curve_table, schedule_lrs, step_batches
from dflash_lab.data.module import BlockDataModule


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
