"""A LiLiCorr drafter in the loop: the lattice walk drafts, greedy decoding stays lossless, the
walk's tokens equal the drafter's own greedy propose() given the same context row, and at T > 0
its drafts are sampled from softmax(row / T) over the K candidates and rejection-sampled."""

from __future__ import annotations

import pytest
import torch

from tests.eval_doubles import head_proposer, sampled_draft, tiny_drafter_for

B = 4
FIELDS = {"lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 32, "lilicorr_num_layers": 1,
          "lilicorr_num_heads": 4, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8,
          "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 8.0}


@pytest.fixture(scope="module", params=[{}, {"conv_kernel_size": 2, "conv_group_size": 16}],
                ids=["plain", "conv"])
def lilicorr(tiny_target, request):
    torch.manual_seed(0)
    drafter = tiny_drafter_for(tiny_target, block_size=B, variant="lilicorr", **FIELDS,
                               **request.param)
    with torch.no_grad():  # lattice weights large enough to move picks
        for p in drafter.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return drafter


def test_lilicorr_walk_is_lossless_and_is_the_drafters_propose(tiny_target, lilicorr):
    pieces = tiny_target.pieces()
    proposer = head_proposer(tiny_target, lilicorr, B)
    moved = 0
    for seed in range(4):
        proposer.start(torch.randn(1, 3, lilicorr.fc.weight.shape[1],
                                   generator=torch.Generator().manual_seed(seed)))
        walked = proposer.draft(5, B - 1, 0.0, "greedy", None)
        hidden = lilicorr.draft(proposer.cache, torch.tensor([5]), pieces.embed_tokens)
        assert torch.equal(walked.tokens, lilicorr.propose(
            hidden, torch.tensor([5]), pieces.lm_head, pieces.embed_tokens,
            proposer.cache.rows[:, -1])[0])
        moved += int(not torch.equal(walked.tokens, walked.unary_tokens))
    assert moved, "fixture: the lattice must matter"


def test_lilicorr_at_temperature_rejection_samples_its_lattice_drafts(tiny_target, lilicorr):
    sampled = sampled_draft(tiny_target, lilicorr, B)
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(B - 1))
    assert bool(((sampled.probs > 0).sum(-1) <= 4).all())  # q lives on the K candidates
    assert bool((sampled.probs.gather(-1, sampled.tokens[:, None]) > 0).all())
