"""The target's distribution as a training signal: the loss zoo (``module.loss``: ``ce``,
``kl``, ``rkl``, ``jsd``, ``tv``, ``nla``, ``lk_hybrid``, ``accept``), one definition each, as
speculators 0.9.0's eager losses define them. Each loss is a :class:`Term` of column sums whose
``h = q * dL/dq`` the head pass (:mod:`dflash_lab.train.distill_head`) turns into
``dL/dz = h - q sum(h)`` (docs/losses.md, "The losses", "Implementation and cost").

Shape legend (vocab-major chunks, as the fused head pass holds them): V vocab, m rows of a chunk,
K teacher top-k, C loss terms. ``x_vm`` is [V, m]; ``x_m`` [m].
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_lab.model.layers import scale_logits
from dflash_lab.train.loss import slot_positions

#: Per-slot losses over the target distribution (``ce`` uses the label only).
DISTRIBUTION_LOSSES = ("kl", "rkl", "jsd", "tv", "nla", "lk_hybrid")
SLOT_LOSSES = ("ce", *DISTRIBUTION_LOSSES)
#: The block-level objective: minus the expected number of accepted drafts per block.
ACCEPT = "accept"
LOSS_NAMES = (*SLOT_LOSSES, ACCEPT)
#: speculators' spellings of our names (a refused name gets the hint)
PEER_NAMES = {"kl_div": "kl", "js": "jsd", "reverse_kl": "rkl"}
NLA_EPS = 1e-5  # speculators' clamp of the overlap in -log(alpha)
TINY = 1e-30  # floor of a bucket's probability where it divides


@dataclass(frozen=True)
class LossSpec:
    """``module.loss`` resolved: the weight of each non-zero term. ``label_temperature``: T_label
    of p = softmax(logits / T_label); ``lk_eta``: ``lk_hybrid``'s blend temperature;
    ``accept_temperature``: the ``accept`` objective's (0: greedy, whose smooth surrogate is
    q(y), the drafter's probability of the target's argmax)."""

    weights: tuple[tuple[str, float], ...] = (("ce", 1.0),)
    label_temperature: float = 1.0
    lk_eta: float = 3.0
    accept_temperature: float = 1.0

    @classmethod
    def create(cls, loss, label_temperature: float = 1.0, lk_eta: float = 3.0,
               accept_temperature: float = 1.0) -> LossSpec:
        """From a name (``"kl"``) or a mapping (``{"ce": 0.1, "tv": 0.9}``); ValueError naming
        the key and its close match for anything else."""
        if isinstance(loss, str):
            loss = {loss: 1.0}
        if not isinstance(loss, Mapping) or not loss:
            raise ValueError(f"module.loss={loss!r}: give a loss name ({list(LOSS_NAMES)}) or "
                             "a mapping of names to weights, e.g. module.loss='{ce: 0.1, tv: 0.9}'")
        weights = []
        for name, weight in loss.items():
            if name not in LOSS_NAMES:
                close = ([PEER_NAMES[name]] if name in PEER_NAMES
                         else difflib.get_close_matches(str(name), LOSS_NAMES, n=1))
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(f"module.loss: unknown loss '{name}'{hint}; known: "
                                 f"{list(LOSS_NAMES)} (dflash_lab/train/distill.py)")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                    math.isfinite(weight) and weight >= 0):
                raise ValueError(f"module.loss.{name}={weight!r}: a weight must be a finite "
                                 "number >= 0")
            if weight:
                weights.append((str(name), float(weight)))
        if not weights:
            raise ValueError(f"module.loss={dict(loss)}: every weight is 0, nothing to train")
        for key, value in (("label_temperature", label_temperature), ("lk_eta", lk_eta)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"module.{key}={value}: must be a finite number > 0")
        if not (math.isfinite(accept_temperature) and accept_temperature >= 0):
            raise ValueError(f"module.accept_temperature={accept_temperature}: must be >= 0 "
                             "(0 = greedy serving)")
        return cls(tuple(weights), float(label_temperature), float(lk_eta),
                   float(accept_temperature))

    @property
    def slot_terms(self) -> tuple[tuple[str, float], ...]:
        """The per-slot terms (everything but ``accept``)."""
        return tuple((n, w) for n, w in self.weights if n != ACCEPT)

    @property
    def accept_weight(self) -> float:
        return dict(self.weights).get(ACCEPT, 0.0)

    @property
    def ce_only(self) -> bool:
        """The default path: label CE alone (no teacher distribution needed)."""
        return self.weights == (("ce", self.weights[0][1]),) and self.weights[0][1] == 1.0

    @property
    def needs_distribution(self) -> bool:
        """Some term compares with the target's distribution (not ce, nor accept at T = 0: q(y))."""
        names = {n for n, _ in self.weights}
        return bool(names & set(DISTRIBUTION_LOSSES)) or (
            ACCEPT in names and self.accept_temperature > 0)

    def describe(self) -> str:
        """The spec as its override: ``{ce: 0.1, tv: 0.9}``."""
        return "{" + ", ".join(f"{n}: {w:g}" for n, w in self.weights) + "}"


# ------------------------------------------------------------------------------ the teacher
@dataclass
class Teacher:
    """The target's next-token distribution for M rows (valid slots), dense or sparse. Dense:
    ``hidden_mh`` [M, H], its final-normed last hidden state at the position BEFORE each slot
    (whose logits are the slot token's distribution), projected per chunk by the target head;
    ``softcap``: its ``final_logit_softcapping`` (Gemma). Sparse: ``top_ids_mk``,
    ``top_logprobs_mk`` [M, K] (T = 1, whole vocabulary, best first); the rest: the tail bucket."""

    hidden_mh: Tensor | None = None
    top_ids_mk: Tensor | None = None
    top_logprobs_mk: Tensor | None = None
    softcap: float | None = None

    @property
    def dense(self) -> bool:
        return self.hidden_mh is not None

    def rows(self, start: int, stop: int) -> Teacher:
        """The teacher of rows start..stop (views)."""
        if self.dense:
            return Teacher(self.hidden_mh[start:stop], softcap=self.softcap)
        return Teacher(None, self.top_ids_mk[start:stop], self.top_logprobs_mk[start:stop])


@dataclass
class Buckets:
    """Both distributions of a chunk over the same buckets: a slice of the vocabulary (dense:
    one bucket per token) or the teacher's K ids plus the tail (sparse: K + 1, the tail last).
    Each [B, m] fp32."""

    p: Tensor
    logp: Tensor
    q: Tensor
    logq: Tensor


def target_columns(teacher: Teacher, weight_vh: Tensor) -> Tensor:
    """The target head's columns [V, H] of a head's weight [V, H'], which the teacher's hidden
    state [m, H] multiplies: all of them (no view), or ConcatHead's first H (``[W_lm | w2]``)."""
    width = teacher.hidden_mh.shape[-1]
    return weight_vh if weight_vh.shape[1] == width else weight_vh[:, :width]


def teacher_logits(teacher: Teacher, weight_vh: Tensor) -> Tensor:
    """Dense teacher logits [V, m] fp32 of a chunk: the target head (and its softcap)."""
    weight_vh = target_columns(teacher, weight_vh)
    logits_vm = (weight_vh @ teacher.hidden_mh.to(weight_vh.dtype).t()).float()
    return scale_logits(logits_vm, 1.0, teacher.softcap)


def sparse_buckets(teacher: Teacher, logq_km: Tensor) -> Buckets:
    """K + 1 buckets: the teacher's top-k ids and the tail (the mass of every other token).
    ``logq_km``: the drafter's log-probabilities of the K ids [K, m]."""
    logp_k = teacher.top_logprobs_mk.t().float()
    p_k, q_k = logp_k.exp(), logq_km.exp()
    p_tail = (1.0 - p_k.sum(0, keepdim=True)).clamp(min=0.0)
    q_tail = (1.0 - q_k.sum(0, keepdim=True)).clamp(min=0.0)
    p, q = torch.cat([p_k, p_tail]), torch.cat([q_k, q_tail])
    logp = torch.cat([logp_k, p_tail.clamp(min=TINY).log()])
    return Buckets(p, logp, q, torch.cat([logq_km, q_tail.clamp(min=TINY).log()]))


# ------------------------------------------------------------------------------ the losses
# Every loss is a function of a few sums over the buckets (``SUMS``: each a sum of per-bucket
# terms, so a pass over vocabulary slices adds them up), and its ``h = q dL/dq`` of a bucket is
# a function of that bucket and those totals. A :class:`Term` says which sums it reads, its
# value [m] from their totals, and its h [B, m] on any set of buckets given the totals.
def _logm(b: Buckets) -> Tensor:
    """log m, m = (p + q) / 2 (JSD's midpoint)."""
    return torch.logaddexp(b.logp, b.logq) - math.log(2.0)


def overlap(b: Buckets) -> Tensor:
    """The acceptance probability of rejection sampling, sum_v min(p_v, q_v) [m]."""
    return torch.minimum(b.p, b.q).sum(0)


SUMS = {
    "kl": lambda b: (b.p * (b.logp - b.logq)).sum(0),  # KL(p || q)
    "rkl": lambda b: (b.q * (b.logq - b.logp)).sum(0),  # KL(q || p)
    "jsd": lambda b: 0.5 * ((b.p * (b.logp - _logm(b))).sum(0)
                            + (b.q * (b.logq - _logm(b))).sum(0)),
    "overlap": overlap,  # alpha = sum min(p, q)
}


def below(b: Buckets) -> Tensor:
    """h of -sum min(p, q): -q where q < p (where they tie, torch.minimum's backward splits the
    gradient in half; ties of float probabilities do not occur in practice)."""
    return -(b.q * (b.q < b.p))


def _lam(alpha: Tensor, eta: float) -> Tensor:
    """lk_hybrid's blend lam = exp(-eta alpha), alpha detached (it sets the mix only)."""
    return torch.exp(-eta * alpha)


@dataclass(frozen=True)
class Term:
    """One per-slot loss: ``needs`` (names of ``SUMS``), ``value(totals, eta)`` [m] and
    ``h(buckets, totals, eta)`` [B, m] = q dL/dq of those buckets (finite where q underflows);
    ``h_reads_totals``: h needs the totals (so a pass must gather them first)."""

    needs: tuple[str, ...]
    value: Callable[[dict, float], Tensor]
    h: Callable[[Buckets, dict, float], Tensor]
    h_reads_totals: bool = False


LOSSES = {
    # KL(p || q); h = q dKL/dq = -p
    "kl": Term(("kl",), lambda s, e: s["kl"], lambda b, s, e: -b.p),
    # KL(q || p); h = q (log q - log p + 1)
    "rkl": Term(("rkl",), lambda s, e: s["rkl"], lambda b, s, e: b.q * (b.logq - b.logp + 1.0)),
    # JSD; h = q * 0.5 log(q / m)
    "jsd": Term(("jsd",), lambda s, e: s["jsd"], lambda b, s, e: 0.5 * b.q * (b.logq - _logm(b))),
    # TV = 1 - alpha; h = -q [q < p]
    "tv": Term(("overlap",), lambda s, e: 1.0 - s["overlap"], lambda b, s, e: below(b)),
    # NLA = -log max(alpha, 1e-5); h = -q [q < p] / alpha (0 where the clamp holds)
    "nla": Term(("overlap",), lambda s, e: -s["overlap"].clamp(min=NLA_EPS).log(),
                lambda b, s, e: below(b) * ((s["overlap"] >= NLA_EPS)
                                            / s["overlap"].clamp(min=NLA_EPS)),
                h_reads_totals=True),
    # lam KL + (1 - lam) TV
    "lk_hybrid": Term(
        ("kl", "overlap"),
        lambda s, e: (_lam(s["overlap"], e) * s["kl"]
                      + (1.0 - _lam(s["overlap"], e)) * (1.0 - s["overlap"])),
        lambda b, s, e: (_lam(s["overlap"], e) * -b.p
                         + (1.0 - _lam(s["overlap"], e)) * below(b)), h_reads_totals=True),
}


def sums_needed(spec: LossSpec) -> tuple[str, ...]:
    """The ``SUMS`` the spec's distribution terms read at T_label (in a fixed order)."""
    names = {n for name, _ in spec.slot_terms if name != "ce" for n in LOSSES[name].needs}
    return tuple(n for n in SUMS if n in names)


def term_values(spec: LossSpec, totals: dict, like_m: Tensor) -> tuple[Tensor, Tensor]:
    """Each distribution term's value [C, m] and their weighted mix [m] (no ce; zeros like
    ``like_m`` when the spec has no distribution term)."""
    named = [(LOSSES[n].value(totals, spec.lk_eta), w) for n, w in spec.slot_terms if n != "ce"]
    if not named:
        return like_m.new_zeros(0, like_m.shape[0]), torch.zeros_like(like_m)
    return torch.stack([v for v, _ in named]), sum(w * v for v, w in named)


def term_h(spec: LossSpec, b: Buckets, totals: dict) -> Tensor | None:
    """h = q dL/dq [B, m] of the weighted mix of the distribution terms on buckets ``b``."""
    out = None
    for name, weight in spec.slot_terms:
        if name == "ce":
            continue
        h = LOSSES[name].h(b, totals, spec.lk_eta)
        h = h if weight == 1.0 else h * weight
        out = h if out is None else out.add_(h)
    return out


# ------------------------------------------------------------------------------ acceptance
def chain(alpha_bnp: Tensor, valid_bnp: Tensor, first_slot: int = 1) -> Tensor:
    """P_t = prod over slots first_slot..t of alpha (an invalid slot ends the chain)
    [Bt, N, B - first_slot] (``first_slot`` 0 with sample_from_anchor)."""
    a_bnp, ok_bnp = alpha_bnp[..., first_slot:], valid_bnp[..., first_slot:]
    return torch.cumprod(torch.where(ok_bnp, a_bnp, torch.zeros_like(a_bnp)), dim=-1)


def on_slots(values_m: Tensor, valid_bnp: Tensor) -> Tensor:
    """[M] values of the valid slots (row-major) -> [Bt, N, B], 0 elsewhere; differentiable."""
    return values_m.new_zeros(valid_bnp.shape).masked_scatter(valid_bnp, values_m)


def expected_accepted(alpha_bnp: Tensor, valid_bnp: Tensor, block_valid_bn: Tensor,
                      first_slot: int = 1) -> Tensor:
    """Expected number of accepted drafts of each real block [K]: sum_t P_t. Drafts are accepted
    left to right until the first rejection, so with per-slot acceptance probabilities alpha_t
    (rejection sampling: sum min(p_t, q_t)) slot t passes with P_t = alpha_1 ... alpha_t and the
    expected tau is 1 + sum_t P_t. Differentiable in alpha (``accept``); at alpha in {0, 1}:
    :func:`~dflash_lab.train.loss.acceptance_lengths` minus one."""
    return chain(alpha_bnp, valid_bnp, first_slot).sum(-1)[block_valid_bn]


# ------------------------------------------------------------------------------ wiring
#: The capture option that keeps the target distribution (named in every refusal).
CAPTURE_OPTION = "capture.distribution=[last_hidden]"


def teacher_kind(spec: LossSpec, available: Mapping | None, temperatures, where: str,
                 also: str | None = None) -> str:
    """Which teacher a run uses: ``dense`` (the last hidden state: exact, every temperature),
    ``sparse`` (top-k: T = 1 only) or ``none`` (no distribution, temperature or ``also``, another
    setting needing it, named); else a ValueError naming the option to rerun with."""
    available = dict(available or {})
    need = spec.needs_distribution or bool(temperatures) or also is not None
    if not need:
        return "none"
    what = (f"module.loss={spec.describe()}" if spec.needs_distribution
            else also or f"module.val_temperatures={list(temperatures)}")
    if available.get("last_hidden"):
        return "dense"
    if not available.get("topk"):
        raise ValueError(f"{what} needs the target's next-token distribution, but {where} holds "
                         f"its argmax labels only: recapture with {CAPTURE_OPTION} (exact) or "
                         "capture.distribution=[topk], or train on online data (data=online); "
                         "module.loss=ce needs neither")
    temps = {spec.label_temperature, *(float(t) for t in temperatures)}
    if spec.accept_weight:
        temps.add(spec.accept_temperature)
    if temps - {0.0, 1.0}:
        raise ValueError(f"{where} holds the target's top-k at T = 1 only (its tail cannot be "
                         f"re-tempered), but temperatures {sorted(temps - {0.0, 1.0})} are asked "
                         f"(module.label_temperature, accept_temperature, val_temperatures): "
                         f"recapture with {CAPTURE_OPTION}, or use T = 1")
    return "sparse"


def slot_teacher(kind: str, batch: Mapping[str, Tensor], anchors_bn: Tensor,
                 valid_bnp: Tensor, softcap: float | None, label_shift: int = 0) -> Teacher | None:
    """The teacher of the valid slots (row-major) of a batch. Slot t of the block anchored at a
    predicts the token at p = a + t + label_shift (loss.py ``slot_positions``), which the target
    distributes after reading <= p - 1: the teacher is its output at p - 1 (the argmax labels'
    alignment, loss.py ``token_targets``)."""
    if kind == "none":
        return None
    pos_bnp = slot_positions(anchors_bn, valid_bnp.shape[-1], label_shift)
    rows_m = valid_bnp.nonzero(as_tuple=True)[0]
    before_m = (pos_bnp - 1)[valid_bnp]
    if kind == "dense":
        return Teacher(batch["target_last_hidden"][rows_m, before_m], softcap=softcap)
    return Teacher(None, batch["target_top_ids"][rows_m, before_m].long(),
                   batch["target_top_logprobs"][rows_m, before_m].float())


def resolve_val_temperatures(given, available: Mapping | None) -> tuple[float, ...]:
    """``module.val_temperatures``: null logs ``val/tau_T1`` whenever the data carries the
    target distribution (and nothing otherwise); a list is what is asked (refused by
    :func:`teacher_kind` when the data cannot give it)."""
    if given is None:
        held = dict(available or {})
        return (1.0,) if held.get("last_hidden") or held.get("topk") else ()
    temps = tuple(float(t) for t in given)
    bad = [t for t in temps if not (math.isfinite(t) and t >= 0)]
    if bad:
        raise ValueError(f"module.val_temperatures={list(given)}: temperatures must be >= 0")
    return temps


# ------------------------------------------------------------------------------ candidates
def candidate_logprobs(teacher: Teacher, ids_mk: Tensor, lm_head, temperature: float = 1.0,
                       renormalise: bool = True, chunk_rows: int = 256) -> Tensor:
    """The target's log-probabilities of K candidate tokens per row [M, K] fp32 (no grad),
    ``renormalise``d over the K (the DFlash 2 selector's K-way target) or over the vocabulary
    (what rejection sampling compares; a dense teacher runs one chunked pass for the
    normaliser). A sparse teacher (T = 1) gives a candidate outside its top-k tail / (V - k)."""
    with torch.no_grad():
        if teacher.dense:
            logp = _dense_candidates(teacher, ids_mk, lm_head, temperature, renormalise,
                                     chunk_rows)
        else:
            vocab = lm_head.weight.shape[0]
            top_ids, top_lp = teacher.top_ids_mk.long(), teacher.top_logprobs_mk.float()
            tail = (1.0 - top_lp.exp().sum(-1, keepdim=True)).clamp(min=TINY)
            share = (tail / max(1, vocab - top_ids.shape[1])).log()
            hit = ids_mk[..., None] == top_ids[:, None, :]  # [M, K, k]
            found = (top_lp[:, None, :] * hit).sum(-1)
            logp = torch.where(hit.any(-1), found, share.expand_as(found))
        return logp.log_softmax(-1) if renormalise else logp


def _dense_candidates(teacher, ids_mk, lm_head, temperature, renormalise, chunk_rows):
    weight = target_columns(teacher, lm_head.weight)
    out = []
    for start in range(0, ids_mk.shape[0], chunk_rows):
        h = teacher.hidden_mh[start:start + chunk_rows].to(weight.dtype)
        ids = ids_mk[start:start + chunk_rows]
        picked = torch.einsum("mh,mkh->mk", h, weight[ids]).float()
        picked = scale_logits(picked, 1.0, teacher.softcap) / temperature
        if not renormalise:
            full = scale_logits((h @ weight.t()).float(), 1.0, teacher.softcap)
            picked = picked - torch.logsumexp(full / temperature, dim=-1, keepdim=True)
        out.append(picked)
    return torch.cat(out) if out else ids_mk.new_zeros(ids_mk.shape, dtype=torch.float32)
