"""A sample_from_anchor drafter in the loop: B drafts per round (slot 0 included), greedy
decoding stays lossless, and a perfect drafter reaches tau = B + 1."""

from __future__ import annotations

import pytest
import torch

from dflash_lab.eval.loop import DecodeSettings, baseline_generate, speculative_generate
from dflash_lab.eval.prompts import encode_prompt
from dflash_lab.eval.proposer import DFlashProposer, max_drafts
from dflash_lab.eval.target_runner import TargetRunner
from dflash_lab.targets.demo_corpus import demo_conversations
from tests.eval_doubles import RecordingProposer, assert_lossless_greedy, tiny_drafter_for

B = 4


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [encode_prompt(tiny_target.tokenizer, c[:1]) for c in demo_conversations(2, seed=5)]


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return tiny_drafter_for(tiny_target, block_size=B, sample_from_anchor=True)


def _proposer(tiny_target, drafter):
    pieces = tiny_target.pieces()
    return DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)


def test_an_anchor_drafter_proposes_b_tokens_and_is_lossless(tiny_target, drafter, prompts):
    proposer = _proposer(tiny_target, drafter)
    assert max_drafts(proposer) == B and proposer.first_slot == 0
    assert_lossless_greedy(tiny_target, proposer, drafter.config.target_layer_ids, prompts,
                           25, B + 1)
    proposer.start(torch.zeros(1, 3, drafter.fc.weight.shape[1]))
    assert proposer.propose(5).shape[0] == B  # slot 0's output included
    assert proposer.draft(5, B, 0.0, "greedy", None).tokens.shape == (B,)


def test_a_perfect_anchor_drafter_reaches_b_plus_one(tiny_target, drafter, prompts,
                                                     monkeypatch):
    """Draft row i is the token at C + 1 + i (slot i predicts anchor + i + 1): every round then
    accepts all B drafts plus the bonus."""
    prompt, rounds = prompts[0], 3
    n = 1 + rounds * (B + 1)
    seq = prompt + baseline_generate(TargetRunner(tiny_target.model), prompt,
                                     DecodeSettings(n + B)).output_ids
    proposer = _proposer(tiny_target, drafter)

    def oracle_unary(hidden_kh):
        c = proposer.context_length
        logits = torch.full((hidden_kh.shape[0], tiny_target.vocab_size), -1e4)
        for i in range(hidden_kh.shape[0]):
            logits[i, seq[c + 1 + i]] = 1e4
        return logits

    monkeypatch.setattr(proposer, "_unary", oracle_unary)
    spec = speculative_generate(TargetRunner(tiny_target.model, drafter.config.target_layer_ids),
                                proposer, prompt, DecodeSettings(max_new_tokens=n))
    assert spec.acceptance_lengths == [B + 1] * rounds
    assert spec.output_ids == seq[len(prompt):len(prompt) + n]


def test_a_trained_anchor_drafter_decodes_losslessly_and_features_mode_replays_its_rounds(
        tiny_target):
    """Briefly trained with sample_from_anchor: greedy decoding equals the target's own, and
    the feature simulator on each round's anchor gives that round's acceptance length (tau =
    1 + leading correct slots from slot 0; at most B + 1)."""
    from dflash_lab.eval.offline_tau import _forward, feature_eval
    from dflash_lab.train.loss import acceptance_lengths
    from tests.eval.test_trained import B as TRAINED_B
    from tests.eval.test_trained import _as_capture, quick_train

    drafter = quick_train(tiny_target, sample_from_anchor=True)
    pieces = tiny_target.pieces()
    settings = DecodeSettings(max_new_tokens=40)
    lengths, samples = [], []
    for conv in demo_conversations(4, seed=41):
        prompt = encode_prompt(tiny_target.tokenizer, conv[:1])
        rec = RecordingProposer(DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head))
        gen = speculative_generate(TargetRunner(tiny_target.model,
                                                drafter.config.target_layer_ids),
                                   rec, prompt, settings)
        assert gen.output_ids == baseline_generate(TargetRunner(tiny_target.model), prompt,
                                                   settings).output_ids
        sample = _as_capture(tiny_target, drafter, prompt, gen.output_ids)
        samples.append(sample)
        anchors = torch.tensor([c for c, _, _ in rec.rounds[:-1]])
        if anchors.numel():
            out = _forward(drafter, pieces, sample, anchors)[3]
            simulated = acceptance_lengths(out.correct, out.block_valid, out.first_slot)
            assert simulated.long().tolist() == gen.acceptance_lengths[:-1]
        lengths += gen.acceptance_lengths
    assert sum(lengths) / len(lengths) > 1.5 and max(lengths) <= TRAINED_B + 1
    feat = feature_eval(drafter, pieces, samples, progress=False)
    assert feat["num_chained_rounds"] == len(lengths)
    assert len(feat["acceptance_histogram"]) == TRAINED_B + 1
