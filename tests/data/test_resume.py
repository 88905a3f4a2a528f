"""Mid-epoch resume of the training data: a run killed inside an epoch and resumed from its
last.ckpt serves exactly the batches the uninterrupted run serves from that point on, with and
without loader workers, from mid-epoch and from epoch-end checkpoints (real Lightning loops)."""

import lightning as L
import pytest
import torch

from dflash_lab.data.module import BlockDataModule, EpochShuffleSampler
from dflash_lab.train.callbacks import DFlashCheckpoint


class _Numbers(BlockDataModule):
    """25 one-token samples whose token is the sample number (20 train, 5 val)."""

    def load_samples(self):
        return [{"input_ids": torch.tensor([i]), "loss_mask": torch.tensor([1])}
                for i in range(25)]


class _Recorder(L.LightningModule):
    def __init__(self, early_loader: bool = False):
        super().__init__()
        self.early_loader = early_loader
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, list]] = []

    def training_step(self, batch, batch_idx):
        rows = batch["input_ids"].tolist() if "document_ids" in batch else (
            batch["input_ids"][:, 0].tolist())  # packed rows: every document of each row
        self.seen.append((self.current_epoch, rows))
        return (self.w * batch["input_ids"].float()).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/tau", 1.0)

    def configure_optimizers(self):
        if self.early_loader:  # as DFlashModule's scheduler: builds the train loader before
            assert self.trainer.estimated_stepping_batches > 0  # the loops are restored
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Killed(Exception):
    pass


class _Kill(L.Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step >= 7:
            raise _Killed  # the run dies here: nothing is saved on the way out


def _fit(ckpt_dir, workers, every, kill=False, resume=None, early_loader=False, pack=False):
    packing = {"pack": True, "max_tokens_per_row": 2} if pack else {}
    data = _Numbers(batch_size=4, val_fraction=0.2, max_val_samples=5, seed=1,
                    num_workers=workers, **packing)
    callbacks = [DFlashCheckpoint(dirpath=ckpt_dir, monitor=None, save_top_k=0, save_last=True,
                                  last_every_n_steps=every)]
    if kill:
        callbacks.append(_Kill())
    trainer = L.Trainer(max_epochs=3, callbacks=callbacks, logger=False, accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    module = _Recorder(early_loader)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=resume)
    except _Killed:
        assert kill
    return module.seen


@pytest.mark.parametrize("early_loader", [False, True], ids=["", "loader-before-restore"])
@pytest.mark.parametrize("workers", [0, 2], ids=["no-workers", "2-workers"])
@pytest.mark.parametrize(("every", "resumed_step"), [(3, 6), (5, 5)],
                         ids=["mid-epoch", "epoch-end"])
def test_resumed_run_serves_the_same_batches_as_the_uninterrupted_one(tmp_path, workers, every,
                                                                      resumed_step,
                                                                      early_loader):
    """``loader-before-restore``: configure_optimizers asks for estimated_stepping_batches (as
    DFlashModule does), so Lightning builds the train loader before it restores the loops."""
    want = _fit(tmp_path / "ref", workers, every)
    assert len(want) == 15  # 3 epochs x 5 batches
    killed = _fit(tmp_path / "kill", workers, every, kill=True, early_loader=early_loader)
    assert len(killed) == 7
    state = torch.load(tmp_path / "kill/last.ckpt", weights_only=False)
    assert state["global_step"] == resumed_step
    got = _fit(tmp_path / "kill", workers, every, resume=str(tmp_path / "kill/last.ckpt"),
               early_loader=early_loader)
    assert got == want[resumed_step:]


@pytest.mark.parametrize(("every", "resumed_step"), [(5, 5), (4, 4), (3, 6)],
                         ids=["mid-epoch", "mid-epoch-first-batch", "epoch-end"])
def test_a_packed_run_resumes_exactly_too(tmp_path, every, resumed_step):
    """data.pack: 20 one-token documents in 10 rows of 2, 3 batches of rows per epoch; the
    resumed run serves the uninterrupted run's remaining rows (same plan from the data seed)."""
    want = _fit(tmp_path / "ref", 0, every, pack=True)
    assert len(want) == 9 and all(len(row) == 2 for _, rows in want for row in rows)
    killed = _fit(tmp_path / "kill", 0, every, kill=True, pack=True)
    assert len(killed) == 7
    state = torch.load(tmp_path / "kill/last.ckpt", weights_only=False)
    assert state["global_step"] == resumed_step
    got = _fit(tmp_path / "kill", 0, every, resume=str(tmp_path / "kill/last.ckpt"), pack=True)
    assert got == want[resumed_step:]


def test_sampler_resume_continues_once_and_keeps_its_length():
    """The loader's length (Lightning's batch count for the epoch) stays that of a full epoch:
    the loop stops after the batches it has left, and the last one keeps its true size."""
    s = EpochShuffleSampler(10, seed=3)
    s.set_epoch(2)
    full = list(s)
    s.resume_at(2, 4)
    assert list(s) == full[4:] and len(s) == 10
    assert list(s) == full  # the resume point is used once


def test_ranks_share_the_padded_epoch_order_and_resume_their_own_streams():
    """3 ranks over 10 samples: torch's DistributedSampler layout (pad by repeating the head,
    rank r takes every 3rd from r); after 2 batches of 2 on every rank (12 samples consumed in
    all) each rank continues its own stream."""
    one = EpochShuffleSampler(10, seed=5, world=1)
    one.set_epoch(1)
    order = list(one)
    padded = order + order[:2]
    ranks = [EpochShuffleSampler(10, seed=5, world=3, rank=r) for r in range(3)]
    for r, s in enumerate(ranks):
        s.set_epoch(1)
        assert len(s) == 4 and list(s) == padded[r::3]
        s.resume_at(1, samples_done=2 * 2 * 3)
        assert list(s) == padded[r::3][4:]


def test_checkpoint_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="last_every_n_steps=0"):
        DFlashCheckpoint(last_every_n_steps=0)
