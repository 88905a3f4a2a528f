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


class _WalkRounds(DFlashProposer):
    """A DFlashProposer that records each round's anchor position (its context length) where
    the loop calls its own ``draft`` (the Markov walk)."""

    def draft(self, anchor_id, *args):
        self.anchors.append(self.context_length)
        return super().draft(anchor_id, *args)


def test_features_mode_replays_the_markov_walks_rounds(tiny_target):
    """dflash-eval mode=features (the comparison's held-out curves) scores a DSpark drafter
    with its Markov bias: on each greedy round's anchor it gives exactly the acceptance length
    the serving walk got, where the backbone alone (no bias) gives other lengths."""
    from dflash_lab.eval.loop import DecodeSettings, speculative_generate
    from dflash_lab.eval.offline_tau import feature_eval, score_blocks
    from dflash_lab.eval.target_runner import TargetRunner
    from dflash_lab.train.loss import acceptance_lengths
    from tests.eval.test_trained import _as_capture, quick_train

    drafter = quick_train(tiny_target, steps=120, sample_from_anchor=True, variant="dspark",
                          markov_rank=8)
    with torch.no_grad():  # a bias that moves some picks (markov_w2 = 0 after quick_train)
        torch.manual_seed(3)
        drafter.markov_head.markov_w1.weight.normal_(std=1.0)
        drafter.markov_head.markov_w2.weight.normal_(std=0.4)
    pieces = tiny_target.pieces()
    walked, unary, samples = [], [], []
    for conv in demo_conversations(4, seed=41):
        prompt = encode_prompt(tiny_target.tokenizer, conv[:1])
        proposer = _WalkRounds(drafter, pieces.embed_tokens, pieces.lm_head)
        proposer.anchors = []
        gen = speculative_generate(TargetRunner(tiny_target.model,
                                                drafter.config.target_layer_ids),
                                   proposer, prompt, DecodeSettings(max_new_tokens=40))
        sample = _as_capture(tiny_target, drafter, prompt, gen.output_ids)
        samples.append(sample)
        anchors = torch.tensor(proposer.anchors[:-1])
        if not anchors.numel():
            continue
        out = score_blocks(drafter, pieces, sample, anchors)
        assert acceptance_lengths(out.correct, out.block_valid, out.first_slot).long().tolist() \
            == gen.acceptance_lengths[:-1]
        walked += gen.acceptance_lengths[:-1]
        head, drafter.markov_head = drafter.markov_head, None  # the backbone alone
        out = score_blocks(drafter, pieces, sample, anchors)
        drafter.markov_head = head
        unary += acceptance_lengths(out.correct, out.block_valid, out.first_slot).tolist()
    assert max(walked) > 1, "fixture: some drafts must be accepted"
    assert walked != [int(t) for t in unary], "fixture: the bias must change acceptance"
    feat = feature_eval(drafter, pieces, samples, progress=False)
    assert "tau_T1" not in feat and feat["num_blocks"] > 0
