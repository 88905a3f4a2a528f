"""An XPress drafter in the loop: the Jacobi walk drafts from the whole block (min_slots = B, as
vLLM runs B = 1 + steps rows), greedy decoding stays lossless, the walk's tokens equal the
drafter's own greedy propose(), and at T > 0 its point-mass drafts go through rejection sampling
(each round keeps 1..B tokens, every kept draft is the walk's)."""

from __future__ import annotations

import pytest
import torch

from dflash_lab.eval.proposer import DFlashProposer
from tests.eval_doubles import head_proposer, sampled_draft, tiny_drafter_for

B = 4


@pytest.fixture(scope="module")
def xpress(tiny_target):
    torch.manual_seed(0)
    drafter = tiny_drafter_for(tiny_target, block_size=B, variant="xpress", xpress_rank=4,
                               xpress_mlp_hidden=8, xpress_topc=0)
    with torch.no_grad():  # a refiner large enough to move picks
        for p in drafter.xpress_head.parameters():
            p.normal_(std=2.0)
    return drafter


def test_xpress_walk_is_lossless_and_is_the_drafters_propose(tiny_target, xpress):
    pieces = tiny_target.pieces()
    proposer = head_proposer(tiny_target, xpress, B)
    proposer.start(torch.randn(1, 3, xpress.fc.weight.shape[1]))
    walked = proposer.draft(5, B - 1, 0.0, "greedy", None)
    hidden = xpress.draft(proposer.cache, torch.tensor([5]), pieces.embed_tokens)
    assert torch.equal(walked.tokens, xpress.propose(hidden, torch.tensor([5]), pieces.lm_head)[0])
    assert not torch.equal(walked.tokens, walked.unary_tokens), "fixture: the refiner must matter"
    assert torch.equal(proposer.draft(5, 1, 0.0, "greedy", None).tokens, walked.tokens[:1])
    with pytest.raises(ValueError, match="at least 4 slots"):
        DFlashProposer(xpress, pieces.embed_tokens, pieces.lm_head, block_size=3)


def test_xpress_at_temperature_rejection_samples_its_point_mass_drafts(tiny_target, xpress):
    sampled = sampled_draft(tiny_target, xpress, B)
    assert torch.equal(sampled.probs.argmax(-1), sampled.tokens)
    assert set(sampled.probs.unique().tolist()) == {0.0, 1.0}
