"""A Domino drafter in the loop: the GRU walk drafts, greedy decoding stays lossless, the walk's
tokens equal the drafter's own greedy propose(), and at T > 0 its point-mass drafts go through
rejection sampling (each round keeps 1..B tokens, every kept draft is the walk's)."""

from __future__ import annotations

import pytest
import torch

from tests.eval_doubles import head_proposer, sampled_draft, tiny_drafter_for

B = 4


@pytest.fixture(scope="module")
def domino(tiny_target):
    torch.manual_seed(0)
    drafter = tiny_drafter_for(tiny_target, block_size=B, variant="domino", gru_hidden_dim=8,
                               emb_dim=4)
    with torch.no_grad():  # a correction large enough to move picks
        for p in drafter.embed_proj.parameters():
            p.normal_(std=2.0)
    return drafter


def test_domino_walk_is_lossless_and_is_the_drafters_propose(tiny_target, domino):
    pieces = tiny_target.pieces()
    proposer = head_proposer(tiny_target, domino, B)
    proposer.start(torch.randn(1, 3, domino.fc.weight.shape[1]))
    walked = proposer.draft(5, B - 1, 0.0, "greedy", None)
    hidden = domino.draft(proposer.cache, torch.tensor([5]), pieces.embed_tokens)
    assert torch.equal(walked.tokens, domino.propose(hidden, torch.tensor([5]), pieces.lm_head,
                                                     pieces.embed_tokens)[0])
    assert not torch.equal(walked.tokens, walked.unary_tokens), "fixture: the GRU must matter"


def test_domino_at_temperature_rejection_samples_its_point_mass_drafts(tiny_target, domino):
    sampled = sampled_draft(tiny_target, domino, B)
    assert torch.equal(sampled.probs.argmax(-1), sampled.tokens)
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(B - 1))
    assert set(sampled.probs.unique().tolist()) == {0.0, 1.0}
