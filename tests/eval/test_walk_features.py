"""Features mode scores a head's own draft walk (``Head.walk`` without ``walk_metrics``: DSpark's
Markov walk, Domino's GRU walk, LiLiCorr's lattice walk with and without the conv, XPress's
Jacobi walk) by running ``Head.draft`` on every block, as generate mode drafts (offline_tau.py
``walk_drafts``), the unary argmax beside.

- On every anchor of a sample its drafts are the tokens generate mode's proposer drafts on the
  same block from the same context (``DFlashProposer.draft``: the inference cache, its context
  row and unary logits).
- On captures of greedy speculative generations (the target's own continuation) it reproduces
  every round's walk and unary acceptance length (last round excluded: generation cuts it at the
  token budget; a round is capped, as generation caps it, at the outputs left after its anchor),
  and ``tau_chained`` equals generation tau up to that last round.

Each drafter is a briefly trained DFlash 1 backbone (test_trained.py's ``quick_train``; DSpark's
own, with sample_from_anchor) with the head's modules perturbed so the walk moves picks; Domino
walks a candidate pool smaller than the vocabulary (teacher forcing could not score that).
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.eval.loop import DecodeSettings, speculative_generate
from dflash_lab.eval.offline_tau import _forward, feature_eval, walk_drafts
from dflash_lab.eval.prompts import encode_prompt
from dflash_lab.eval.proposer import DFlashProposer
from dflash_lab.eval.target_runner import TargetRunner
from dflash_lab.targets.demo_corpus import demo_conversations
from dflash_lab.train.loss import acceptance_lengths
from tests.eval.test_trained import B, _as_capture, quick_train
from tests.eval_doubles import tiny_drafter_for

LILICORR = {"lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 32, "lilicorr_num_layers": 1,
            "lilicorr_num_heads": 4, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8,
            "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 8.0}
#: variant -> (drafter fields, the head's module prefix, perturbation std)
HEADS = {
    "domino": ({"variant": "domino", "gru_hidden_dim": 8, "emb_dim": 4}, "embed_proj.", 1.0),
    "lilicorr": ({"variant": "lilicorr", **LILICORR}, "lilicorr.", 0.5),
    "lilicorr_conv": ({"variant": "lilicorr", **LILICORR, "conv_kernel_size": 2,
                       "conv_group_size": 16}, "lilicorr.", 0.5),
    "xpress": ({"variant": "xpress", "xpress_rank": 4, "xpress_mlp_hidden": 8, "xpress_topc": 0,
                "xpress_num_passes": 3}, "xpress_head.", 0.15),
}


@pytest.fixture(scope="module")
def backbone(tiny_target):
    return quick_train(tiny_target, steps=120)


def _walk_drafter(tiny_target, backbone, name: str):
    if name == "dspark":  # sample_from_anchor changes what the backbone learns: its own
        drafter = quick_train(tiny_target, steps=120, sample_from_anchor=True, variant="dspark",
                              markov_rank=8)
        prefix, std = "markov_head.", 0.6
    else:
        fields, prefix, std = HEADS[name]
        drafter = tiny_drafter_for(tiny_target, block_size=B, **fields)
        drafter.load_state_dict(backbone.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a head that moves some picks (trained heads are not needed here)
        for n, p in drafter.named_parameters():
            if n.startswith(prefix):
                p.add_(torch.randn(p.shape, generator=gen) * std)
    if name == "domino":  # SGLang's block-shared candidate pool, below the vocabulary
        drafter.walk_settings = {"candidate_pool_size": 16}
    return drafter.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=["dspark", *HEADS])
def replays(request, tiny_target, backbone):
    """(drafter, [(prompt, greedy generation, its capture)]) on four demo prompts."""
    drafter = _walk_drafter(tiny_target, backbone, request.param)
    pieces = tiny_target.pieces()
    runs = []
    for conv in demo_conversations(4, seed=41):
        prompt = encode_prompt(tiny_target.tokenizer, conv[:1])
        proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
        gen = speculative_generate(TargetRunner(tiny_target.model,
                                                drafter.config.target_layer_ids),
                                   proposer, prompt, DecodeSettings(max_new_tokens=40))
        runs.append((prompt, gen, _as_capture(tiny_target, drafter, prompt, gen.output_ids)))
    return drafter, runs


def _flags(drafter, pieces, sample, anchors):
    """(walk flags [1, N, B], unary LossOutput) of features mode on ``anchors``."""
    hidden, anchor_ids, tgt, out = _forward(drafter, pieces, sample, anchors)
    first = drafter.config.first_draft_slot
    flags = torch.zeros_like(out.valid)
    flags[0, :, first:] = walk_drafts(drafter, pieces, sample, anchors, hidden,
                                      anchor_ids) == tgt.labels[0, :, first:]
    return flags & out.valid, out


def test_features_walk_drafts_are_the_proposers_on_every_block(tiny_target, replays):
    drafter, runs = replays
    pieces = tiny_target.pieces()
    prompt, _, sample = runs[0]
    anchors = torch.arange(len(prompt), len(sample["input_ids"]))
    hidden, anchor_ids, _, _ = _forward(drafter, pieces, sample, anchors)
    drafts = walk_drafts(drafter, pieces, sample, anchors, hidden, anchor_ids)
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    for j, a in enumerate(anchors.tolist()):
        proposer.start(sample["hidden"][None, :a])
        own = proposer.draft(int(sample["input_ids"][a]), drafter.config.num_draft_tokens, 0.0,
                             "greedy", None)
        assert torch.equal(drafts[j], own.tokens), (a, drafts[j], own.tokens)
        assert torch.equal(anchor_ids[0, j], sample["input_ids"][a])


def test_features_mode_replays_the_walks_rounds_and_generation_tau(tiny_target, replays):
    drafter, runs = replays
    pieces = tiny_target.pieces()
    walked, unary, moved = [], [], False
    for prompt, gen, sample in runs:
        starts = [len(prompt) + sum(gen.acceptance_lengths[:r])
                  for r in range(len(gen.acceptance_lengths) - 1)]
        if not starts:
            continue
        flags, out = _flags(drafter, pieces, sample, torch.tensor(starts))
        first = out.first_slot
        # generation caps a round at the outputs left after its anchor (loop.unary_lengths): a
        # round near the end whose drafts all match has no bonus token there
        left = [len(sample["input_ids"]) - 1 - a for a in starts]
        walked += [min(n, m) for n, m in zip(
            acceptance_lengths(flags, out.block_valid, first).long().tolist(), left)]
        unary += [min(n, m) for n, m in zip(
            acceptance_lengths(out.correct, out.block_valid, first).long().tolist(), left)]
        assert walked[-len(starts):] == gen.acceptance_lengths[:-1]
        assert unary[-len(starts):] == gen.unary_acceptance_lengths[:-1]
        moved |= not torch.equal(flags, out.correct)
    assert max(walked) > 1, "fixture: some drafts must be accepted"
    assert moved and walked != unary, "fixture: the walk must change acceptance"
    feat = feature_eval(drafter, pieces, [s for _, _, s in runs], progress=False)
    lengths = [n for _, g, _ in runs for n in g.acceptance_lengths]
    assert feat["num_chained_rounds"] == len(lengths)
    chained_sum = feat["tau_chained"] * feat["num_chained_rounds"]
    assert sum(lengths) <= round(chained_sum) <= sum(lengths) + len(runs)
    assert feat["unary_tau_mean"] is not None and feat["oracle_tau_mean"] is None
    assert feat["recall_at_k"] is None and "tau_T1" not in feat
