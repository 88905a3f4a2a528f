"""Data modules: online features equal captured ones; split, collate and epoch shuffling."""

import json

import pytest
import torch

from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.data.module import (
    EpochShuffleSampler,
    OfflineDataModule,
    OnlineDataModule,
    pad_collate,
    split_indices,
)
from dflash_lab.targets.demo_corpus import demo_conversations

LAYERS = [1, 3, 5]


def capture_demo(target, tmp_path):
    """12 demo conversations written to tmp_path/conv.jsonl and captured by ``target`` at
    LAYERS (float32, 64 tokens) into tmp_path/cap: (the jsonl path, the capture path)."""
    rows = [{"messages": c} for c in demo_conversations(12, seed=11)]
    jsonl = tmp_path / "conv.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = CaptureSettings(out_dir=str(tmp_path / "cap"), target_layer_ids=LAYERS,
                               max_length=64, hidden_dtype="float32", shard_size=5,
                               batch_size=3)
    run_capture(target, rows, settings, {"path": str(jsonl)}, progress=False)
    return jsonl, tmp_path / "cap"


def test_training_refuses_a_capture_whose_manifest_was_edited(tiny_target, tmp_path):
    """Issue 47: the data module training opens refuses a manifest whose target_layer_ids no
    longer agree with its hf_hidden_state_indices, naming the file and both fields."""
    _, cap = capture_demo(tiny_target, tmp_path)
    manifest = json.loads((cap / "manifest.json").read_text())
    assert manifest["hf_hidden_state_indices"] == [i + 1 for i in LAYERS]
    (cap / "manifest.json").write_text(json.dumps({**manifest, "target_layer_ids": [0, 2, 4]}))
    dm = OfflineDataModule(str(cap), target=tiny_target, target_layer_ids=[0, 2, 4],
                           hidden_size=64, vocab_size=768, batch_size=4)
    with pytest.raises(ValueError, match=r"cap/manifest.json: target_layer_ids=\[0, 2, 4\] "
                                         r"and hf_hidden_state_indices=\[2, 4, 6\] disagree"):
        dm.setup("fit")


def test_online_batches_equal_offline_batches_from_a_capture(tiny_target, tmp_path):
    jsonl, _ = capture_demo(tiny_target, tmp_path)
    common = dict(target=tiny_target, target_layer_ids=LAYERS, batch_size=4, val_fraction=0.25,
                  seed=3)
    offline = OfflineDataModule(str(tmp_path / "cap"), hidden_size=64, vocab_size=768,
                                verify_checksums=True, **common)
    online = OnlineDataModule(str(jsonl), max_length=64, shuffle_seed=None, **common)
    for dm in (offline, online):
        dm.setup("fit")
    pairs = list(zip(offline.train_dataloader(), online.train_dataloader()))
    pairs += list(zip(offline.val_dataloader(), online.val_dataloader()))
    assert len(pairs) == 3 + 1
    features = online.feature_source()  # what the training step runs on online batches
    assert offline.feature_source() is None  # captured batches carry their features
    for off, on in pairs:
        assert "hidden" not in on
        feats = features(on["input_ids"])
        on = {**on, "hidden": feats.hidden_bsf, "target_argmax": feats.argmax_bs}
        real = off["attention_mask"]
        assert torch.equal(real, on["attention_mask"])
        for key in ("input_ids", "loss_mask", "target_argmax"):
            assert torch.equal(off[key][real], on[key][real]), key
        torch.testing.assert_close(off["hidden"][real], on["hidden"][real], rtol=1e-4,
                                   atol=1e-4)


def test_pad_collate_right_pads_and_drops_unknown_keys():
    a = {"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([0, 1, 1]),
         "hidden": torch.ones(3, 2), "target_argmax": torch.tensor([4, 5, 6]), "sample_id": 0}
    b = {"input_ids": torch.tensor([7]), "loss_mask": torch.tensor([1]),
         "hidden": torch.ones(1, 2), "target_argmax": torch.tensor([8]), "sample_id": 1}
    batch = pad_collate([a, b])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [7, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert batch["hidden"][1, 1:].abs().sum() == 0 and "sample_id" not in batch
    assert batch["attention_mask"].tolist() == [[True, True, True], [True, False, False]]


def test_pad_to_multiple_of_rounds_batch_lengths_and_pads_stay_invisible():
    """Lengths 5 and 3 -> 8 with multiple 4 (8 stays 8); the drafter's blocks are unchanged by
    the extra context pads (no anchor, no loss, no block sees them)."""
    import pytest

    from dflash_lab.data.module import BlockDataModule
    from dflash_lab.model.drafter import DFlashDrafter
    from tests.doubles import tiny_drafter_config

    cfg = tiny_drafter_config("mixed_per_layer")
    f = len(cfg.target_layer_ids) * cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 90, (n,), generator=g),
                "loss_mask": torch.ones(n, dtype=torch.long),
                "hidden": torch.randn(n, f, generator=g)} for n in (5, 3)]
    plain, rounded = pad_collate(samples), pad_collate(samples, pad_to_multiple_of=4)
    assert plain["input_ids"].shape == (2, 5) and rounded["input_ids"].shape == (2, 8)
    assert pad_collate(samples[:1] * 2, pad_to_multiple_of=5)["input_ids"].shape == (2, 5)
    assert rounded["attention_mask"].sum().item() == 8 and not rounded["loss_mask"][:, 5:].any()
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    anchors = torch.tensor([[0, 2, 3], [0, 1, 1]])
    out = [drafter(b["hidden"], b["input_ids"], anchors, embed) for b in (plain, rounded)]
    torch.testing.assert_close(out[0], out[1])
    with pytest.raises(ValueError, match="data.pad_to_multiple_of=0"):
        BlockDataModule(pad_to_multiple_of=0)


def test_split_is_deterministic_disjoint_and_bounded():
    train, val = split_indices(100, 0.1, seed=5)
    assert split_indices(100, 0.1, seed=5) == (train, val)
    assert not set(train) & set(val) and len(train) + len(val) == 100 and len(val) == 10
    assert len(split_indices(100, 0.5, seed=5, max_val=7)[1]) == 7


def test_epoch_sampler_depends_only_on_seed_and_epoch():
    s = EpochShuffleSampler(50, seed=2)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    s.set_epoch(0)
    assert list(s) == first and second != first and sorted(second) == list(range(50))
