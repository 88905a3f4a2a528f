"""vocab_topk (dflash_lab/model/layers.py): the blocked top-K the selector's candidates and the
fused head pass use equals torch.topk, values and ids, on both layouts, ragged vocabularies and
adversarial placements (all top entries in one block, in the tail, across blocks)."""

import pytest
import torch

from dflash_lab.heads.dflash2 import CandidateSelector
from dflash_lab.model.layers import TOPK_BLOCK, vocab_topk


def _cases(v: int, m: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    plain = torch.randn(m, v, generator=g)
    one_block = plain.clone()  # the 16 best of row 0 all inside block 3
    one_block[0, 3 * TOPK_BLOCK:3 * TOPK_BLOCK + 16] = 10 + torch.arange(16.0)
    tail = plain.clone()  # the best entries of row 1 in the ragged tail
    tail[1, -5:] = 20 + torch.arange(5.0)
    spread = plain.clone()  # one large entry per block: ranks decided by block maxima alone
    spread[2, ::TOPK_BLOCK] = 5 + torch.rand(len(range(0, v, TOPK_BLOCK)), generator=g)
    return [plain, one_block, tail, spread]


@pytest.mark.parametrize("v", [49152, 49152 + 37, 151936 + 3])
def test_vocab_topk_equals_torch_topk_on_both_layouts(v):
    for x_mv in _cases(v, 5):
        ref_values, ref_ids = x_mv.topk(16, dim=-1)
        values, ids = vocab_topk(x_mv, 16, dim=-1)
        assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids)
        values, ids = vocab_topk(x_mv.t().contiguous(), 16, dim=0)  # the loss's [V, m] chunks
        assert torch.equal(values.t(), ref_values) and torch.equal(ids.t(), ref_ids)


def test_vocab_topk_small_vocab_is_torch_topk_and_rejects_other_ranks():
    x = torch.randn(3, 2048)
    assert all(torch.equal(a, b) for a, b in zip(vocab_topk(x, 16), x.topk(16, dim=-1)))
    with pytest.raises(ValueError, match="2-D tensor"):
        vocab_topk(torch.randn(2, 3, 49152), 16)


def test_selector_candidates_keep_leading_dims_and_match_torch_topk():
    selector = CandidateSelector(hidden_size=8, vocab_size=49152, rank=4, top_k=16)
    unary = torch.randn(2, 3, 49152)
    values, ids = selector.candidates(unary)
    ref_values, ref_ids = unary.topk(16, dim=-1)
    assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids)
