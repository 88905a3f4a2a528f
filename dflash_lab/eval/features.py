"""Feature-level evaluation (``dflash-eval mode=features``): the training validation's exact
greedy-acceptance simulator, run over captured shards without generating anything.

For every anchored block the drafter sees the captured target features strictly before the anchor,
and its slot t is correct when it equals the target's argmax label at anchor + t (the labels,
block gathering, correctness and ``1 + leading correct slots`` all come from
:mod:`dflash_lab.train.loss`, the code training validates with). By default every valid anchor
(``loss_mask[p] and loss_mask[p+1]``) is evaluated, which makes the result deterministic;
``num_anchors`` samples like validation does instead.

Two averages are reported:

- ``tau_mean``: over every evaluated anchor, uniformly (what training validation logs).
- ``tau_chained`` (all anchors only): the rounds generation would run on this text. Greedy
  decoding anchors its first round at the first generated token and each next round where the
  previous one stopped (anchor + tau), so the chain starting at the first position of every
  loss-mask span and jumping by the simulated tau visits exactly the anchors of a greedy run
  whose output is the captured text (true of target-regenerated data, on which it reproduces
  generation tau round for round). ``tau_mean`` is systematically higher than generation tau:
  one long accepted round covers many easy positions, while every position of a hard stretch
  anchors a round (the inspection paradox). See docs/eval.md for measured numbers.

Shape legend: S sequence, F features, N anchors per forward, B block size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from dflash_lab.data.anchors import anchor_candidates, sample_anchors, step_generator
from dflash_lab.eval.report import acceptance_summary
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.loss import (
    LossOutput,
    acceptance_lengths,
    block_targets,
    dflash_loss,
    per_position_accuracy,
    token_targets,
)

#: gamma only weights the loss, which this evaluation does not report; correctness ignores it.
_GAMMA = 7.0


def sample_anchor_sets(loss_mask_s: Tensor, num_anchors: int | None, seed: int, index: int,
                       chunk: int) -> list[Tensor]:
    """Anchor chunks [N] for one sample: every candidate (``num_anchors=None``) or a seeded
    sorted sample (the validation sampler, seeded by (seed, sample index))."""
    if num_anchors is None:
        anchors = anchor_candidates(loss_mask_s[None])[0].nonzero().view(-1)
    else:
        picked, valid = sample_anchors(loss_mask_s[None], num_anchors,
                                       step_generator(seed, index))
        anchors = picked[0][valid[0]]
    return list(anchors.split(chunk)) if anchors.numel() else []


@torch.no_grad()
def score_blocks(drafter: DFlashDrafter, pieces, sample: dict[str, Tensor],
                 anchors_n: Tensor) -> LossOutput:
    """Correctness of every slot of the blocks anchored at ``anchors_n`` in one sample."""
    device = drafter.fc.weight.device
    ids = sample["input_ids"][None].to(device)
    mask = sample["loss_mask"][None].to(device)
    anchors = anchors_n[None].to(device)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    hidden = drafter(sample["hidden"][None].to(device), ids, anchors, pieces.embed_tokens)
    targets = token_targets(ids, sample["target_argmax"][None].to(device), "target_argmax")
    tgt = block_targets(targets, mask, anchors, valid, drafter.config.block_size)
    return dflash_loss(hidden.to(pieces.lm_head.weight.dtype), tgt, pieces.lm_head, _GAMMA,
                       block_valid_bn=valid)


def chained_rounds(loss_mask_s: Tensor, anchors_n: Tensor, taus_n: Tensor) -> list[int]:
    """Acceptance lengths of the rounds a greedy run would make over each loss-mask span:
    start at the span's first position, then jump to anchor + tau while that is an anchor."""
    tau_at = dict(zip(anchors_n.tolist(), taus_n.long().tolist()))
    mask = loss_mask_s.bool().tolist()
    starts = [p for p in range(len(mask)) if mask[p] and (p == 0 or not mask[p - 1])]
    rounds = []
    for p in starts:
        while p in tau_at:
            rounds.append(tau_at[p])
            p += tau_at[p]
    return rounds


def feature_eval(drafter: DFlashDrafter, pieces, dataset, *, num_samples: int | None = None,
                 num_anchors: int | None = None, seed: int = 1234, anchors_per_forward: int = 256,
                 progress: bool = True) -> dict[str, Any]:
    """tau, per-position acceptance and accuracy of ``drafter`` over captured samples."""
    count = len(dataset) if num_samples is None else min(int(num_samples), len(dataset))
    taus, correct, valid, chained = [], [], [], []
    for k in tqdm(range(count), desc="features", unit="sample", disable=not progress):
        sample = dataset[k]
        anchor_chunks, sample_taus = [], []
        for anchors in sample_anchor_sets(sample["loss_mask"], num_anchors, seed, k,
                                          anchors_per_forward):
            out = score_blocks(drafter, pieces, sample, anchors)
            anchor_chunks.append(anchors)
            sample_taus.append(acceptance_lengths(out.correct, out.block_valid).cpu())
            correct.append(out.correct[0].cpu())
            valid.append(out.valid[0].cpu())
        taus += sample_taus
        if num_anchors is None and sample_taus:
            chained += chained_rounds(sample["loss_mask"], torch.cat(anchor_chunks).cpu(),
                                      torch.cat(sample_taus))
    b = drafter.config.block_size
    lengths = [int(t) for t in torch.cat(taus).tolist()] if taus else []
    summary = acceptance_summary([lengths], b)
    pooled = LossOutput(torch.zeros(()), torch.zeros(()),
                        torch.cat(correct)[None] if correct else torch.zeros(1, 0, b, dtype=bool),
                        torch.cat(valid)[None] if valid else torch.zeros(1, 0, b, dtype=bool))
    accuracy = [None if math.isnan(a) else a for a in per_position_accuracy(pooled)]
    return {
        "mode": "features",
        "tau_mean": summary["tau_mean"],
        "tau_chained": sum(chained) / len(chained) if chained else None,
        "num_chained_rounds": len(chained),
        "per_position_acceptance": summary["per_position_acceptance"],
        "per_position_accuracy": accuracy,
        "acceptance_histogram": summary["acceptance_histogram"],
        "num_samples": count,
        "num_blocks": len(lengths),
    }
