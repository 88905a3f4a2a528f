"""DFlash training loss and the exact greedy-acceptance metrics (dflash.md section 2). Label
alignment has one definition, :func:`slot_positions` (docs/losses.md, "Label alignment").

Shape legend: Bt batch, S sequence, N blocks, B block size, H hidden, V vocab, M selected slots.
Suffix letters (``x_bnph``): docs/architecture.md; ``b`` is the batch, ``p`` a position in a block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_lab.model.layers import scale_logits, vocab_topk

LABEL_SOURCES = ("target_argmax", "dataset")
#: Default budget of one CE chunk's fp32 logits [rows, V]: 512 MiB (a 262k vocab gets 512 rows).
CE_CHUNK_BYTES = 512 * 2**20
#: Row cap of a budgeted chunk: today's fixed 4096, so any vocab <= 32768 chunks as it always did.
CE_MAX_ROWS = 4096
LOGIT_BYTES = 4  # the CE always runs on float32 logits, whatever the head's dtype


def token_targets(input_ids_bs: Tensor, target_argmax_bs: Tensor | None,
                  label_source: str) -> Tensor:
    """The token each position should hold [Bt, S] (position 0 of argmax labels is unused: -1)."""
    if label_source == "dataset":
        return input_ids_bs
    if label_source != "target_argmax":
        raise ValueError(f"label_source='{label_source}': use one of {list(LABEL_SOURCES)}")
    if target_argmax_bs is None:
        raise ValueError("label_source='target_argmax' needs the captured target_argmax")
    out = torch.full_like(target_argmax_bs, -1)
    out[:, 1:] = target_argmax_bs[:, :-1]
    return out


def slot_positions(anchors_bn: Tensor, block_size: int, label_shift: int = 0) -> Tensor:
    """[Bt, N, B]: the position whose token slot t of the block anchored at a predicts,
    ``a + t + label_shift`` (``DrafterConfig.label_shift``: 0 DFlash, 1 sample_from_anchor)."""
    offsets = torch.arange(block_size, device=anchors_bn.device) + int(label_shift)
    return anchors_bn[..., None] + offsets


def position_weights(block_size: int, gamma: float, device=None, first_slot: int = 1) -> Tensor:
    """[B]: 0 before ``first_slot`` (DFlash: slot 0, the anchor), ``exp(-(t-first)/gamma)``
    from it (``first_slot`` 0 with sample_from_anchor: slot 0 weighs 1)."""
    if gamma <= 0:
        raise ValueError(f"loss gamma={gamma}: must be > 0 (recipes: 7 for B=16, 5 for B=10)")
    t = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(t >= first_slot, torch.exp(-(t - first_slot) / gamma),
                       torch.zeros_like(t))


#: ``module.position_weighting``: how the loss weights the slots t >= 1 of a block.
POSITION_WEIGHTINGS = ("exp_decay", "dpace")


def check_position_weighting(weighting: str, dpace_alpha: float) -> None:
    """Refuse an unknown ``module.position_weighting``, or a dpace_alpha outside (0, 1]."""
    if weighting not in POSITION_WEIGHTINGS:
        raise ValueError(f"module.position_weighting='{weighting}': use one of "
                         f"{list(POSITION_WEIGHTINGS)} (exp_decay: exp(-(t-1)/gamma); dpace: "
                         "confidence-adaptive, from the drafter's own per-slot CE)")
    if weighting == "dpace" and not 0.0 < float(dpace_alpha) <= 1.0:
        raise ValueError(f"module.dpace_alpha={dpace_alpha}: must be in (0, 1] with "
                         "module.position_weighting=dpace (speculators' default 0.5)")


def dpace_weights(ce_bnp: Tensor, valid_bnp: Tensor, alpha: float) -> Tensor:
    """D-PACE slot weights [Bt, N, B] (fp32, no_grad: step constants) from the per-slot CE
    [Bt, N, B]: ``s_t = alpha + (1 - alpha) exp(-CE_t)`` on valid slots (1 elsewhere),
    ``P_t = prod_{i <= t} s_i``, ``w_t = valid_t * sum_{j >= t, valid_j} P_j``: what raising slot
    t's log-probability adds to the expected acceptance length (docs/training.md, dpace)."""
    with torch.no_grad():
        mask = valid_bnp.to(torch.float32)
        q = torch.exp(-ce_bnp.detach().float())
        smooth = torch.where(valid_bnp, alpha + (1.0 - alpha) * q, torch.ones_like(q))
        prefix = torch.cumprod(smooth, dim=-1) * mask
        return prefix.flip(-1).cumsum(-1).flip(-1) * mask


def slot_weights(valid_bnp: Tensor, ce_m: Tensor, gamma: float, weighting: str = "exp_decay",
                 dpace_alpha: float = 0.5, first_slot: int = 1) -> Tensor:
    """Weights [M] of the M valid slots (``valid_bnp`` [Bt, N, B] in row-major order) whose CE
    is ``ce_m`` [M]: :func:`position_weights` (exp_decay, decaying from ``first_slot``) or
    :func:`dpace_weights` (dpace: slots before ``first_slot`` are never valid)."""
    check_position_weighting(weighting, dpace_alpha)
    if weighting == "exp_decay":
        return position_weights(valid_bnp.shape[-1], gamma, valid_bnp.device,
                                first_slot).expand_as(
            valid_bnp)[valid_bnp]
    ce_bnp = torch.zeros(valid_bnp.shape, dtype=torch.float32, device=valid_bnp.device)
    ce_bnp[valid_bnp] = ce_m.detach().float()
    return dpace_weights(ce_bnp, valid_bnp, float(dpace_alpha))[valid_bnp]


@dataclass
class BlockTargets:
    """Per-slot labels and validity of a batch of blocks, each [Bt, N, B]."""

    labels: Tensor
    valid: Tensor
    #: the first slot that drafts (1 DFlash, 0 sample_from_anchor): metrics count from it
    first_slot: int = 1


def block_targets(targets_bs: Tensor, loss_mask_bs: Tensor, anchors_bn: Tensor,
                  anchor_valid_bn: Tensor, block_size: int,
                  document_ids_bs: Tensor | None = None, label_shift: int = 0) -> BlockTargets:
    """Gather labels only at anchored positions: slot t predicts p = :func:`slot_positions` (a + t
    + ``label_shift``) and counts when t >= 1 - label_shift, p < S, p is in the loss mask and its
    block a real (not padding) anchor; packed rows (``document_ids_bs`` [Bt, S]): also when p is
    in the anchor's document (a slot past its document's end gets no loss, as past a row's end)."""
    seq = targets_bs.shape[1]
    first = 1 - int(label_shift)
    pos = slot_positions(anchors_bn, block_size, label_shift)
    inside = pos < seq
    flat = pos.clamp(max=seq - 1).flatten(1)
    labels = targets_bs.gather(1, flat).view_as(pos)
    in_mask = loss_mask_bs.bool().gather(1, flat).view_as(pos)
    slot = torch.arange(block_size, device=pos.device) >= first
    valid = inside & in_mask & slot & anchor_valid_bn[..., None] & (labels >= 0)
    if document_ids_bs is not None:
        same_doc = document_ids_bs.gather(1, flat).view_as(pos) == document_ids_bs.gather(
            1, anchors_bn)[..., None]
        valid = valid & same_doc
    return BlockTargets(labels, valid, first)


def ce_chunk_rows(vocab_size: int, chunk_size: int | None = None,
                  chunk_bytes: int = CE_CHUNK_BYTES) -> int:
    """Rows per chunk of the vocab projection: an explicit ``chunk_size``, else as many as keep a
    chunk's fp32 logits [rows, V] within ``chunk_bytes`` (at least 1, at most ``CE_MAX_ROWS``).
    Head-dtype temporaries (bf16 logits, the chunk's input gradient [rows, H]) come on top."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"module.ce_chunk_size={chunk_size}: give a row count >= 1, or null "
                             "to size chunks by module.ce_chunk_bytes")
        return int(chunk_size)
    if chunk_bytes < 1:
        raise ValueError(f"module.ce_chunk_bytes={chunk_bytes}: give a byte budget >= 1 for one "
                         f"chunk's fp32 logits (default {CE_CHUNK_BYTES} = 512 MiB)")
    return max(1, min(CE_MAX_ROWS, chunk_bytes // (vocab_size * LOGIT_BYTES)))


def _vocab_size(lm_head: nn.Module) -> int:
    """V of an LM head: ``out_features`` or the first dimension of ``weight`` [V, H]."""
    vocab = getattr(lm_head, "out_features", None)
    if vocab is None and isinstance(getattr(lm_head, "weight", None), Tensor):
        vocab = lm_head.weight.shape[0]
    if vocab is None:
        raise ValueError(f"cannot tell the vocab size of the LM head {type(lm_head).__name__}: "
                         "set module.ce_chunk_size (rows per CE chunk) explicitly")
    return int(vocab)


@dataclass(frozen=True)
class LogitScale:
    """How unary logits leave the head: ``z * multiplier``, then ``c * tanh(. / c)`` if capped (the
    drafter's ``output_multiplier`` / ``final_logit_softcapping``; defaults mean off). Both maps
    are monotone: the argmax and the top-K set do not change, the CE does."""

    multiplier: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> LogitScale:
        """The scale of a :class:`~dflash_lab.model.config.DrafterConfig`."""
        return cls(float(config.output_multiplier), config.final_logit_softcapping)

    @property
    def identity(self) -> bool:
        return self.multiplier == 1.0 and self.softcap is None

    def __call__(self, logits: Tensor) -> Tensor:
        """Out of place (autograd-friendly), any shape: the drafter's own ``scale_logits``."""
        return scale_logits(logits, self.multiplier, self.softcap)

    def apply_(self, logits: Tensor) -> Tensor | float:
        """In place on fp32 logits; returns d(scaled)/d(raw): a float, or a tensor like
        ``logits`` when softcapped (``m * (1 - tanh^2)``, one extra logits-sized buffer)."""
        if self.softcap is None:
            logits.mul_(self.multiplier)
            return self.multiplier
        t = logits.mul_(self.multiplier / self.softcap).tanh_()
        deriv = t.square().neg_().add_(1.0).mul_(self.multiplier)
        t.mul_(self.softcap)
        return deriv

    def derivative_at(self, scaled: Tensor) -> Tensor | float:
        """d(scaled)/d(raw) from the scaled logits (any shape): the multiplier, or ``m * (1 -
        (scaled / c)^2)`` under a softcap (tanh = scaled / c): no derivative buffer needed."""
        if self.softcap is None:
            return self.multiplier
        return (scaled / self.softcap).square_().neg_().add_(1.0).mul_(self.multiplier)


NO_SCALE = LogitScale()


@dataclass
class HeadPass:
    """One chunked pass over the vocab for M rows: CE [M], correct [M] (label attains the max)
    and, when asked, the top-K of the (scaled) logits: values [M, K] fp32, ids [M, K], best first
    (detached: the selector loss recomputes the K logits it needs with gradients)."""

    ce: Tensor
    correct: Tensor
    top_values: Tensor | None = None
    top_ids: Tensor | None = None


def into_head_dtype(hidden_xh: Tensor, lm_head: nn.Module) -> Tensor:
    """Dtype policy (docs/targets.md): the frozen target head computes in the target's dtype,
    as it does when serving; the drafter's hidden states are cast into it here, the one place
    both head passes (:func:`chunked_head_pass`, :func:`candidate_logits`) go through (autograd
    casts the gradient back); the logits leave as fp32."""
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, Tensor) and hidden_xh.dtype != weight.dtype:
        return hidden_xh.to(weight.dtype)
    return hidden_xh


def _chunk_ce(hidden_mh: Tensor, labels_m: Tensor, lm_head: nn.Module, scale: LogitScale,
              top_k: int) -> tuple[Tensor, ...]:
    logits = lm_head(hidden_mh).float()
    if not scale.identity:
        logits = scale(logits)
    ce = F.cross_entropy(logits, labels_m, reduction="none")
    ok = logits.argmax(-1) == labels_m
    if not top_k:
        return ce, ok
    values, ids = logits.detach().topk(top_k, dim=-1)
    return ce, ok, values, ids


def chunked_head_pass(hidden_mh: Tensor, labels_m: Tensor, lm_head: nn.Module,
                      chunk_size: int | None = None, chunk_bytes: int = CE_CHUNK_BYTES, *,
                      scale: LogitScale = NO_SCALE, top_k: int = 0) -> HeadPass:
    """CE of the (scaled) unary logits per row, and their running top-K, one chunk at a time
    (:func:`ce_chunk_rows` rows), so nothing [M, V] is held. A frozen bias-free head with
    gradients takes the fused path (:class:`_FusedHeadCE`: two matmuls), else each chunk is
    checkpointed (three) (docs/losses.md, "Implementation and cost")."""
    weight = getattr(lm_head, "weight", None)
    hidden_mh = into_head_dtype(hidden_mh, lm_head)
    if hidden_mh.shape[0] == 0:
        empty = hidden_mh.new_zeros(0, dtype=torch.float32)
        top = (empty.new_zeros(0, top_k), labels_m.new_zeros(0, top_k)) if top_k else (None, None)
        return HeadPass(empty, empty.bool(), *top)
    if scale.softcap is not None and chunk_size is None:
        chunk_bytes = max(1, chunk_bytes // 2)
    chunk_size = ce_chunk_rows(_vocab_size(lm_head), chunk_size, chunk_bytes)
    fused_ok = (isinstance(lm_head, nn.Linear) and lm_head.bias is None
                and not weight.requires_grad)
    if torch.is_grad_enabled() and hidden_mh.requires_grad and fused_ok:
        return HeadPass(*_FusedHeadCE.apply(hidden_mh, labels_m, weight, chunk_size, scale,
                                            top_k))
    parts = []
    for start in range(0, hidden_mh.shape[0], chunk_size):
        h, y = hidden_mh[start:start + chunk_size], labels_m[start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_ce, h, y, lm_head, scale, top_k, use_reentrant=False))
        else:
            parts.append(_chunk_ce(h, y, lm_head, scale, top_k))
    return HeadPass(*(torch.cat(p) for p in zip(*parts, strict=True)))


class _FusedHeadCE(torch.autograd.Function):
    """CE of ``scale(hidden @ weight.T)`` per row, chunked, d(CE)/d(hidden) computed in forward;
    optionally each row's top-K (non-differentiable). Chunks are vocab-major [V, m], walked in
    place; only the [M, H] gradient is kept, the frozen weight gets none (docs/losses.md)."""

    @staticmethod
    def forward(ctx, hidden_mh: Tensor, labels_m: Tensor, weight_vh: Tensor, chunk_size: int,
                scale: LogitScale = NO_SCALE, top_k: int = 0):
        losses, correct, grads, top_values, top_ids = [], [], [], [], []
        for start in range(0, hidden_mh.shape[0], chunk_size):
            h, y = hidden_mh[start:start + chunk_size], labels_m[start:start + chunk_size]
            logits_vm = (weight_vh @ h.t()).float()
            deriv = None if scale.identity else scale.apply_(logits_vm)
            if top_k:
                values_km, ids_km = vocab_topk(logits_vm, top_k, dim=0)
                top_values.append(values_km.t())
                top_ids.append(ids_km.t())
            # the top-1 is the column max (the same float): no second pass over [V, m]
            top = values_km[0] if top_k else logits_vm.amax(dim=0)
            picked = logits_vm.gather(0, y[None])[0]
            probs_vm = logits_vm.sub_(top).exp_()  # softmax, in place over the logits
            total = probs_vm.sum(dim=0)
            probs_vm.mul_(total.reciprocal())
            losses.append(top + total.log() - picked)
            correct.append(picked >= top)
            probs_vm.scatter_add_(0, y[None], probs_vm.new_full((1, len(y)), -1.0))
            if deriv is not None:  # chain rule through the multiplier / softcap
                probs_vm.mul_(deriv)
            grads.append(probs_vm.t().to(weight_vh.dtype) @ weight_vh)
        outs = [torch.cat(correct)]
        if top_k:
            outs += [torch.cat(top_values), torch.cat(top_ids)]
        ctx.mark_non_differentiable(*outs)
        ctx.save_for_backward(torch.cat(grads))
        return torch.cat(losses), *outs

    @staticmethod
    def backward(ctx, grad_ce_m: Tensor, *_grad_rest: Tensor):
        (grad_mh,) = ctx.saved_tensors
        return (grad_mh * grad_ce_m[:, None].to(grad_mh.dtype)), None, None, None, None, None


def _gathered_logits(hidden_mh: Tensor, ids_mk: Tensor, weight_vh: Tensor,
                     bias_v: Tensor | None) -> Tensor:
    rows_mkh = F.embedding(ids_mk, weight_vh)
    out = torch.einsum("mh,mkh->mk", hidden_mh, rows_mkh).float()
    return out if bias_v is None else out + bias_v[ids_mk].float()


def _picked_logits(hidden_mh: Tensor, ids_mk: Tensor, lm_head: nn.Module) -> Tensor:
    return lm_head(hidden_mh).float().gather(-1, ids_mk)


def candidate_logits(hidden_mh: Tensor, ids_mk: Tensor, lm_head: nn.Module,
                     chunk_bytes: int = CE_CHUNK_BYTES,
                     scale: LogitScale = NO_SCALE) -> Tensor:
    """Scaled unary logits of K given tokens per row [M, K] fp32, differentiable in hidden (cast
    to the head's dtype first). A Linear head gathers only the K weight rows per row ([m, K, H]
    per ``chunk_bytes`` chunk, recomputed in backward); another head projects whole rows."""
    weight = getattr(lm_head, "weight", None)
    hidden_mh = into_head_dtype(hidden_mh, lm_head)
    linear = isinstance(lm_head, nn.Linear)
    per_row = (ids_mk.shape[1] * hidden_mh.shape[1] * hidden_mh.element_size() if linear
               else _vocab_size(lm_head) * LOGIT_BYTES)
    rows = max(1, chunk_bytes // max(1, per_row))
    parts = []
    for start in range(0, hidden_mh.shape[0], rows):
        h, ids = hidden_mh[start:start + rows], ids_mk[start:start + rows]
        args = (h, ids, weight, lm_head.bias) if linear else (h, ids, lm_head)
        fn = _gathered_logits if linear else _picked_logits
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            parts.append(fn(*args))
    raw = torch.cat(parts) if parts else hidden_mh.new_zeros(ids_mk.shape, dtype=torch.float32)
    return raw if scale.identity else scale(raw)


@dataclass
class LossOutput:
    """Weighted loss pieces and per-slot correctness [Bt, N, B] (False where invalid); when asked
    (DFlash 2's selector), the valid slots' unary top-K ``top_values`` / ``top_ids`` [M, K]."""

    weighted_sum: Tensor  # sum_slots w_t * CE (local)
    weight_sum: Tensor  # sum_slots w_t (local)
    correct: Tensor
    valid: Tensor
    block_valid: Tensor | None = None  # [Bt, N] real (not padding) blocks
    top_values: Tensor | None = None
    top_ids: Tensor | None = None
    #: the ``accept`` objective (distill.py): -sum over real blocks of the expected accepted
    #: drafts (local, differentiable) and the number of those blocks (local)
    accept_sum: Tensor | None = None
    accept_count: Tensor | None = None
    #: expected acceptance length per real block [K] at each asked temperature (T -> taus)
    expected_taus: dict[float, Tensor] | None = None
    #: each distribution term's weighted sum (local, detached; ``weight_sum`` normalises it)
    term_sums: dict[str, Tensor] | None = None
    #: the acceptance probability of every valid slot at each asked temperature (T -> [M])
    overlaps: dict[float, Tensor] | None = None
    #: the first drafting slot (BlockTargets.first_slot): acceptance counts from it
    first_slot: int = 1
    #: the CE of every valid slot [M] (detached): DSpark's confidence target
    slot_ce: Tensor | None = None
    #: a head's own loss pieces by name (model/heads.py ``add_losses``; its ``terms`` read
    #: them): DSpark's "confidence" (:class:`dflash_lab.heads.dspark.ConfidenceOutput`),
    #: DFlash 2's "selector" (:class:`dflash_lab.heads.dflash2.SelectorOutput`)
    head_pieces: dict[str, Any] = field(default_factory=dict)


def global_weighted_loss(weighted_sum: Tensor, weight_sum: Tensor, world_size: int = 1,
                         all_reduce_sum=None) -> Tensor:
    """``sum(w * CE) / GLOBAL sum(w)``, scaled for DDP's gradient averaging: DDP divides the
    summed gradients by the world size, so the local loss is ``world_size * local_sum /
    global_weight`` and the averaged gradient is one big batch's weighted mean, whatever each
    rank's share of slots. ``all_reduce_sum``: sums a tensor over ranks (None on one process)."""
    total = weight_sum.detach().clone()
    if world_size > 1:
        total = all_reduce_sum(total)
    return weighted_sum * world_size / total.clamp(min=1e-8)


def acceptance_lengths(correct_bnp: Tensor, block_valid_bn: Tensor, first_slot: int = 1) -> Tensor:
    """Exact greedy acceptance per real block [K]: 1 + number of leading correct slots
    t >= ``first_slot`` (1 DFlash; 0 sample_from_anchor, whose slot 0 drafts). An invalid slot
    (past the sequence or outside the loss mask) ends the run like a miss."""
    run = correct_bnp[..., first_slot:].long().cumprod(dim=-1).sum(-1)
    return (1 + run)[block_valid_bn].float()


def per_position_accuracy(out: LossOutput) -> list[float]:
    """Accuracy of the d-th drafted token over valid slots, d = 1..B-1 (DFlash: slot d) or
    1..B (sample_from_anchor: slot d - 1); NaN where a slot never occurs."""
    num = out.correct.sum(dim=(0, 1)).float()
    den = out.valid.sum(dim=(0, 1)).float()
    return [(num[t] / den[t]).item() if den[t] > 0 else math.nan
            for t in range(out.first_slot, num.shape[0])]
