"""DFlash training loss and the exact greedy-acceptance metrics (dflash.md section 2).

Label alignment (the classic bug is an off-by-one here): slot t of the block anchored at a
predicts the token AT position a + t. ``token_targets[p]`` is that token for every position p:
with target-argmax labels it is ``target_argmax[p - 1]`` (the target's choice for position p,
made after reading positions <= p-1); with dataset labels it is ``input_ids[p]``.

Shape legend: Bt batch, S sequence, N blocks, B block size, H hidden, V vocab, M selected slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

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


def position_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """[B]: 0 for slot 0 (the anchor), ``exp(-(t-1)/gamma)`` for t >= 1."""
    if gamma <= 0:
        raise ValueError(f"loss gamma={gamma}: must be > 0 (recipes: 7 for B=16, 5 for B=10)")
    t = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(t >= 1, torch.exp(-(t - 1) / gamma), torch.zeros_like(t))


@dataclass
class BlockTargets:
    """Per-slot labels and validity of a batch of blocks, each [Bt, N, B]."""

    labels: Tensor
    valid: Tensor


def block_targets(targets_bs: Tensor, loss_mask_bs: Tensor, anchors_bn: Tensor,
                  anchor_valid_bn: Tensor, block_size: int) -> BlockTargets:
    """Gather labels only at anchored positions; a slot counts when t >= 1, a + t < S, the
    position is in the loss mask, and its block is a real (not padding) anchor."""
    seq = targets_bs.shape[1]
    pos = anchors_bn[..., None] + torch.arange(block_size, device=anchors_bn.device)
    inside = pos < seq
    flat = pos.clamp(max=seq - 1).flatten(1)
    labels = targets_bs.gather(1, flat).view_as(pos)
    in_mask = loss_mask_bs.bool().gather(1, flat).view_as(pos)
    slot = torch.arange(block_size, device=pos.device) >= 1
    valid = inside & in_mask & slot & anchor_valid_bn[..., None] & (labels >= 0)
    return BlockTargets(labels, valid)


def ce_chunk_rows(vocab_size: int, chunk_size: int | None = None,
                  chunk_bytes: int = CE_CHUNK_BYTES) -> int:
    """Rows per chunk of the vocab projection.

    An explicit ``chunk_size`` wins. Otherwise the chunk follows the vocab, so one chunk's fp32
    logits [rows, V] stay within ``chunk_bytes``: ``chunk_bytes // (V * 4)`` rows, at least 1, at
    most ``CE_MAX_ROWS``. Temporaries in the head's dtype (bf16 logits before the cast, the
    per-chunk input gradient [rows, H]) come on top.
    """
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


def _chunk_ce(hidden_mh: Tensor, labels_m: Tensor, lm_head: nn.Module) -> tuple[Tensor, Tensor]:
    logits = lm_head(hidden_mh).float()
    return F.cross_entropy(logits, labels_m, reduction="none"), logits.argmax(-1) == labels_m


def chunked_cross_entropy(hidden_mh: Tensor, labels_m: Tensor, lm_head: nn.Module,
                          chunk_size: int | None = None,
                          chunk_bytes: int = CE_CHUNK_BYTES) -> tuple[Tensor, Tensor]:
    """Per-row CE [M] and correctness [M] without holding [M, V] fp32 logits at once.

    Chunks of :func:`ce_chunk_rows` rows: ``chunk_size`` if given, else as many as fit
    ``chunk_bytes`` of fp32 logits for this head's vocab.

    Frozen bias-free LM head (the DFlash case) with gradients wanted: the fused path
    (:class:`_FusedHeadCE`) projects each chunk once and computes the gradient to the hidden
    states right there, so the vocab projection costs two matmuls (forward and input gradient)
    and peak memory is one chunk of logits. Otherwise (trainable head or bias, no grad) each
    chunk runs under activation checkpointing: backward recomputes its logits (three matmuls).
    """
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, Tensor) and hidden_mh.dtype != weight.dtype:
        # Dtype policy (docs/training.md): the frozen target head computes in the target's
        # dtype, as it does when serving; the drafter's hidden states are cast into it here
        # (autograd casts the gradient back) and the logits leave as fp32.
        hidden_mh = hidden_mh.to(weight.dtype)
    if hidden_mh.shape[0] == 0:
        empty = hidden_mh.new_zeros(0, dtype=torch.float32)
        return empty, empty.bool()
    chunk_size = ce_chunk_rows(_vocab_size(lm_head), chunk_size, chunk_bytes)
    fused_ok = (isinstance(lm_head, nn.Linear) and lm_head.bias is None
                and not weight.requires_grad)
    if torch.is_grad_enabled() and hidden_mh.requires_grad and fused_ok:
        return _FusedHeadCE.apply(hidden_mh, labels_m, weight, chunk_size)
    losses, correct = [], []
    for start in range(0, hidden_mh.shape[0], chunk_size):
        h, y = hidden_mh[start:start + chunk_size], labels_m[start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            ce, ok = checkpoint(_chunk_ce, h, y, lm_head, use_reentrant=False)
        else:
            ce, ok = _chunk_ce(h, y, lm_head)
        losses.append(ce)
        correct.append(ok)
    return torch.cat(losses), torch.cat(correct)


class _FusedHeadCE(torch.autograd.Function):
    """CE of ``hidden @ weight.T`` per row, chunked, with d(CE)/d(hidden) computed in forward.

    Per chunk: logits (fp32) -> CE = logsumexp - logit[label]; dCE/dlogits = softmax - onehot;
    dCE/dhidden = that @ weight (in the weight's dtype, as autograd's linear backward does).
    Only the [M, H] gradient is kept for backward, which scales it by the incoming per-row
    gradient. The weight gets no gradient (frozen target LM head).

    Each chunk's logits are held vocab-major, [V, m] = weight @ h.T, and walked as few times as
    possible, in place: max, subtract, exp, sum, scale. On CPU (MKL) that product runs ~20%
    faster than [m, V] = h @ weight.T, and the vocab reductions become reductions over the
    outer dimension, vectorised across the m rows (benchmarks/peer_speculators measures the
    step). A slot is correct when its label's logit attains the maximum (an exact tie would
    count as correct where ``argmax`` picks the first index; float logits do not tie in
    practice, and ``argmax`` would cost another pass over [V, m]).
    """

    @staticmethod
    def forward(ctx, hidden_mh: Tensor, labels_m: Tensor, weight_vh: Tensor, chunk_size: int):
        losses, correct, grads = [], [], []
        for start in range(0, hidden_mh.shape[0], chunk_size):
            h, y = hidden_mh[start:start + chunk_size], labels_m[start:start + chunk_size]
            logits_vm = (weight_vh @ h.t()).float()
            top = logits_vm.amax(dim=0)
            picked = logits_vm.gather(0, y[None])[0]
            probs_vm = logits_vm.sub_(top).exp_()  # softmax, in place over the logits
            total = probs_vm.sum(dim=0)
            probs_vm.mul_(total.reciprocal())
            losses.append(top + total.log() - picked)
            correct.append(picked >= top)
            probs_vm.scatter_add_(0, y[None], probs_vm.new_full((1, len(y)), -1.0))
            grads.append(probs_vm.t().to(weight_vh.dtype) @ weight_vh)
        ok = torch.cat(correct)
        ctx.mark_non_differentiable(ok)
        ctx.save_for_backward(torch.cat(grads))
        return torch.cat(losses), ok

    @staticmethod
    def backward(ctx, grad_ce_m: Tensor, _grad_ok: Tensor):
        (grad_mh,) = ctx.saved_tensors
        return (grad_mh * grad_ce_m[:, None].to(grad_mh.dtype)), None, None, None


@dataclass
class LossOutput:
    """Weighted loss pieces and per-slot correctness [Bt, N, B] (False where invalid)."""

    weighted_sum: Tensor  # sum_slots w_t * CE (local)
    weight_sum: Tensor  # sum_slots w_t (local)
    correct: Tensor
    valid: Tensor
    block_valid: Tensor | None = None  # [Bt, N] real (not padding) blocks


def dflash_loss(hidden_bnbh: Tensor, targets: BlockTargets, lm_head: nn.Module, gamma: float,
                chunk_size: int | None = None, block_valid_bn: Tensor | None = None,
                chunk_bytes: int = CE_CHUNK_BYTES) -> LossOutput:
    """Weighted CE over valid slots; only the M valid slots go through the vocab projection
    (chunked as :func:`chunked_cross_entropy` says)."""
    b = hidden_bnbh.shape[2]
    weights = position_weights(b, gamma, hidden_bnbh.device).expand_as(targets.valid)
    sel = targets.valid
    ce, ok = chunked_cross_entropy(hidden_bnbh[sel], targets.labels[sel], lm_head, chunk_size,
                                   chunk_bytes)
    w = weights[sel]
    correct = torch.zeros_like(sel)
    correct[sel] = ok
    return LossOutput((w * ce).sum(), w.sum(), correct, sel, block_valid_bn)


def global_weighted_loss(weighted_sum: Tensor, weight_sum: Tensor, world_size: int = 1,
                         all_reduce_sum=None) -> Tensor:
    """``sum(w * CE) / GLOBAL sum(w)``, scaled for DDP's gradient averaging.

    Each rank holds its local sums. DDP averages gradients over ranks (divides by world size),
    so the local loss is ``world_size * local_sum / global_weight``: the averaged gradient then
    equals the gradient of one big batch's weighted mean, whatever each rank's share of slots.
    ``all_reduce_sum``: a function summing a tensor over ranks (None on one process).
    """
    total = weight_sum.detach().clone()
    if world_size > 1:
        total = all_reduce_sum(total)
    return weighted_sum * world_size / total.clamp(min=1e-8)


def acceptance_lengths(correct_bnb: Tensor, block_valid_bn: Tensor) -> Tensor:
    """Exact greedy acceptance per real block [K]: 1 + number of leading correct slots t >= 1.

    An invalid slot (past the sequence or outside the loss mask) ends the run like a miss.
    """
    run = correct_bnb[..., 1:].long().cumprod(dim=-1).sum(-1)
    return (1 + run)[block_valid_bn].float()


def per_position_accuracy(out: LossOutput) -> list[float]:
    """Accuracy of slot t over valid slots, t = 1..B-1 (NaN where a slot never occurs)."""
    num = out.correct.sum(dim=(0, 1)).float()
    den = out.valid.sum(dim=(0, 1)).float()
    return [(num[t] / den[t]).item() if den[t] > 0 else math.nan for t in range(1, num.shape[0])]
