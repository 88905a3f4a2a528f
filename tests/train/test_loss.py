"""Loss: label alignment, anchors strictly before, weights, normalisation, chunking, tau."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import anchor_candidates, sample_anchors, step_generator
from dflash_lab.train.loss import (
    CE_CHUNK_BYTES,
    LogitScale,
    acceptance_lengths,
    block_targets,
    candidate_logits,
    ce_chunk_rows,
    chunked_head_pass,
    position_weights,
    token_targets,
)
from dflash_lab.train.objective import dflash_loss
from tests.doubles import tiny_drafter_config


def test_argmax_labels_are_aligned_so_slot_t_predicts_position_anchor_plus_t():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    argmax = torch.tensor([[21, 22, 23, 24, 25, 26]])  # argmax[p] = target's token for p + 1
    tgt = token_targets(input_ids, argmax, "target_argmax")
    assert tgt.tolist() == [[-1, 21, 22, 23, 24, 25]]
    bt = block_targets(tgt, torch.ones(1, 6), torch.tensor([[2]]), torch.tensor([[True]]), 3)
    # block at anchor 2: slot 1 is position 3, whose target token is argmax[2] = 23
    assert bt.labels.tolist() == [[[22, 23, 24]]]
    assert bt.valid.tolist() == [[[False, True, True]]]
    data = token_targets(input_ids, None, "dataset")
    assert block_targets(data, torch.ones(1, 6), torch.tensor([[2]]), torch.tensor([[True]]),
                         3).labels.tolist() == [[[12, 13, 14]]]


def test_slots_past_the_end_outside_the_mask_or_in_padding_blocks_carry_no_loss():
    tgt = torch.arange(8)[None]
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]])
    bt = block_targets(tgt, loss_mask, torch.tensor([[2, 6, 6]]),
                       torch.tensor([[True, True, False]]), 4)
    assert bt.valid.tolist() == [[[False, True, False, True],
                                  [False, True, False, False],
                                  [False, False, False, False]]]


def test_position_weights_and_bad_gamma():
    w = position_weights(5, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(w[4].item(), math.exp(-3 / 7), rel_tol=1e-6)
    with pytest.raises(ValueError, match="gamma=0"):
        position_weights(4, 0)


def test_chunked_cross_entropy_equals_the_full_logits_computation_with_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(37, 8, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    out = chunked_head_pass(h, y, head, chunk_size=5)
    ce, ok = out.ce, out.correct
    ref = torch.nn.functional.cross_entropy(head(h), y, reduction="none")
    torch.testing.assert_close(ce, ref)
    assert torch.equal(ok, head(h).argmax(-1) == y)
    g1 = torch.autograd.grad(ce.sum(), h)[0]
    g2 = torch.autograd.grad(ref.sum(), h)[0]
    torch.testing.assert_close(g1, g2)


SCALES = [LogitScale(0.6), LogitScale(1.0, 3.0), LogitScale(1.7, 2.5)]


@pytest.mark.parametrize("frozen", [True, False], ids=["fused", "checkpointed"])
@pytest.mark.parametrize("scale", SCALES, ids=["multiplier", "softcap", "both"])
def test_head_pass_applies_multiplier_then_softcap_and_keeps_a_running_top_k(scale, frozen):
    """CE, correctness, gradients and the top-K equal the full-logits computation of
    ``scale(lm_head(h))`` (the drafter's unary logits), chunk by chunk."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False).requires_grad_(not frozen)
    h = torch.randn(37, 8, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    out = chunked_head_pass(h, y, head, chunk_size=5, scale=scale, top_k=4)
    logits = scale(head(h))
    ref = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    torch.testing.assert_close(out.ce, ref)
    assert torch.equal(out.correct, logits.argmax(-1) == y)
    values, ids = logits.topk(4)
    assert torch.equal(out.top_ids, ids)
    torch.testing.assert_close(out.top_values, values.detach())
    torch.testing.assert_close(torch.autograd.grad(out.ce.sum(), h)[0],
                               torch.autograd.grad(ref.sum(), h)[0])
    plain = chunked_head_pass(h, y, head, chunk_size=5).ce
    assert not torch.allclose(plain, out.ce)  # the scale really changes the CE


@pytest.mark.parametrize("bias", [False, True])
def test_candidate_logits_are_the_scaled_head_logits_of_the_given_ids(bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=bias).requires_grad_(False)
    h = torch.randn(11, 8, requires_grad=True)
    ids = torch.randint(0, 50, (11, 3))
    scale = LogitScale(1.3, 4.0)
    got = candidate_logits(h, ids, head, chunk_bytes=3 * 8 * 4 * 4, scale=scale)  # 4-row chunks
    want = scale(head(h)).gather(-1, ids)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, h, g)[0],
                               torch.autograd.grad(want, h, g)[0])


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces (bytes): a CPU-robust peak-chunk probe."""

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.max_bytes = max(self.max_bytes, t.numel() * t.element_size())
        return out


def test_ce_chunk_rows_follow_the_vocab_with_a_byte_budget():
    assert ce_chunk_rows(262_144) == 512  # Gemma 3: 512 MiB / (262144 * 4 bytes)
    assert ce_chunk_rows(151_936) == 883  # Qwen3
    assert ce_chunk_rows(49_152) == 2730
    assert ce_chunk_rows(32_000) == ce_chunk_rows(2_000) == 4096  # small vocabs: as before
    assert ce_chunk_rows(262_144, chunk_bytes=1) == 1
    assert ce_chunk_rows(262_144, chunk_size=4096) == 4096  # an explicit row count wins
    with pytest.raises(ValueError, match="module.ce_chunk_bytes=0"):
        ce_chunk_rows(1000, chunk_bytes=0)
    with pytest.raises(ValueError, match="module.ce_chunk_size=0"):
        ce_chunk_rows(1000, chunk_size=0)


def _huge_vocab_case(vocab: int, rows: int, requires_grad: bool):
    """A frozen H=8 head over ``vocab`` tokens, hidden [rows, 8] and labels [rows] (seed 0)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, vocab, bias=False).requires_grad_(False)
    h = torch.randn(rows, 8, requires_grad=requires_grad)
    return head, h, torch.randint(0, vocab, (rows,))


@pytest.mark.parametrize("grad", [True, False], ids=["fused-train", "no-grad-eval"])
def test_a_262k_vocab_holds_one_budgeted_chunk_of_logits_at_a_time(grad):
    """H=8 keeps it cheap: 40 rows x 262144 x fp32 would be 40 MiB of logits at once; a 16 MiB
    budget gives 16-row chunks, and no op may produce a tensor over 16 MiB."""
    vocab, budget = 262_144, 16 * 2**20
    head, h, y = _huge_vocab_case(vocab, rows=40, requires_grad=grad)
    probe = _LargestOutput()
    with torch.set_grad_enabled(grad), probe:
        out = chunked_head_pass(h, y, head, chunk_bytes=budget)
        ce, ok = out.ce, out.correct
        grad_h = torch.autograd.grad(ce.sum(), h)[0] if grad else None
    assert ce_chunk_rows(vocab, chunk_bytes=budget) == 16
    assert 16 * vocab * 4 <= probe.max_bytes <= budget  # one full chunk, never more
    ref = chunked_head_pass(h, y, head, chunk_size=40)  # one chunk: all logits
    ref_ce, ref_ok = ref.ce, ref.correct
    torch.testing.assert_close(ce, ref_ce)
    assert torch.equal(ok, ref_ok)
    if grad:
        torch.testing.assert_close(grad_h, torch.autograd.grad(ref_ce.sum(), h)[0])


def test_a_softcapped_pass_halves_its_chunks_to_keep_the_cap_derivative_in_budget():
    """The fused pass keeps d(softcap)/d(logits) beside the logits: two [rows, V] buffers, so
    a 16 MiB budget gives 8-row chunks (each buffer 8 MiB) and the top-K stays [M, K]."""
    vocab, budget = 262_144, 16 * 2**20
    head, h, y = _huge_vocab_case(vocab, rows=24, requires_grad=True)
    probe = _LargestOutput()
    with probe:
        out = chunked_head_pass(h, y, head, chunk_bytes=budget, scale=LogitScale(1.0, 5.0),
                                top_k=16)
    assert probe.max_bytes == 8 * vocab * 4
    assert out.top_ids.shape == (24, 16)


def test_module_passes_the_budget_to_the_loss_and_rejects_a_bad_one_at_start_up(monkeypatch):
    import dflash_lab.train.objective as loss_mod
    from dflash_lab.train.module import DFlashModule

    cfg = tiny_drafter_config("mixed_swa")
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    with pytest.raises(ValueError, match="module.ce_chunk_bytes=0"):
        DFlashModule(DFlashDrafter(cfg), head, optimizer=torch.optim.SGD, ce_chunk_bytes=0)
    seen = []
    real = loss_mod.chunked_head_pass
    monkeypatch.setattr(loss_mod, "chunked_head_pass",
                        lambda *a, **k: seen.append(a[3:]) or real(*a, **k))
    module = DFlashModule(DFlashDrafter(cfg), head, optimizer=torch.optim.SGD,
                          label_source="dataset", ce_chunk_bytes=12345)
    batch = {"hidden": torch.randn(1, 12, 3 * cfg.hidden_size),
             "input_ids": torch.randint(0, 90, (1, 12)), "loss_mask": torch.ones(1, 12)}
    module.blocks_loss(batch, torch.tensor([[1, 5]]), torch.tensor([[True, True]]))
    assert seen == [(None, 12345)]
    assert CE_CHUNK_BYTES == 512 * 2**20


def test_weighted_loss_is_normalised_by_the_weight_sum():
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 7, bias=False)
    hidden = torch.randn(1, 2, 3, 4)
    tgt = block_targets(torch.arange(9)[None] % 7, torch.ones(1, 9), torch.tensor([[1, 4]]),
                        torch.tensor([[True, True]]), 3)
    out = dflash_loss(hidden, tgt, head, gamma=2.0)
    ce = torch.nn.functional.cross_entropy(head(hidden[0]).transpose(1, 2),
                                           tgt.labels[0], reduction="none")  # [2, 3]
    w = torch.tensor([0.0, 1.0, math.exp(-0.5)])
    torch.testing.assert_close(out.weighted_sum, (ce * w).sum())
    torch.testing.assert_close(out.weight_sum, 2 * w.sum())


def test_tau_counts_leading_correct_slots_plus_one():
    correct = torch.tensor([[[False, True, True, False, True],
                             [True, False, True, True, True],
                             [False, True, True, True, True],
                             [False, True, True, True, True]]])
    taus = acceptance_lengths(correct, torch.tensor([[True, True, True, False]]))
    assert taus.tolist() == [3.0, 1.0, 5.0]


def test_anchor_sampling_valid_sorted_unique_bounded_seeded_and_fresh_each_step():
    torch.manual_seed(0)
    loss_mask = torch.rand(4, 64) > 0.3
    cand = anchor_candidates(loss_mask)
    a1, v1 = sample_anchors(loss_mask, 10, step_generator(3, 5))
    a2, v2 = sample_anchors(loss_mask, 10, step_generator(3, 5))
    a3, _ = sample_anchors(loss_mask, 10, step_generator(3, 6))
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    assert not torch.equal(a1, a3)
    assert a1.shape[1] <= 10
    for row in range(4):
        picked = a1[row][v1[row]]
        assert cand[row, picked].all()
        assert torch.equal(picked, picked.sort().values) and picked.unique().numel() == len(picked)
        assert len(picked) == min(10, int(cand[row].sum()))
        assert torch.equal(a1[row], a1[row].sort().values)  # padding keeps rows sorted
    assert not torch.equal(sample_anchors(loss_mask, 10, step_generator(3, 5, rank=1))[0], a1)


def test_block_outputs_ignore_context_at_and_after_the_anchor():
    torch.manual_seed(0)
    cfg = tiny_drafter_config("mixed_swa")
    drafter = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    hidden = torch.randn(1, 20, 3 * cfg.hidden_size)
    ids = torch.randint(0, 90, (1, 20))
    anchors = torch.tensor([[6, 9, 14]])
    base = drafter(hidden, ids, anchors, embed)
    poked = hidden.clone()
    poked[:, 9:] += 5.0
    out = drafter(poked, ids, anchors, embed)
    torch.testing.assert_close(out[:, 0], base[:, 0])  # anchor 6 never sees positions >= 9
    torch.testing.assert_close(out[:, 1], base[:, 1])  # anchor 9 never sees its own state
    assert not torch.allclose(out[:, 2], base[:, 2])  # anchor 14 does see 9..13
