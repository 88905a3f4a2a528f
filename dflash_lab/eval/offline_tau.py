"""Feature-level evaluation (``dflash-eval mode=features``): training validation's exact
greedy-acceptance simulator (labels, blocks, ``1 + leading correct slots``:
:mod:`dflash_lab.train.loss`) over captured shards, generating nothing, at every valid anchor or
``num_anchors`` sampled as validation does. ``tau_mean`` pools the anchors (validation's number),
``tau_chained`` follows a greedy run's rounds (:func:`chained_rounds`); a head with a draft walk
is scored by it (DFlash 2: ``walk_metrics``, others: :func:`walk_drafts`), the unary tau beside.
Why ``tau_mean`` exceeds generation tau: docs/eval.md, "Features mode and how it relates to
generation"; the fields: "Report".

Shape legend: S sequence, F features, N anchors per forward, B block size, T = B-1 drafted slots,
K selector candidates, V vocab. Suffix letters (``x_bnph``): docs/architecture.md; ``b`` is the
batch, ``p`` a position in a block.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from dflash_lab.eval.report import acceptance_summary
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import anchor_candidates, sample_anchors, step_generator
from dflash_lab.train.distill import slot_teacher
from dflash_lab.train.loss import (
    LossOutput,
    acceptance_lengths,
    block_targets,
    per_position_accuracy,
    token_targets,
)
from dflash_lab.train.objective import dflash_loss

log = logging.getLogger(__name__)

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
def _forward(drafter: DFlashDrafter, pieces, sample: dict[str, Tensor], anchors_n: Tensor,
             temperatures: tuple[float, ...] = (), teacher: str = "none"):
    """(hidden [1, N, B, H], anchor token ids [1, N], block targets, the unary LossOutput (the
    backbone's argmax: no head's teacher-forced change, unlike training's CE pass); with
    ``temperatures``, its ``expected_taus`` against the captured target distribution)."""
    device = drafter.fc.weight.device
    ids = sample["input_ids"][None].to(device)
    mask = sample["loss_mask"][None].to(device)
    anchors = anchors_n[None].to(device)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    hidden = drafter(sample["hidden"][None].to(device), ids, anchors, pieces.embed_tokens)
    targets = token_targets(ids, sample["target_argmax"][None].to(device), "target_argmax")
    cfg = drafter.config
    tgt = block_targets(targets, mask, anchors, valid, cfg.block_size, label_shift=cfg.label_shift)
    rows = {k: v[None].to(device) for k, v in sample.items() if k.startswith("target_")}
    out = dflash_loss(hidden.to(pieces.lm_head.weight.dtype), tgt, pieces.lm_head, _GAMMA,
                      block_valid_bn=valid, temperatures=temperatures,
                      teacher=slot_teacher(teacher, rows, anchors, tgt.valid,
                                           getattr(pieces, "logit_softcap", None),
                                           cfg.label_shift))
    return hidden, ids.gather(1, anchors), tgt, out


@torch.no_grad()
def walk_drafts(drafter: DFlashDrafter, pieces, sample: dict[str, Tensor], anchors_n: Tensor,
                hidden_bnph: Tensor, anchor_ids_bn: Tensor) -> Tensor:
    """[N, k]: the head's own greedy walk on each block (:meth:`DFlashDrafter.propose`:
    ``Head.draft`` at T = 0) on what generate mode's proposer gives it, the fused context row of
    the position before the anchor included (``cache.rows[0, -1]`` there; LiLiCorr's anchor row).
    16 blocks at a time: their unary logits [16, k, V] float32 are held at once."""
    before = (anchors_n.to(hidden_bnph.device) - 1).clamp(min=0)  # generation never anchors at 0
    context_nh = drafter.fuse(sample["hidden"].to(hidden_bnph.device)[before][None])[0]
    return torch.cat([drafter.propose(h, a, pieces.lm_head, pieces.embed_tokens, c) for h, a, c
                      in zip(*(x.split(16) for x in (hidden_bnph[0], anchor_ids_bn[0],
                                                      context_nh)))])


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


class _Pool:
    """Per-block acceptance lengths and per-slot flags of one drafting path."""

    def __init__(self, first_slot: int = 1) -> None:
        self.first_slot = first_slot  #: DrafterConfig.first_draft_slot
        self.taus: list[Tensor] = []
        self.correct: list[Tensor] = []

    def add(self, correct_bnp: Tensor, block_valid_bn: Tensor) -> Tensor:
        taus = acceptance_lengths(correct_bnp, block_valid_bn, self.first_slot).cpu()
        self.taus.append(taus)
        self.correct.append(correct_bnp[0].cpu())
        return taus

    def lengths(self) -> list[int]:
        return [int(t) for t in torch.cat(self.taus).tolist()] if self.taus else []


def _accuracy(correct: list[Tensor], valid: list[Tensor], b: int,
              first_slot: int = 1) -> list[float | None]:
    empty = torch.zeros(1, 0, b, dtype=torch.bool)
    pooled = LossOutput(torch.zeros(()), torch.zeros(()),
                        torch.cat(correct)[None] if correct else empty,
                        torch.cat(valid)[None] if valid else empty, first_slot=first_slot)
    return [None if math.isnan(a) else a for a in per_position_accuracy(pooled)]


def _sample_paths(drafter, pieces, sample, anchors, paths: dict[str, _Pool], valid: list,
                  expected: dict[float, list[Tensor]], teacher: str, walker: Any):
    """Score one anchor chunk on every path (``walker``: the head's walk metrics, or None:
    its own draft, :func:`walk_drafts`, when it has a walk); returns the taus of the path
    serving gets."""
    hidden, anchor_ids, tgt, out = _forward(drafter, pieces, sample, anchors,
                                            tuple(expected), teacher)
    valid.append(out.valid[0].cpu())
    for t, taus in (out.expected_taus or {}).items():
        expected[t].append(taus.cpu())
    unary = paths["unary"].add(out.correct, out.block_valid)
    if "selector" not in paths:
        return unary
    if walker is None:  # slot t correct when the walk drafts its label
        first = drafter.config.first_draft_slot
        walked = torch.zeros_like(out.valid)
        walked[0, :, first:] = walk_drafts(drafter, pieces, sample, anchors, hidden,
                                           anchor_ids) == tgt.labels[0, :, first:]
        walked &= out.valid
    else:
        walked, found = walker.features(drafter, pieces.lm_head, hidden, anchor_ids,
                                        tgt.labels, out.valid)
        paths["oracle"].add(found, out.block_valid)
    return paths["selector"].add(walked, out.block_valid)


def _walk_fields(paths: dict[str, _Pool], valid: list[Tensor], b: int) -> dict[str, Any]:
    """The unary path's fields and the oracle's (None: a walk scored by its own draft has no
    candidate set to find the label in)."""
    unary, oracle = acceptance_summary([paths["unary"].lengths()], b), paths.get("oracle")
    found = sum(int(c[:, 1:].sum()) for c in oracle.correct) if oracle else 0
    total = sum(int(v[:, 1:].sum()) for v in valid)
    return {
        "unary_tau_mean": unary["tau_mean"],
        "unary_per_position_acceptance": unary["per_position_acceptance"],
        "unary_per_position_accuracy": _accuracy(paths["unary"].correct, valid, b),
        "oracle_tau_mean": acceptance_summary([oracle.lengths()], b)["tau_mean"] if oracle
        else None,
        "recall_at_k": found / total if oracle and total else None,
        "recall_per_position": _accuracy(oracle.correct, valid, b) if oracle else None,
    }


def feature_eval(drafter: DFlashDrafter, pieces, dataset, *, num_samples: int | None = None,
                 num_anchors: int | None = None, seed: int = 1234, anchors_per_forward: int = 256,
                 progress: bool = True, temperatures=None) -> dict[str, Any]:
    """tau, per-position acceptance and accuracy of ``drafter`` over captured samples (DFlash 2:
    the selector path's, with the unary and oracle taus and recall@K). ``temperatures``: where
    to report the expected acceptance length ``tau_T{t}`` (exact: per-slot sum min(p_T, q_T)
    against the captured distribution, as ``val/tau_T{t}``); null: [1.0] when the capture holds
    it. DFlash 1 only (DFlash 2 samples from its selector, not the unary q: refused)."""
    from dflash_lab.data.shards import distribution_of
    from dflash_lab.train.distill import LossSpec, resolve_val_temperatures, teacher_kind

    held = distribution_of(getattr(dataset, "manifest", {}))  # a plain list: argmax only
    temps = resolve_val_temperatures(temperatures, held)
    head = drafter.config.head
    walk = (head.title, head.walk) if head.walk else None
    if walk and temps:
        if temperatures is not None:
            raise ValueError(f"features.temperatures={list(temperatures)}: the expected tau at "
                             f"T > 0 is measured for DFlash 1 drafters only (a {walk[0]} drafter "
                             f"samples from its {walk[1]}); use generate mode with temperature=T")
        log.warning(f"features mode: no tau_T1 for a {walk[0]} drafter (its {walk[1]} at T > 0 "
                    "is measured by generate mode)")
        temps = ()
    teacher = teacher_kind(LossSpec(), held, temps,
                           f"the capture {getattr(dataset, 'root', '(samples)')}")
    expected: dict[float, list[Tensor]] = {t: [] for t in temps}
    count = len(dataset) if num_samples is None else min(int(num_samples), len(dataset))
    walker = head.walk_metrics()  # DFlash 2: its selector, unary and oracle paths
    first = drafter.config.first_draft_slot
    names = ("selector", "unary", "oracle") if walker else ("selector", "unary") if walk \
        else ("unary",)
    paths = {name: _Pool(first) for name in names}
    valid: list[Tensor] = []
    chained: list[int] = []
    for k in tqdm(range(count), desc="features", unit="sample", disable=not progress):
        sample = dataset[k]
        anchor_chunks, sample_taus = [], []
        for anchors in sample_anchor_sets(sample["loss_mask"], num_anchors, seed, k,
                                          anchors_per_forward):
            sample_taus.append(_sample_paths(drafter, pieces, sample, anchors, paths, valid,
                                             expected, teacher, walker))
            anchor_chunks.append(anchors)
        if num_anchors is None and sample_taus:
            chained += chained_rounds(sample["loss_mask"], torch.cat(anchor_chunks).cpu(),
                                      torch.cat(sample_taus))
    b = drafter.config.block_size
    served = paths["selector" if walk else "unary"]
    lengths = served.lengths()
    # the longest round: drafts + the bonus (B, or B + 1 with sample_from_anchor)
    summary = acceptance_summary([lengths], drafter.config.num_draft_tokens + 1)
    report = {
        "mode": "features",
        "tau_mean": summary["tau_mean"],
        "tau_chained": sum(chained) / len(chained) if chained else None,
        "num_chained_rounds": len(chained),
        "per_position_acceptance": summary["per_position_acceptance"],
        "per_position_accuracy": _accuracy(served.correct, valid, b, first),
        "acceptance_histogram": summary["acceptance_histogram"],
        "num_samples": count,
        "num_blocks": len(lengths),
    }
    for t, parts in expected.items():
        taus = torch.cat(parts) if parts else torch.ones(0)
        report[f"tau_T{t:g}"] = taus.mean().item() if taus.numel() else None
    if walk:
        report.update(_walk_fields(paths, valid, b))
    return report
