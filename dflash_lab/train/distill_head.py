"""The head pass of the distribution losses: one chunked pass over the vocabulary per step.
:func:`distill_head_pass` is :func:`~dflash_lab.train.loss.chunked_head_pass` for a
:class:`~dflash_lab.train.distill.LossSpec` with terms beyond the label CE; nothing [M, V] is
held, and a chunk takes as many rows as its :func:`distill_buffers` fp32 [V, m] buffers allow
within the CE pass's bytes (docs/losses.md, "Implementation and cost"; docs/benchmarks.md, 6b).

Shape legend: M rows (valid slots), H hidden, V vocab, K top-k, m rows of a chunk, T the number
of asked temperatures. Vocab-major chunks ``x_vm`` [V, m] as in the CE pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dflash_lab.model.layers import vocab_topk
from dflash_lab.train.distill import (
    LOSSES,
    SUMS,
    TINY,
    Buckets,
    LossSpec,
    Teacher,
    below,
    expected_accepted,
    on_slots,
    sparse_buckets,
    sums_needed,
    teacher_logits,
    term_h,
    term_values,
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

#: Every pass over a chunk walks the vocabulary in this many slices: its elementwise work
#: (softmaxes at each temperature, the loss sums, h, dL/dz) runs on [V / VOCAB_SLICES, m]
#: temporaries (cache-sized), never on more [V, m] buffers than :func:`distill_buffers` counts.
VOCAB_SLICES = 32


def distill_buffers(spec: LossSpec, dense: bool) -> int:
    """fp32 [V, m] buffers a chunk holds at once, where the CE pass holds one (the logits): the
    drafter's logits (a sparse teacher's dL/dz is written over them), a dense teacher's logits
    (over which h, then dL/dz, is written) and the accept objective's own dL/dz. The slice
    temporaries (a few [V / VOCAB_SLICES, m]) and the head-dtype product before its fp32 cast
    (as in the CE pass) come on top. Rows per chunk: the CE pass's rows over this."""
    return 1 + int(dense) + int(bool(spec.accept_weight))


@dataclass
class DistillPass:
    """Per-row results [M] of the distribution head pass. ``loss``: the spec's slot terms' weight
    x value (ce included), differentiable; ``accept``: each slot's acceptance probability at
    ``spec.accept_temperature`` (differentiable; with ``accept`` only); ``ce``, ``correct``: the
    label CE and whether the label is the max; ``overlap``: sum min(p, q) at T_label (D-PACE's
    confidence; zeros unless ``need_overlap``); ``terms`` [C, M]: each distribution term's value;
    ``overlaps`` [T, M]: acceptance at each asked temperature (0: the greedy match);
    ``top_values`` / ``top_ids`` [M, K]: the unary top-K when asked."""

    loss: Tensor
    ce: Tensor
    correct: Tensor
    overlap: Tensor
    terms: Tensor
    accept: Tensor | None = None
    overlaps: Tensor | None = None
    top_values: Tensor | None = None
    top_ids: Tensor | None = None


class _Side:
    """One distribution's logits [V, m] fp32 (the drafter's scaled unary logits or a dense
    teacher's), their column max, and their log-normaliser per temperature (one slice pass
    each, cached): log-probabilities of any vocabulary slice without a [V, m] softmax."""

    def __init__(self, x_vm: Tensor):
        self.x, self.max, self._lse = x_vm, x_vm.amax(dim=0), {}
        step = -(-x_vm.shape[0] // VOCAB_SLICES)
        self.slices = [slice(i, i + step) for i in range(0, x_vm.shape[0], step)]

    def lse(self, temp: float) -> Tensor:
        """log sum_v exp(x_v / temp) [m]."""
        if temp not in self._lse:
            total = 0.0
            for s in self.slices:
                shifted = self.x[s] - self.max
                total = total + (shifted if temp == 1.0 else shifted.div_(temp)).exp_().sum(0)
            self._lse[temp] = self.max / temp + total.log()
        return self._lse[temp]

    def logprobs(self, rows, temp: float) -> Tensor:
        """log softmax(x / temp) of some rows (a slice, or gathered [K, m] values)."""
        x = self.x[rows] if isinstance(rows, slice) else rows
        return (x if temp == 1.0 else x / temp) - self.lse(temp)


@dataclass
class _Chunk:
    """What the passes of one chunk share: the drafter side ``z``, the dense teacher side ``t``
    (None for a sparse teacher), the sparse teacher, the labels and their scaled logits."""

    z: _Side
    t: _Side | None
    teacher: Teacher
    labels_m: Tensor
    picked_m: Tensor

    def buckets(self, rows: slice | None, key: tuple[float, float]) -> Buckets:
        """p at the teacher's temperature, q at the drafter's (``key``), over a vocabulary
        slice (dense) or the teacher's K + 1 buckets (sparse, ``rows`` None, T = 1)."""
        tp, tq = key
        if self.t is None:
            ids_km = self.teacher.top_ids_mk.t().long()
            return sparse_buckets(self.teacher, self.z.logprobs(self.z.x.gather(0, ids_km), tq))
        logp, logq = self.t.logprobs(rows, tp), self.z.logprobs(rows, tq)
        return Buckets(logp.exp(), logp, logq.exp(), logq)

    def parts(self):
        """The vocabulary slices a pass walks (one pass over the K + 1 sparse buckets)."""
        return self.z.slices if self.t is not None else [None]


def _sweep(chunk: _Chunk, spec: LossSpec, needs: dict, jobs: list, totals: dict | None = None):
    """One walk over the chunk's vocabulary slices (or its K + 1 sparse buckets), building each
    slice's buckets once per temperature pair for both of its jobs:

    - the totals [m] of the sums ``needs`` names, ``{(T_teacher, T_drafter): {name: total}}``;
    - for each job ``(name, key, into)`` ("loss" or "accept"), its h = q dL/dq: dense, each
      slice's h is written into ``into`` (after every read of that slice's logits) and its
      column sum returned as ``hsums[name]``; sparse, ``hsums[name]`` is
      ``h_tail / q_tail - sum(h)`` (a tail token's dL/dz is q_v times it) and
      ``hsums[name + "_ids"]`` the K ids' own dL/dz, ``h_k - q_k sum(h)``.

    h that reads totals (nla, lk_hybrid) takes them from ``totals`` (a second sweep); any other
    h runs in the sweep that gathers the totals."""
    new, hsums = {key: {} for key in needs}, {}
    for rows in chunk.parts():
        built = {}
        for key, names in needs.items():
            b = built[key] = chunk.buckets(rows, key)
            for name in names:
                part = SUMS[name](b)
                new[key][name] = part if name not in new[key] else new[key][name] + part
        stored = []
        for name, key, into in jobs:
            b = built[key] if key in built else built.setdefault(key, chunk.buckets(rows, key))
            h = term_h(spec, b, (totals or new)[key]) if name == "loss" else -below(b)
            total = h.sum(0)
            if rows is None:
                hsums[name] = h[-1] / b.q[-1].clamp(min=TINY) - total
                hsums[name + "_ids"] = h[:-1] - b.q[:-1] * total
                continue
            hsums[name] = total if name not in hsums else hsums[name] + total
            stored.append((into, h))
        for into, h in stored:
            into[rows] = h
    return new, hsums


def _needs(spec: LossSpec, temperatures, need_overlap: bool) -> dict:
    """Which sums each temperature pair needs: the terms' (and D-PACE's overlap) at
    (T_label, 1), the overlap at each serving temperature (T, T) > 0."""
    needs = {}
    label = set(sums_needed(spec)) | ({"overlap"} if need_overlap else set())
    if label:
        needs[(spec.label_temperature, 1.0)] = label
    served = [*temperatures, *([spec.accept_temperature] if spec.accept_weight else [])]
    for t in served:
        if t > 0:
            needs.setdefault((t, t), set()).add("overlap")
    return needs


def _greedy_overlap(chunk: _Chunk) -> Tensor:
    """T = 0: a slot is accepted when the drafter's argmax is the target's argmax [m] (0/1)."""
    draft = chunk.z.x.argmax(0)
    target = (chunk.t.x.argmax(0) if chunk.t is not None
              else chunk.teacher.top_ids_mk[:, 0].long())
    return (draft == target).float()


def _chunk(h_mh: Tensor, labels_m: Tensor, weight_vh: Tensor, scale: LogitScale, top_k: int,
           spec: LossSpec, teacher: Teacher, temperatures: tuple[float, ...], want_grad: bool,
           need_overlap: bool = True):
    """Every per-row output of one chunk, and (when ``want_grad``) the gradients of ``loss``
    and ``accept`` to the chunk's raw logits [V, m] fp32 (:func:`_logit_grads`; else None)."""
    logits_vm = (weight_vh @ h_mh.t()).float()
    if not scale.identity:
        scale.apply_(logits_vm)
    tops = tuple(t.t() for t in vocab_topk(logits_vm, top_k, dim=0)) if top_k else None
    z = _Side(logits_vm)
    picked = logits_vm.gather(0, labels_m[None])[0]
    ce_m, correct_m = z.lse(1.0) - picked, picked >= z.max
    t = _Side(teacher_logits(teacher, weight_vh)) if teacher.dense else None
    chunk = _Chunk(z, t, teacher, labels_m, picked)
    greedy = _greedy_overlap(chunk) if 0.0 in temperatures else None  # before h overwrites t
    label, tau = (spec.label_temperature, 1.0), spec.accept_temperature
    jobs, out, acc = [], None, None
    if want_grad:
        out = t.x if t is not None else z.x  # dL/dz is written over these logits
        acc = torch.empty_like(z.x) if spec.accept_weight else None
        jobs = ([("loss", label, out)] if any(n != "ce" for n, _ in spec.slot_terms) else []) + (
            [("accept", (tau, tau), acc)] if spec.accept_weight and tau > 0 else [])
    needs = _needs(spec, temperatures, need_overlap)
    late = any(LOSSES[n].h_reads_totals for n, _ in spec.slot_terms if n != "ce")
    totals, hsums = _sweep(chunk, spec, needs, [] if late else jobs)
    if late and jobs:
        hsums = _sweep(chunk, spec, {}, jobs, totals)[1]
    terms_cm, dist_m = term_values(spec, totals.get(label, {}), ce_m)
    ce_weight = dict(spec.slot_terms).get("ce", 0.0)
    accept_m = None
    if spec.accept_weight:
        accept_m = (totals[(tau, tau)]["overlap"] if tau > 0  # T = 0: the surrogate q(y)
                    else (picked - z.lse(1.0)).exp())
    overlaps = [greedy if t == 0 else totals[(t, t)]["overlap"] for t in temperatures]
    overlap_m = totals[label]["overlap"] if need_overlap else ce_m.new_zeros(ce_m.shape)
    grads = (_logit_grads(chunk, spec, hsums, ce_weight, accept_m, scale, out, acc)
             if want_grad else (None, None))
    outs = (dist_m + ce_weight * ce_m, ce_m, correct_m, overlap_m, terms_cm, accept_m,
            torch.stack(overlaps) if overlaps else None, *(tops or (None, None)))
    return outs, grads


def _logit_grads(chunk: _Chunk, spec: LossSpec, hsums: dict, ce_weight: float,
                 accept_m: Tensor | None, scale: LogitScale, out: Tensor,
                 acc: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """dL/dz and d(accept)/dz [V, m] of the chunk (z: the raw head logits, through the scale),
    written over ``out`` (the teacher's logits, where h was stored, or a sparse teacher's
    drafter logits) and into ``acc``. Every loss's ``dL/dz_v = q_v (g_v - sum_u q_u g_u)``
    with g = dL/dq is ``h_v - q_v sum(h)`` in h = q g (:func:`_sweep` gathers h and its sum,
    this walk writes dL/dz)."""
    z, tau = chunk.z, spec.accept_temperature
    dist, served = "loss" in hsums, spec.accept_weight and tau > 0
    ids = None if chunk.t is not None else chunk.teacher.top_ids_mk.t().long()
    at_ids = None if ids is None else z.x.gather(0, ids)  # before z is written over
    for rows in z.slices:
        zs = z.x[rows]
        q1 = z.logprobs(rows, 1.0).exp_()
        g = q1 * ce_weight if ce_weight else torch.zeros_like(q1)
        if dist:  # dense: h was stored in ``out``; sparse: a tail token's g is the tail's
            g = (g.add_(out[rows]).sub_(q1 * hsums["loss"]) if ids is None
                 else g.add_(q1 * hsums["loss"]))
        if acc is not None:
            if not served:  # T = 0: d q_y / dz = q_y (onehot - q)
                ga = -q1 * accept_m
            else:
                qa = q1 if tau == 1.0 else z.logprobs(rows, tau).exp_()
                ga = (acc[rows] - qa * hsums["accept"] if ids is None
                      else qa * hsums["accept"]).div_(tau)
            acc[rows] = ga if scale.identity else ga.mul_(scale.derivative_at(zs))
        out[rows] = g if scale.identity else g.mul_(scale.derivative_at(zs))
    if ids is not None:  # the K ids take their own dL/dz (and the CE's share)
        at_deriv = scale.derivative_at(at_ids)
        if dist:
            q_k = z.logprobs(at_ids, 1.0).exp_()
            out.scatter_(0, ids, (hsums["loss_ids"] + ce_weight * q_k) * at_deriv)
        if served:
            acc.scatter_(0, ids, hsums["accept_ids"] / tau * at_deriv)
    picked_deriv = scale.derivative_at(chunk.picked_m)
    if ce_weight:
        out.scatter_add_(0, chunk.labels_m[None],
                         (torch.full_like(chunk.picked_m, -ce_weight) * picked_deriv)[None])
    if acc is not None and not served:
        acc.scatter_add_(0, chunk.labels_m[None], (accept_m * picked_deriv)[None])
    return out, acc


def _passes(hidden_mh, labels_m, weight_vh, rows, scale, top_k, spec, teacher, temperatures,
            want_grad, need_overlap=True):
    """Run every chunk; returns (outputs as DistillPass fields, the gradients of ``loss`` and
    ``accept`` to each chunk's hidden states [m, H])."""
    outs, grads = [], []
    for start in range(0, hidden_mh.shape[0], rows):
        stop = start + rows
        o, g = _chunk(hidden_mh[start:stop], labels_m[start:stop], weight_vh, scale, top_k,
                      spec, teacher.rows(start, stop), temperatures, want_grad, need_overlap)
        outs.append(o)
        grads.append([None if x is None else x.t().to(weight_vh.dtype) @ weight_vh for x in g])
    cols = list(zip(*outs, strict=True))
    dims = (0, 0, 0, 0, 1, 0, 1, 0, 0)  # terms [C, m] and overlaps [T, m] join on rows
    return [None if c[0] is None else torch.cat(c, dim=d)
            for c, d in zip(cols, dims, strict=True)], grads


class _FusedDistill(torch.autograd.Function):
    """The pass with gradients: ``loss`` and ``accept`` [M] are differentiable in the hidden
    states; their gradients [M, H] are computed in forward and scaled by the incoming per-row
    gradients in backward (the CE pass's scheme). A head weight that requires grad (ConcatHead's
    trainable columns) gets its own in backward (:func:`_weight_grad`); a frozen one costs
    nothing more (no recompute, nothing more saved)."""

    @staticmethod
    def forward(ctx, hidden_mh, labels_m, weight_vh, rows, scale, top_k, spec, teacher,
                temperatures, need_overlap):
        fields, grads = _passes(hidden_mh, labels_m, weight_vh, rows, scale, top_k, spec,
                                teacher, temperatures, True, need_overlap)
        loss_grad = torch.cat([g[0] for g in grads])
        accept_grad = torch.cat([g[1] for g in grads]) if spec.accept_weight else None
        inputs = (hidden_mh, labels_m, weight_vh) if ctx.needs_input_grad[2] else ()
        ctx.save_for_backward(loss_grad, accept_grad, *inputs)
        ctx.args = (rows, scale, spec, teacher)
        accept = fields[5] if fields[5] is not None else hidden_mh.new_zeros(0)
        rest = [f if f is not None else hidden_mh.new_zeros(0) for f in fields[1:5] + fields[6:]]
        ctx.mark_non_differentiable(*rest)
        return fields[0], accept, *rest

    @staticmethod
    def backward(ctx, grad_loss, grad_accept, *_rest):
        loss_grad, accept_grad, *inputs = ctx.saved_tensors
        if accept_grad is None or grad_accept is None or not grad_accept.numel():
            grad_accept = None
        grad = loss_grad * grad_loss[:, None].to(loss_grad.dtype)
        if grad_accept is not None:
            grad = grad + accept_grad * grad_accept[:, None].to(accept_grad.dtype)
        weight = _weight_grad(*inputs, *ctx.args, grad_loss, grad_accept) if inputs else None
        return grad, None, weight, None, None, None, None, None, None, None


@torch.no_grad()
def _weight_grad(hidden_mh, labels_m, weight_vh, rows, scale, spec, teacher, grad_loss_m,
                 grad_accept_m) -> Tensor:
    """d/dW [V, H] of sum_m (grad_loss_m loss_m + grad_accept_m accept_m): each chunk's logit
    gradients [V, m] recomputed as forward made them (nothing [M, V] held), their columns scaled
    by the rows' incoming gradients, times the chunk's hidden states [m, H]."""
    grad_vh = torch.zeros_like(weight_vh)
    for start in range(0, hidden_mh.shape[0], rows):
        part = slice(start, start + rows)
        _, (g_vm, acc_vm) = _chunk(hidden_mh[part], labels_m[part], weight_vh, scale, 0, spec,
                                   teacher.rows(start, start + rows), (), True, False)
        g_vm.mul_(grad_loss_m[None, part])
        if grad_accept_m is not None:
            g_vm.add_(acc_vm.mul_(grad_accept_m[None, part]))
        grad_vh.addmm_(g_vm.to(weight_vh.dtype), hidden_mh[part])
    return grad_vh


def distill_rows(num_rows: int, vocab_size: int, chunk_size: int | None, chunk_bytes: int,
                 buffers: int) -> int:
    """Rows per chunk: the CE pass's rows for these M rows, over the chunk's ``buffers``."""
    ce_rows = min(num_rows, ce_chunk_rows(vocab_size, chunk_size, chunk_bytes))
    rows = max(1, ce_rows // buffers)
    chunks = -(-num_rows // rows)
    return -(-num_rows // chunks)  # balanced: no last chunk of a few rows


def distill_head_pass(hidden_mh: Tensor, labels_m: Tensor, lm_head: nn.Module, spec: LossSpec,
                      teacher: Teacher, *, chunk_size: int | None = None,
                      chunk_bytes: int = CE_CHUNK_BYTES, scale: LogitScale = NO_SCALE,
                      top_k: int = 0, temperatures: tuple[float, ...] = (),
                      need_overlap: bool = True) -> DistillPass:
    """The distribution losses, label CE, overlaps and top-K of M rows in one chunked pass.
    ``teacher``: the rows' target distribution; ``temperatures``: where ``overlaps`` are measured.
    The head: a bias-free map ``x @ weight.T`` (an nn.Linear, or ``linear_map`` set as on
    ConcatHead, whose trainable columns get their gradient); anything else: ValueError naming it."""
    weight = getattr(lm_head, "weight", None)
    linear = isinstance(lm_head, nn.Linear) or getattr(lm_head, "linear_map", False)
    if not (linear and getattr(lm_head, "bias", None) is None and isinstance(weight, Tensor)):
        raise ValueError(f"module.loss={spec.describe()}: the distribution losses need a "
                         f"bias-free linear LM head (the target's, or a ConcatHead), got "
                         f"{type(lm_head).__name__}; use module.loss=ce")
    hidden_mh = into_head_dtype(hidden_mh, lm_head)
    temperatures = tuple(float(t) for t in temperatures)
    if hidden_mh.shape[0] == 0:
        return _empty(hidden_mh, labels_m, spec, top_k, temperatures)
    rows = distill_rows(hidden_mh.shape[0], _vocab_size(lm_head), chunk_size, chunk_bytes,
                        distill_buffers(spec, teacher.dense))
    if torch.is_grad_enabled() and (hidden_mh.requires_grad or weight.requires_grad):
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
    return DistillPass(*fields)  # _passes returns them in DistillPass's field order


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
    """objective.dflash_loss through the distribution pass. D-PACE's per-slot confidence is the
    acceptance probability: q(y) = exp(-CE) for CE alone, else the overlap sum min(p, q)."""
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
    first = targets.first_slot
    w = slot_weights(sel, nll, gamma, weighting, dpace_alpha, first)
    correct = torch.zeros_like(sel)
    correct[sel] = head.correct
    out = LossOutput((w * head.loss).sum(), w.sum(), correct, sel, block_valid_bn,
                     head.top_values, head.top_ids, first_slot=first, slot_ce=head.ce.detach())
    names = [n for n, _ in spec.slot_terms if n != "ce"]
    out.term_sums = {n: (w * head.terms[i]).sum().detach() for i, n in enumerate(names)}
    if "ce" in dict(spec.slot_terms):
        out.term_sums["ce"] = (w * head.ce).sum().detach()
    blocks = block_valid_bn if block_valid_bn is not None else sel.any(-1)
    if spec.accept_weight:
        accepted = expected_accepted(on_slots(head.accept, sel), sel, blocks, first)
        out.accept_sum, out.accept_count = -accepted.sum(), sel.new_tensor(
            accepted.numel(), dtype=torch.float32)
    if temperatures:
        out.overlaps = {t: head.overlaps[i] for i, t in enumerate(temperatures)}
        out.expected_taus = {t: 1.0 + expected_accepted(on_slots(head.overlaps[i], sel), sel,
                                                          blocks, first).detach()
                             for i, t in enumerate(temperatures)}
    return out
