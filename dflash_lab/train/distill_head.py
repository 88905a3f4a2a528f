"""The head pass of the distribution losses: one chunked pass over the vocabulary per step.

:func:`distill_head_pass` is :func:`~dflash_lab.train.loss.chunked_head_pass` for a
:class:`~dflash_lab.train.distill.LossSpec` with terms beyond the label CE: per chunk of rows it
projects the drafter's hidden states (and, for a dense teacher, the target's final-normed last
hidden states) through the frozen target head, computes every term of the spec, the label CE
and correctness, the overlaps at the asked temperatures and the unary top-K, and the gradient to
the drafter's hidden states right there (dL/dz from :mod:`dflash_lab.train.distill`, then one
matmul with the head weight). Nothing [M, V] is held: a chunk's rows are chosen so that its
``DISTILL_BUFFERS`` fp32 [V, m] buffers fit the bytes the CE pass would use for the same rows.

Shape legend: M rows (valid slots), H hidden, V vocab, K top-k, m rows of a chunk, T the number
of asked temperatures. Vocab-major chunks ``x_vm`` [V, m] as in the CE pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dflash_lab.model.dflash2 import vocab_topk
from dflash_lab.train.distill import (
    LossSpec,
    Teacher,
    distribution_terms,
    expected_accepted,
    on_slots,
    teacher_logits,
    tempered_overlap,
)
from dflash_lab.train.loss import (
    CE_CHUNK_BYTES,
    NO_SCALE,
    LogitScale,
    LossOutput,
    _vocab_size,
    ce_chunk_rows,
    into_head_dtype,
    slot_weights,
)

#: fp32 [V, m] buffers a chunk holds at once (logits, log q, q, teacher logits, log p, p, h,
#: dL/dz): rows per chunk = the CE pass's rows for this M // this.
DISTILL_BUFFERS = 8


@dataclass
class DistillPass:
    """Per-row results [M] of the distribution head pass.

    ``loss``: sum over the spec's slot terms of weight x value (ce included), differentiable.
    ``accept``: the acceptance probability of each slot at ``spec.accept_temperature``
    (differentiable; only when the spec has ``accept``). ``ce``, ``correct``: the label CE and
    whether the label attains the max. ``overlap``: sum min(p, q) at T_label (the D-PACE
    confidence; zeros unless ``need_overlap``). ``terms`` [C, M]: each distribution term's
    value. ``overlaps`` [T, M]: the acceptance probability at each asked temperature (0: the
    greedy match). ``top_values`` /
    ``top_ids`` [M, K]: the unary top-K when asked.
    """

    loss: Tensor
    ce: Tensor
    correct: Tensor
    overlap: Tensor
    terms: Tensor
    accept: Tensor | None = None
    overlaps: Tensor | None = None
    top_values: Tensor | None = None
    top_ids: Tensor | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)


def _ce_terms(logits_vm: Tensor, labels_m: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """log q [V, m], q [V, m], label CE [m] and correctness [m] of scaled logits."""
    logq_vm = torch.log_softmax(logits_vm, dim=0)
    q_vm = logq_vm.exp()
    ce_m = -logq_vm.gather(0, labels_m[None])[0]
    correct_m = logits_vm.gather(0, labels_m[None])[0] >= logits_vm.amax(dim=0)
    return logq_vm, q_vm, ce_m, correct_m


def _accept(spec: LossSpec, teacher: Teacher, t_vm, logits_vm, q_vm, labels_m, want_grad):
    """alpha [m] at the accept temperature and d(alpha)/dz: T = 0 takes the smooth greedy
    surrogate q(y) (d q_y / dz = q_y (onehot - q))."""
    if spec.accept_temperature > 0:
        return tempered_overlap(teacher, t_vm, logits_vm, spec.accept_temperature, want_grad)
    q_y = q_vm.gather(0, labels_m[None])[0]
    if not want_grad:
        return q_y, None
    grad = -q_vm * q_y
    grad.scatter_add_(0, labels_m[None], q_y[None])
    return q_y, grad


def _greedy_overlap(logits_vm: Tensor, t_vm: Tensor | None, teacher: Teacher) -> Tensor:
    """T = 0: a slot is accepted when the drafter's argmax is the target's argmax [m] (0/1)."""
    draft = logits_vm.argmax(0)
    target = t_vm.argmax(0) if teacher.dense else teacher.top_ids_mk[:, 0].long()
    return (draft == target).float()


def _chunk(h_mh: Tensor, labels_m: Tensor, weight_vh: Tensor, scale: LogitScale, top_k: int,
           spec: LossSpec, teacher: Teacher, temperatures: tuple[float, ...], want_grad: bool,
           need_overlap: bool = True):
    """Every per-row output of one chunk, and (when ``want_grad``) the gradients of ``loss``
    and ``accept`` to the chunk's hidden states [m, H] (None when not asked)."""
    logits_vm = (weight_vh @ h_mh.t()).float()
    deriv = None if scale.identity else scale.apply_(logits_vm)
    tops = tuple(t.t() for t in vocab_topk(logits_vm, top_k, dim=0)) if top_k else None
    logq_vm, q_vm, ce_m, correct_m = _ce_terms(logits_vm, labels_m)
    t_vm = teacher_logits(teacher, weight_vh) if teacher.dense else None
    dist = distribution_terms(spec, teacher, t_vm, q_vm, logq_vm, want_grad, need_overlap)
    ce_weight = dict(spec.slot_terms).get("ce", 0.0)
    loss_m = dist.value_m + ce_weight * ce_m
    accept_m = accept_grad = None
    if spec.accept_weight:
        accept_m, accept_grad = _accept(spec, teacher, t_vm, logits_vm, q_vm, labels_m,
                                        want_grad)
    overlaps = [(_greedy_overlap(logits_vm, t_vm, teacher) if t == 0 else
                 tempered_overlap(teacher, t_vm, logits_vm, t, False)[0]) for t in temperatures]
    grads = (None, None)
    if want_grad:
        grad_vm = dist.grad_vm if dist.grad_vm is not None else torch.zeros_like(q_vm)
        if ce_weight:
            grad_vm = grad_vm.add_(ce_weight * q_vm)
            grad_vm.scatter_add_(0, labels_m[None], q_vm.new_full((1, len(labels_m)),
                                                                  -ce_weight))
        grads = tuple(None if g is None else _to_hidden(g, deriv, weight_vh)
                      for g in (grad_vm, accept_grad))
    outs = (loss_m, ce_m, correct_m, dist.overlap_m, dist.terms_cm, accept_m,
            torch.stack(overlaps) if overlaps else None, *(tops or (None, None)))
    return outs, grads


def _to_hidden(grad_vm: Tensor, deriv, weight_vh: Tensor) -> Tensor:
    """dL/dh [m, H] from dL/dz [V, m]: through the logit scale, then the head weight."""
    if deriv is not None:
        grad_vm = grad_vm * deriv
    return grad_vm.t().to(weight_vh.dtype) @ weight_vh


def _cat(parts: list, dim: int = 0):
    return None if parts[0] is None else torch.cat(parts, dim=dim)


def _passes(hidden_mh, labels_m, weight_vh, rows, scale, top_k, spec, teacher, temperatures,
            want_grad, need_overlap=True):
    """Run every chunk; returns (outputs as DistillPass fields, gradient parts)."""
    outs, grads = [], []
    for start in range(0, hidden_mh.shape[0], rows):
        stop = start + rows
        o, g = _chunk(hidden_mh[start:stop], labels_m[start:stop], weight_vh, scale, top_k,
                      spec, teacher.rows(start, stop), temperatures, want_grad, need_overlap)
        outs.append(o)
        grads.append(g)
    cols = list(zip(*outs, strict=True))
    dims = (0, 0, 0, 0, 1, 0, 1, 0, 0)  # terms [C, m] and overlaps [T, m] join on rows
    return [_cat(list(c), d) for c, d in zip(cols, dims, strict=True)], grads


class _FusedDistill(torch.autograd.Function):
    """The pass with gradients: ``loss`` and ``accept`` [M] are differentiable in the hidden
    states; their gradients [M, H] are computed in forward and scaled by the incoming per-row
    gradients in backward (the CE pass's scheme). The head weight gets none (frozen)."""

    @staticmethod
    def forward(ctx, hidden_mh, labels_m, weight_vh, rows, scale, top_k, spec, teacher,
                temperatures, need_overlap):
        fields, grads = _passes(hidden_mh, labels_m, weight_vh, rows, scale, top_k, spec,
                                teacher, temperatures, True, need_overlap)
        loss_grad = torch.cat([g[0] for g in grads])
        accept_grad = torch.cat([g[1] for g in grads]) if spec.accept_weight else None
        ctx.save_for_backward(loss_grad, accept_grad)
        accept = fields[5] if fields[5] is not None else hidden_mh.new_zeros(0)
        rest = [f if f is not None else hidden_mh.new_zeros(0) for f in fields[1:5] + fields[6:]]
        ctx.mark_non_differentiable(*rest)
        return fields[0], accept, *rest

    @staticmethod
    def backward(ctx, grad_loss, grad_accept, *_rest):
        loss_grad, accept_grad = ctx.saved_tensors
        grad = loss_grad * grad_loss[:, None].to(loss_grad.dtype)
        if accept_grad is not None and grad_accept is not None and grad_accept.numel():
            grad = grad + accept_grad * grad_accept[:, None].to(accept_grad.dtype)
        return grad, None, None, None, None, None, None, None, None, None


def distill_rows(num_rows: int, vocab_size: int, chunk_size: int | None,
                 chunk_bytes: int) -> int:
    """Rows per chunk: the CE pass's rows for these M rows, over ``DISTILL_BUFFERS``."""
    ce_rows = min(num_rows, ce_chunk_rows(vocab_size, chunk_size, chunk_bytes))
    return max(1, ce_rows // DISTILL_BUFFERS)


def distill_head_pass(hidden_mh: Tensor, labels_m: Tensor, lm_head: nn.Module, spec: LossSpec,
                      teacher: Teacher, *, chunk_size: int | None = None,
                      chunk_bytes: int = CE_CHUNK_BYTES, scale: LogitScale = NO_SCALE,
                      top_k: int = 0, temperatures: tuple[float, ...] = (),
                      need_overlap: bool = True) -> DistillPass:
    """The distribution losses, label CE, overlaps and top-K of M rows in one chunked pass.

    ``teacher``: the target distribution of the same M rows. ``temperatures``: where to
    measure the acceptance probability (``overlaps``). Needs a frozen bias-free Linear head
    (the target's): ValueError otherwise, naming the head.
    """
    weight = getattr(lm_head, "weight", None)
    if not (isinstance(lm_head, nn.Linear) and lm_head.bias is None and weight is not None
            and not weight.requires_grad):
        raise ValueError(f"module.loss={spec.describe()}: the distribution losses need the "
                         f"target's frozen bias-free Linear LM head, got "
                         f"{type(lm_head).__name__}; use module.loss=ce")
    hidden_mh = into_head_dtype(hidden_mh, lm_head)
    temperatures = tuple(float(t) for t in temperatures)
    if hidden_mh.shape[0] == 0:
        return _empty(hidden_mh, labels_m, spec, top_k, temperatures)
    rows = distill_rows(hidden_mh.shape[0], _vocab_size(lm_head), chunk_size, chunk_bytes)
    if torch.is_grad_enabled() and hidden_mh.requires_grad:
        out = _FusedDistill.apply(hidden_mh, labels_m, weight, rows, scale, top_k, spec,
                                  teacher, temperatures, need_overlap)
        loss, accept, ce, correct, overlap_m, terms, overlaps, top_v, top_i = out
        return DistillPass(loss, ce, correct, overlap_m, terms,
                           accept if spec.accept_weight else None,
                           overlaps if temperatures else None,
                           top_v if top_k else None, top_i if top_k else None)
    with torch.no_grad():
        fields, _ = _passes(hidden_mh, labels_m, weight, rows, scale, top_k, spec, teacher,
                            temperatures, False, need_overlap)
    loss, ce, correct, overlap_m, terms, accept, overlaps, top_v, top_i = fields
    return DistillPass(loss, ce, correct, overlap_m, terms, accept, overlaps, top_v, top_i)


def _empty(hidden_mh: Tensor, labels_m: Tensor, spec: LossSpec, top_k: int,
           temperatures: tuple[float, ...]) -> DistillPass:
    zero = hidden_mh.new_zeros(0, dtype=torch.float32)
    num_terms = sum(1 for n, _ in spec.slot_terms if n != "ce")
    return DistillPass(zero, zero, zero.bool(), zero, zero.new_zeros(num_terms, 0),
                       zero if spec.accept_weight else None,
                       zero.new_zeros(len(temperatures), 0) if temperatures else None,
                       zero.new_zeros(0, top_k) if top_k else None,
                       labels_m.new_zeros(0, top_k) if top_k else None)


def distill_loss(hidden_bnph, targets, lm_head, gamma, chunk_size, block_valid_bn,
                  chunk_bytes, scale, top_k, weighting, dpace_alpha, spec, teacher,
                  temperatures) -> LossOutput:
    """:func:`dflash_loss` through the distribution pass. D-PACE's per-slot confidence is the
    slot's acceptance probability: q(y) = exp(-CE) for the label CE alone, the overlap
    sum min(p, q) as soon as a term compares distributions."""
    spec = spec or LossSpec()
    if teacher is None:
        raise ValueError(f"module.loss={spec.describe()} needs the target's distribution and "
                         "this batch carries none (see docs/capture.md, 'The target "
                         "distribution')")
    sel = targets.valid
    dpace = weighting == "dpace" and spec.needs_distribution  # confidence = the overlap
    head = distill_head_pass(hidden_bnph[sel], targets.labels[sel], lm_head, spec, teacher,
                             chunk_size=chunk_size, chunk_bytes=chunk_bytes, scale=scale,
                             top_k=top_k, temperatures=tuple(temperatures), need_overlap=dpace)
    nll = head.ce if not spec.needs_distribution else -head.overlap.clamp(min=1e-30).log()
    w = slot_weights(sel, nll, gamma, weighting, dpace_alpha)
    correct = torch.zeros_like(sel)
    correct[sel] = head.correct
    out = LossOutput((w * head.loss).sum(), w.sum(), correct, sel, block_valid_bn,
                     head.top_values, head.top_ids)
    names = [n for n, _ in spec.slot_terms if n != "ce"]
    out.term_sums = {n: (w * head.terms[i]).sum().detach() for i, n in enumerate(names)}
    if "ce" in dict(spec.slot_terms):
        out.term_sums["ce"] = (w * head.ce).sum().detach()
    blocks = block_valid_bn if block_valid_bn is not None else sel.any(-1)
    if spec.accept_weight:
        accepted = expected_accepted(on_slots(head.accept, sel), sel, blocks)
        out.accept_sum, out.accept_count = -accepted.sum(), sel.new_tensor(
            accepted.numel(), dtype=torch.float32)
    if temperatures:
        out.overlaps = {t: head.overlaps[i] for i, t in enumerate(temperatures)}
        out.expected_taus = {t: 1.0 + expected_accepted(on_slots(head.overlaps[i], sel), sel,
                                                          blocks).detach()
                             for i, t in enumerate(temperatures)}
    return out
