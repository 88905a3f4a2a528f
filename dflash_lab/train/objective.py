"""The drafter's training objective: a list of named terms, one sum. :func:`dflash_loss` computes
the label term (the CE pass or the distribution pass; it sits above both so neither imports the
other's caller), :func:`terms` names the terms with their coefficients (a head adds its own),
:func:`objective` sums them, each normalised by its GLOBAL count, and :func:`local_means` gives
the same sum on this rank for the logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dflash_lab.train.distill_head import distill_loss
from dflash_lab.train.loss import (
    CE_CHUNK_BYTES,
    NO_SCALE,
    BlockTargets,
    LogitScale,
    LossOutput,
    chunked_head_pass,
    global_weighted_loss,
    slot_weights,
)


def dflash_loss(hidden_bnph: Tensor, targets: BlockTargets, lm_head: nn.Module, gamma: float,
                chunk_size: int | None = None, block_valid_bn: Tensor | None = None,
                chunk_bytes: int = CE_CHUNK_BYTES, *, scale: LogitScale = NO_SCALE,
                top_k: int = 0, weighting: str = "exp_decay",
                dpace_alpha: float = 0.5, spec=None, teacher=None,
                temperatures: tuple[float, ...] = ()) -> LossOutput:
    """Weighted CE over the M valid slots only, chunked (:func:`chunked_head_pass`). ``scale``:
    the drafter's logit scale; ``top_k`` > 0: also the unary top-K per valid slot; slot weights:
    :func:`slot_weights` (exp_decay with ``gamma`` | dpace with ``dpace_alpha``). A ``spec`` with
    terms beyond the label CE, or ``temperatures`` (expected acceptance), take the distribution
    pass (:func:`~dflash_lab.train.distill_head.distill_head_pass`) against ``teacher`` (the
    valid slots' target distribution, row-major); CE alone takes the CE pass."""
    if (spec is not None and not spec.ce_only) or temperatures:
        return distill_loss(hidden_bnph, targets, lm_head, gamma, chunk_size, block_valid_bn,
                            chunk_bytes, scale, top_k, weighting, dpace_alpha, spec, teacher,
                            temperatures)
    sel = targets.valid
    head = chunked_head_pass(hidden_bnph[sel], targets.labels[sel], lm_head, chunk_size,
                             chunk_bytes, scale=scale, top_k=top_k)
    w = slot_weights(sel, head.ce, gamma, weighting, dpace_alpha, targets.first_slot)
    correct = torch.zeros_like(sel)
    correct[sel] = head.correct
    return LossOutput((w * head.ce).sum(), w.sum(), correct, sel, block_valid_bn,
                      head.top_values, head.top_ids, first_slot=targets.first_slot,
                      slot_ce=head.ce.detach())


@dataclass(frozen=True)
class Term:
    """One named term of the objective: ``coef x weighted_sum / GLOBAL count`` (this rank's
    differentiable sum and normaliser). ``metric`` names its train log, ``shown`` x its local mean
    (accept: the expected accepted drafts, its negated mean); ``extra``: further train logs."""

    name: str
    weighted_sum: Tensor
    count: Tensor
    coef: float = 1.0
    metric: str = ""
    shown: float = 1.0
    extra: tuple[tuple[str, Tensor | float], ...] = ()

    def local_mean(self) -> Tensor:
        """This rank's mean (detached): what the logs show."""
        return self.weighted_sum.detach() / self.count.clamp(min=1e-8)


def terms(out: LossOutput, accept_weight: float = 1.0) -> list[Term]:
    """The label term, then the accept objective where present: the terms every head has, in
    the order they are summed (the head's own follow)."""
    found = [Term("label", out.weighted_sum, out.weight_sum)]
    if out.accept_sum is not None:  # normalised by the real blocks
        found.append(Term("accept", out.accept_sum, out.accept_count, accept_weight,
                          "expected_accepted", -1.0))
    return found


def objective(found: list[Term], world_size: int = 1, all_reduce_sum=None) -> Tensor:
    """The loss to backpropagate: sum of ``coef x`` each term over its GLOBAL count
    (:func:`~dflash_lab.train.loss.global_weighted_loss`)."""
    total = None
    for term in found:
        part = global_weighted_loss(term.weighted_sum, term.count, world_size, all_reduce_sum)
        part = part if term.coef == 1.0 else term.coef * part
        total = part if total is None else total + part
    return total


def local_means(found: list[Term]) -> Tensor:
    """This rank's objective (detached), term by term as :func:`objective` sums them."""
    means = [t.local_mean() if t.coef == 1.0 else t.coef * t.local_mean() for t in found]
    return sum(means[1:], means[0])


@dataclass
class StepParts:
    """What a head's training hooks (model/heads.py ``head_inputs``, ``add_terms``) read and
    change in one loss computation: the batch, the drafted blocks ``hidden`` [Bt, N, B, H],
    ``anchors`` [Bt, N], the labels ``token_ids`` [Bt, S] and their block targets ``tgt``, the
    head the CE pass runs through and its input, the teacher, the val temperatures."""

    batch: dict[str, Tensor]
    hidden: Tensor
    anchors: Tensor
    token_ids: Tensor
    tgt: Any
    lm_head: nn.Module
    teacher: Any = None
    temperatures: tuple[float, ...] = ()
    weighting: dict[str, Any] = field(default_factory=dict)
    head_in: Tensor | None = None
    emb: Tensor | None = None  #: DSpark: the Markov embedding of each slot's previous token
