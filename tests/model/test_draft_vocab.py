"""The draft vocabulary (issue 27 item 5): config, the drafter's own head and vLLM's id maps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_lab.export.weights import check_draft_vocab, expected_shapes
from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.draft_vocab import count_label_tokens, most_frequent
from dflash_lab.train.loss import BlockTargets
from dflash_lab.train.objective import dflash_loss
from tests.doubles import tiny_drafter_config

IDS = torch.tensor([0, 3, 5, 17, 40, 41, 42, 60, 90, 95])  # N = 10 of V = 97


def _drafter(n=10):
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config(draft_vocab_size=n))
    head = nn.Linear(48, 97, bias=False)
    drafter.set_draft_vocab(IDS[torch.randperm(n)], head)
    return drafter, head


def test_config_validates_round_trips_and_refuses_dflash2():
    cfg = tiny_drafter_config(draft_vocab_size=10)
    assert cfg.draft_vocab_size is not None and cfg.to_dict()["draft_vocab_size"] == 10
    assert DrafterConfig.from_dict(cfg.to_dict()).draft_vocab_size == 10
    whole = tiny_drafter_config(draft_vocab_size=97)  # the whole vocabulary: nothing to map
    assert whole.draft_vocab_size is None and "draft_vocab_size" not in whole.to_dict()
    for bad in (0, 98, 2.5, True):
        with pytest.raises(ValueError, match=r"draft_vocab_size=.*\[1, vocab_size=97\]"):
            tiny_drafter_config(draft_vocab_size=bad)
    with pytest.raises(ValueError, match="DFlash 2's candidate selector.*whole vocabulary"):
        tiny_drafter_config(draft_vocab_size=10, variant="dflash2", selector_top_k=4)


def test_the_drafter_owns_a_frozen_head_of_the_target_rows_and_vllm_offsets():
    drafter, head = _drafter()
    assert not drafter.lm_head.weight.requires_grad
    assert torch.equal(drafter.lm_head.weight, head.weight[IDS])  # ascending target ids
    state = drafter.state_dict()
    assert {"lm_head.weight", "d2t", "t2d"} <= set(state)
    # vLLM's compute_logits: target id = draft id + d2t[draft id]
    assert torch.equal(torch.arange(len(IDS)) + state["d2t"], IDS)
    assert torch.equal(state["t2d"].nonzero().flatten(), IDS)
    shapes = expected_shapes(drafter.config)
    assert all(tuple(state[k].shape) == shapes[k] for k in ("lm_head.weight", "d2t", "t2d"))
    check_draft_vocab(state, drafter.config, "test")
    broken = {**state, "d2t": state["d2t"].flip(0)}
    with pytest.raises(ValueError, match="d2t and t2d do not name the same 10"):
        check_draft_vocab(broken, drafter.config, "test")


def test_unary_logits_are_the_target_vocabulary_with_minus_inf_outside():
    drafter, head = _drafter()
    hidden = torch.randn(5, 48)
    logits = drafter.unary_logits(hidden, head)
    assert logits.shape == (5, 97)
    assert torch.allclose(logits[:, IDS], head(hidden)[:, IDS])
    outside = torch.ones(97, dtype=torch.bool)
    outside[IDS] = False
    assert torch.isinf(logits[:, outside]).all()
    best = logits.argmax(-1)
    assert torch.equal(best, IDS[head(hidden)[:, IDS].argmax(-1)])


def test_labels_map_to_draft_ids_and_the_loss_renormalises_over_the_draft_vocabulary():
    drafter, head = _drafter()
    labels = torch.tensor([[-1, 3, 41, 7, 95, 0]])
    assert drafter.to_draft_ids(labels).tolist() == [[-1, 1, 5, -1, 9, 0]]
    hidden = torch.randn(1, 1, 6, 48, requires_grad=True)
    mapped = drafter.to_draft_ids(labels)
    valid = mapped >= 0
    valid[..., 0] = False
    tgt = BlockTargets(mapped.view(1, 1, 6), valid.view(1, 1, 6))
    out = dflash_loss(hidden, tgt, drafter.head(head), gamma=7.0)
    # reference: CE of the target logits restricted to the draft ids, at the in-vocab slots
    keep = tgt.valid[0, 0]
    ref_logits = head(hidden[0, 0])[:, IDS]
    ce = F.cross_entropy(ref_logits[keep], mapped[0][keep], reduction="none")
    w = torch.exp(-(torch.arange(6.0) - 1) / 7.0)[keep]
    assert torch.allclose(out.weighted_sum, (w * ce).sum(), atol=1e-5)
    assert not out.valid[0, 0, 3]  # token 7 lies outside: no loss, and a miss in the tau


def test_counting_picks_the_most_frequent_labels_stably():
    items = [{"input_ids": torch.tensor([1, 2, 3, 4]), "loss_mask": torch.tensor([0, 1, 1, 1]),
              "target_argmax": torch.tensor([5, 5, 6, 9])},
             {"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([1, 1, 1]),
              "target_argmax": torch.tensor([6, 5, 2])}]
    counts, what = count_label_tokens(items, 10, "target_argmax")
    # labels = argmax shifted by one at loss-masked positions >= 1: [5, 5, 6] and [6, 5]
    assert counts.tolist() == [0, 0, 0, 0, 0, 3, 2, 0, 0, 0] and what == "target argmax labels"
    assert most_frequent(counts, 3).tolist() == [0, 5, 6]  # tie 0..4, 7..9: the lowest id
    online = [{k: v for k, v in it.items() if k != "target_argmax"} for it in items]
    counts, what = count_label_tokens(online, 10, "target_argmax")
    assert what == "conversation tokens" and counts.tolist() == [0, 1, 2, 2, 1, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="not this target's"):
        count_label_tokens(items, 6, "target_argmax")


def test_a_top_k_teacher_is_refused_naming_the_capture_option():
    from dflash_lab.train.module import DFlashModule

    drafter, head = _drafter()
    pieces = nn.Module()
    pieces.embed_tokens, pieces.lm_head = nn.Embedding(97, 48), head
    with pytest.raises(ValueError, match=r"top-k capture.*capture.distribution=\[last_hidden\]"):
        DFlashModule(drafter, pieces, torch.optim.AdamW, loss={"kl": 1.0},
                     target_distribution={"last_hidden": False, "topk": 8})
    DFlashModule(drafter, pieces, torch.optim.AdamW, loss={"kl": 1.0},
                 target_distribution={"last_hidden": True, "topk": 0})
