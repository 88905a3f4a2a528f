"""The drafter's training loss over one batch of blocks: the CE pass (train/loss.py) for the
label CE alone, the distribution pass (train/distill_head.py) for distribution terms or measured
acceptance. It sits above both so that neither imports the other's caller."""

from __future__ import annotations

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
    slot_weights,
)


def dflash_loss(hidden_bnph: Tensor, targets: BlockTargets, lm_head: nn.Module, gamma: float,
                chunk_size: int | None = None, block_valid_bn: Tensor | None = None,
                chunk_bytes: int = CE_CHUNK_BYTES, *, scale: LogitScale = NO_SCALE,
                top_k: int = 0, weighting: str = "exp_decay",
                dpace_alpha: float = 0.5, spec=None, teacher=None,
                temperatures: tuple[float, ...] = ()) -> LossOutput:
    """Weighted CE over valid slots; only the M valid slots go through the vocab projection
    (chunked as :func:`chunked_head_pass` says). ``scale``: the drafter's logit scale;
    ``top_k`` > 0 also returns the unary top-K of every valid slot. Slot weights:
    :func:`slot_weights` (``weighting``: exp_decay with ``gamma`` | dpace with ``dpace_alpha``,
    from this pass's own CE).

    ``spec`` (:class:`~dflash_lab.train.distill.LossSpec`) with terms beyond the label CE, or
    ``temperatures`` at which to measure the expected acceptance, take the distribution pass
    (:func:`~dflash_lab.train.distill_head.distill_head_pass`) against ``teacher`` (the target
    distribution of the valid slots, in row-major order); the default CE alone takes the CE pass.
    """
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
