"""A DSpark drafter in the loop: the Markov walk drafts, greedy and rejection sampling stay
lossless, and the walk's tokens equal the drafter's own greedy propose()."""

from __future__ import annotations

import pytest
import torch

from dflash_lab.eval.prompts import encode_prompt
from dflash_lab.eval.proposer import DFlashProposer
from dflash_lab.targets.demo_corpus import demo_conversations
from tests.eval_doubles import assert_lossless_greedy, tiny_drafter_for

B = 4


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [encode_prompt(tiny_target.tokenizer, c[:1]) for c in demo_conversations(2, seed=5)]


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_dspark_walk_is_lossless_and_is_the_drafters_propose(tiny_target, prompts, kind):
    torch.manual_seed(0)
    drafter = tiny_drafter_for(tiny_target, block_size=B, sample_from_anchor=True,
                               variant="dspark", markov_rank=8, markov_head_type=kind)
    with torch.no_grad():  # a bias large enough to move picks
        for p in drafter.markov_head.parameters():
            p.normal_(std=2.0)
    pieces = tiny_target.pieces()
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    assert_lossless_greedy(tiny_target, proposer, drafter.config.target_layer_ids, prompts,
                           20, B + 1)
    proposer.start(torch.randn(1, 3, drafter.fc.weight.shape[1]))
    walked = proposer.draft(5, B, 0.0, "greedy", None)
    hidden = drafter.draft(proposer.cache, torch.tensor([5]), pieces.embed_tokens)
    assert torch.equal(walked.tokens, drafter.propose(hidden, torch.tensor([5]),
                                                      pieces.lm_head)[0])
    assert not torch.equal(walked.tokens, walked.unary_tokens), "fixture: the bias must matter"
    sampled = proposer.draft(5, B, 1.0, "rejection", torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (B, tiny_target.vocab_size)
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(B))
