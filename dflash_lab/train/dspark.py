"""DSpark training: the Markov-biased CE and the confidence BCE (docs/dspark.md).

speculators 0.9.0's DSpark objective (``models/dspark/metrics.py``)::

    loss = token loss of (backbone logits + Markov bias), position-weighted as DFlash
         + confidence_head_alpha (1.0) x BCE(confidence logit, c*), weighted exp(-t/gamma),
           divided by the number of supervised slots

with ``c* = sum_v min(q_v, p_v) = 1 - TV(q, p)``, the slot's analytical acceptance rate
(detached). Here the token loss is the project's CE on the target's argmax (``module.loss=ce``):
the teacher is one-hot, so ``c* = q(label) = exp(-CE)``, the drafter's probability of the
target's token. The confidence BCE keeps the fixed exponential decay under D-PACE too, as
speculators does.

The Markov bias is linear in its feature f, so backbone + bias is ONE linear head over
``[h; f]`` with weight ``[W_lm | markov_w2]`` (:class:`ConcatHead`): the chunked CE of
dflash_lab/train/loss.py runs on it unchanged (its checkpointed path: markov_w2 is trained).

Teacher-forced previous tokens (:func:`markov_prev_ids`): slot k, predicting position p, is
conditioned on the token at p - 1: the anchor when p - 1 is the anchor (what the walk starts
from), else the label of position p - 1 (the target's argmax: the token the walk drafted there
whenever drafting got that far). speculators uses the data token at p - 1; the two agree with
``module.label_source=dataset``.

Shape legend: Bt batch, S sequence, N blocks, B block size, H hidden, r markov rank, M
supervised slots, V' head vocabulary (V, or N with a draft vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.train.loss import LossOutput, position_weights, slot_positions


class ConcatHead(nn.Module):
    """``lm_head(h) + markov_w2(f)`` as one linear map of ``[h; f]`` [x, H + r] -> [x, V'].

    The weight is built once per step (it carries markov_w2's gradient); it is in the LM head's
    dtype, as the unary head computes."""

    def __init__(self, lm_head: nn.Module, markov_w2: nn.Linear):
        super().__init__()
        w = lm_head.weight
        self.weight = torch.cat([w, markov_w2.weight.to(w.dtype)], dim=1)
        self.out_features = w.shape[0]

    def forward(self, x_xf: Tensor) -> Tensor:
        return F.linear(x_xf.to(self.weight.dtype), self.weight)


def markov_prev_ids(input_ids_bs: Tensor, targets_bs: Tensor, anchors_bn: Tensor,
                    block_size: int, label_shift: int) -> Tensor:
    """The token before each slot's predicted position [Bt, N, B] (target vocabulary): the
    anchor's token at or before the anchor, else the label there (the data token where the
    label is missing, -1)."""
    seq = input_ids_bs.shape[1]
    before = slot_positions(anchors_bn, block_size, label_shift) - 1
    flat = before.clamp(0, seq - 1).flatten(1)
    labels = targets_bs.gather(1, flat).view_as(before)
    data = input_ids_bs.gather(1, flat).view_as(before)
    anchor_tok = input_ids_bs.gather(1, anchors_bn)[..., None].expand_as(before)
    inner = torch.where(labels >= 0, labels, data)
    return torch.where(before <= anchors_bn[..., None], anchor_tok, inner)


def markov_inputs(drafter, hidden_bnph: Tensor, prev_bnp: Tensor,
                  lm_head: nn.Module) -> tuple[Tensor, nn.Module, Tensor | None]:
    """(what the CE reads [Bt, N, B, H(+r)], the head it reads it with, e [Bt, N, B, r] or
    None): ``[h; f]`` and :class:`ConcatHead` with a Markov head, else ``h`` and the head."""
    markov = drafter.markov_head
    if markov is None:
        return hidden_bnph, lm_head, None
    feats, emb = markov.features(prev_bnp, hidden_bnph)
    return (torch.cat([hidden_bnph, feats.to(hidden_bnph.dtype)], -1),
            ConcatHead(lm_head, markov.markov_w2), emb)


@dataclass
class ConfidenceOutput:
    """The confidence BCE's local pieces: sum of w_t x BCE, the number of supervised slots,
    and the sum of |sigmoid(logit) - c*| (calibration metric), all over the M valid slots."""

    weighted_sum: Tensor
    count: Tensor
    abs_error_sum: Tensor


def confidence_loss(drafter, hidden_bnph: Tensor, emb_bnpr: Tensor | None, out: LossOutput,
                    gamma: float) -> ConfidenceOutput | None:
    """speculators' confidence term on the M valid slots (module docstring); None without a
    confidence head or when the loss pass gave no per-slot CE (validation at temperatures)."""
    head = drafter.confidence_head
    if head is None or out.slot_ce is None:
        return None
    sel = out.valid
    target = torch.exp(-out.slot_ce.detach().float())  # q(label): one-hot teacher's 1 - TV
    logits = head(hidden_bnph[sel], None if emb_bnpr is None else emb_bnpr[sel])
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    w = position_weights(sel.shape[-1], gamma, sel.device, out.first_slot).expand_as(sel)[sel]
    err = (torch.sigmoid(logits.detach()) - target).abs().sum()
    return ConfidenceOutput((w * bce).sum(), sel.sum().float(), err)
