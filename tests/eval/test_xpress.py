"""An XPress drafter in the loop: the Jacobi walk drafts from the whole block (min_slots = B, as
vLLM runs B = 1 + steps rows), greedy decoding stays lossless, the walk's tokens equal the
drafter's own greedy propose(), and at T > 0 its point-mass drafts go through rejection sampling
(each round keeps 1..B tokens, every kept draft is the walk's)."""

from __future__ import annotations

import pytest
import torch

from dflash_lab.eval.prompts import encode_prompt
from dflash_lab.eval.proposer import DFlashProposer
from dflash_lab.targets.demo_corpus import demo_conversations
from tests.eval_doubles import assert_lossless_greedy, tiny_drafter_for

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
    proposer = DFlashProposer(xpress, pieces.embed_tokens, pieces.lm_head)
    prompts = [encode_prompt(tiny_target.tokenizer, c[:1]) for c in demo_conversations(2, seed=5)]
    assert_lossless_greedy(tiny_target, proposer, xpress.config.target_layer_ids, prompts, 20, B)
    proposer.start(torch.randn(1, 3, xpress.fc.weight.shape[1]))
    walked = proposer.draft(5, B - 1, 0.0, "greedy", None)
    hidden = xpress.draft(proposer.cache, torch.tensor([5]), pieces.embed_tokens)
    assert torch.equal(walked.tokens, xpress.propose(hidden, torch.tensor([5]), pieces.lm_head)[0])
    assert not torch.equal(walked.tokens, walked.unary_tokens), "fixture: the refiner must matter"
    assert torch.equal(proposer.draft(5, 1, 0.0, "greedy", None).tokens, walked.tokens[:1])
    with pytest.raises(ValueError, match="at least 4 slots"):
        DFlashProposer(xpress, pieces.embed_tokens, pieces.lm_head, block_size=3)


def test_xpress_at_temperature_rejection_samples_its_point_mass_drafts(tiny_target, xpress):
    from dflash_lab.eval.loop import DecodeSettings, speculative_generate
    from dflash_lab.eval.target_runner import TargetRunner

    pieces = tiny_target.pieces()
    proposer = DFlashProposer(xpress, pieces.embed_tokens, pieces.lm_head)
    prompt = encode_prompt(tiny_target.tokenizer, demo_conversations(1, seed=7)[0][:1])
    settings = DecodeSettings(max_new_tokens=24, temperature=1.0)
    gen = speculative_generate(TargetRunner(tiny_target.model, xpress.config.target_layer_ids),
                               proposer, prompt, settings, torch.Generator().manual_seed(0))
    assert len(gen.output_ids) >= 24
    assert all(1 <= n <= B for n in gen.acceptance_lengths)
    sampled = proposer.draft(5, B - 1, 1.0, "rejection", torch.Generator().manual_seed(0))
    assert torch.equal(sampled.probs.argmax(-1), sampled.tokens)
    assert set(sampled.probs.unique().tolist()) == {0.0, 1.0}
