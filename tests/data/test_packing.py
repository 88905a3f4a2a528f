"""Packed rows (data.pack): the first-fit plan, the refusals, and packed batches from a capture
equal to packed online batches whose features the target computes per document."""


import pytest
import torch

from dflash_lab.data.module import BlockDataModule, OfflineDataModule, OnlineDataModule
from dflash_lab.data.packing import PackedRows, first_fit, pack
from tests.data.test_module import capture_demo

LAYERS = [1, 3, 5]


def _naive_first_fit(lengths, order, capacity):
    rows, free = [], []
    for doc in order:
        for r, room in enumerate(free):
            if room >= lengths[doc]:
                rows[r].append(doc)
                free[r] -= lengths[doc]
                break
        else:
            rows.append([doc])
            free.append(capacity - lengths[doc])
    return rows


@pytest.mark.parametrize("num", [1, 2, 7, 300])
def test_first_fit_is_greedy_first_fit_and_places_every_document_once(num):
    g = torch.Generator().manual_seed(num)
    lengths = torch.randint(1, 40, (num,), generator=g).tolist()
    order = torch.randperm(num, generator=g).tolist()
    rows = first_fit(lengths, order, 40)
    assert rows == _naive_first_fit(lengths, order, 40)
    assert sorted(d for row in rows for d in row) == list(range(num))
    assert all(sum(lengths[d] for d in row) <= 40 for row in rows)


class _Docs(BlockDataModule):
    """30 documents of 1..8 tokens; token values = document number (24 train, 6 val)."""

    def load_samples(self):
        return [{"input_ids": torch.full((1 + i % 8,), i), "loss_mask": torch.ones(1 + i % 8),
                 "hidden": torch.full((1 + i % 8, 2), float(i))} for i in range(30)]


def test_packed_module_serves_every_document_once_per_epoch_in_rows_of_at_most_the_limit():
    data = _Docs(batch_size=2, val_fraction=0.2, seed=4, pack=True, max_tokens_per_row=12)
    data.setup("fit")
    seen = []
    for batch in data.train_dataloader():
        assert batch["input_ids"].shape[1] <= 12
        for row in range(batch["input_ids"].shape[0]):
            docs = batch["document_ids"][row]
            assert torch.equal(batch["attention_mask"][row], docs >= 0)
            for d in docs.unique().tolist():
                if d >= 0:
                    tokens = batch["input_ids"][row][docs == d]
                    assert (tokens == tokens[0]).all() and len(tokens) == 1 + int(tokens[0]) % 8
                    seen.append(int(tokens[0]))
    train_docs = [data.train_set[i]["input_ids"][0].item() for i in range(len(data.train_set))]
    assert sorted(seen) == sorted(train_docs)
    assert len(data.train_rows) < len(data.train_set)
    val = [b["document_ids"] for b in data.val_dataloader()]
    assert sum(int((d >= 0).sum()) for d in val) == sum(1 + i % 8 for i in range(30)
                                                        if i not in train_docs)


def test_the_plan_is_deterministic_from_the_data_seed():
    plans = []
    for seed in (4, 4, 5):
        data = _Docs(batch_size=2, val_fraction=0.2, seed=seed, pack=True,
                     max_tokens_per_row=12)
        data.setup("fit")
        plans.append(data.train_rows.rows)
    assert plans[0] == plans[1] and plans[0] != plans[2]


def test_packing_refuses_long_documents_and_a_missing_row_length():
    data = _Docs(batch_size=2, val_fraction=0.2, seed=4, pack=True, max_tokens_per_row=7)
    with pytest.raises(ValueError, match=r"max_tokens_per_row=7: .* document of 8 tokens .*"
                                         r"max_tokens_per_row >= 8"):
        data.setup("fit")
    with pytest.raises(ValueError, match="data.pack=true needs data.max_tokens_per_row"):
        _Docs(pack=True)
    with pytest.raises(ValueError, match="data.pack='yes'"):
        _Docs(pack="yes", max_tokens_per_row=8)
    with pytest.raises(ValueError, match="document of 3 tokens"):
        pack([{"input_ids": torch.zeros(3)}], 2, ["input_ids"], "here", seed=None)


def test_packed_rows_concatenate_documents_with_their_ids():
    docs = [{"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([False, True])},
            {"input_ids": torch.tensor([3]), "loss_mask": torch.tensor([True])}]
    row = PackedRows(docs, [[1, 0]], ["input_ids", "loss_mask", "hidden"])[0]
    assert row["input_ids"].tolist() == [3, 1, 2] and row["document_ids"].tolist() == [0, 1, 1]
    assert row["loss_mask"].tolist() == [True, False, True] and "hidden" not in row


def test_online_packed_batches_equal_captured_packed_batches(tiny_target, tmp_path):
    """The online target runs each document of a packed row alone: its features equal the
    capture's (which ran each conversation alone) in the same packed layout."""
    jsonl, _ = capture_demo(tiny_target, tmp_path)
    common = dict(target=tiny_target, target_layer_ids=LAYERS, batch_size=2, val_fraction=0.25,
                  seed=3, pack=True, max_tokens_per_row=160)
    offline = OfflineDataModule(str(tmp_path / "cap"), hidden_size=64, vocab_size=768,
                                **common)
    online = OnlineDataModule(str(jsonl), max_length=64, shuffle_seed=None, **common)
    for dm in (offline, online):
        dm.setup("fit")
    assert offline.train_rows.rows == online.train_rows.rows
    features = online.feature_source()
    pairs = list(zip(offline.train_dataloader(), online.train_dataloader()))
    assert pairs and any(int(b["document_ids"].max()) >= 2 for b, _ in pairs)
    for off, on in pairs:
        feats = features(on["input_ids"], document_ids_bs=on["document_ids"])
        real = off["attention_mask"]
        assert torch.equal(off["document_ids"], on["document_ids"])
        assert torch.equal(off["target_argmax"][real], feats.argmax_bs[real])
        torch.testing.assert_close(off["hidden"][real], feats.hidden_bsf[real], rtol=1e-4,
                                   atol=1e-4)
        whole = features(on["input_ids"])  # the packed row run as one sequence: it leaks
        assert not torch.allclose(whole.hidden_bsf[real], feats.hidden_bsf[real], atol=1e-3)
