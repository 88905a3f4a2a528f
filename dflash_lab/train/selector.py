"""DFlash 2 training: the selector loss, its alpha schedule and the selector metrics.

The objective of a DFlash 2 drafter (dflash.md section 7) is the unary DFlash loss plus
``alpha(step)`` x a K-way cross-entropy of the candidate selector over the unary top-K of each
valid slot, teacher-forced: slot t's predecessor is the TRUE previous token (the anchor token for
slot 1, the label of slot t-1 after). Slot weights follow the unary ones (``exp(-(t-1)/gamma)``,
or D-PACE from the selector's own CE with ``module.position_weighting=dpace``), and
the selector term is normalised by the GLOBAL sum of the weights of the slots it trains (with
``missing_gold: swap`` that is every valid slot, as for the unary term; with ``exclude`` only
the slots whose gold token is among the K), so it is a weighted mean of a K-way CE whatever the
recall.

Metrics: candidate recall@K (gold among the unary top-K), selector accuracy (teacher-forced
argmax over the serving candidates == gold), and three exact acceptance lengths per block:
selector path (the greedy walk on its OWN previous picks, :meth:`CandidateSelector.walk`, what
serving gets), unary (the unary argmax) and oracle (a slot counts when gold is a candidate).

Shape legend: Bt batch, N blocks, B block size, T = B-1 drafted slots, H hidden, M valid slots,
K candidates (selector_top_k). Suffix letters (``x_bnph``): docs/architecture.md; ``b`` is the
batch, ``p`` a position in a block.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.model.dflash2 import CandidateSelector
from dflash_lab.train.distill import candidate_logprobs, expected_accepted, on_slots
from dflash_lab.train.loss import (
    CE_CHUNK_BYTES,
    NO_SCALE,
    BlockTargets,
    LogitScale,
    LossOutput,
    acceptance_lengths,
    candidate_logits,
    slot_weights,
)

MISSING_GOLD = ("exclude", "swap")


def refuse_selector_settings(settings: SelectorSettings, variant: str) -> None:
    """A drafter without a candidate selector refuses any non-default ``module.selector``
    value (it would silently do nothing)."""
    if settings != SelectorSettings():
        changed = {k: v for k, v in asdict(settings).items()
                   if v != getattr(SelectorSettings(), k)}
        raise ValueError(f"module.selector {changed}: only DFlash 2 drafters have a "
                         f"candidate selector, this drafter is variant='{variant}'; use "
                         "drafter=dflash2 (conf/drafter/dflash2.yaml) or drop the override")
#: ``module.selector.target``: what the K-way selector loss learns
SELECTOR_TARGETS = ("argmax", "distribution")


@dataclass(frozen=True)
class SelectorSettings:
    """``module.selector`` (conf/module/default.yaml).

    alpha: weight of the selector CE once ramped. alpha_warmup_steps: optimizer steps with
    alpha 0. alpha_ramp_steps: then a linear ramp to alpha (0 = jump). missing_gold: what a slot
    whose gold token is not among the K does: ``exclude`` (no selector loss there) or ``swap``
    (the gold replaces the last, K-th best, candidate).
    """

    alpha: float = 1.0
    alpha_warmup_steps: int = 0
    alpha_ramp_steps: int = 0
    missing_gold: str = "exclude"
    #: ``argmax``: K-way CE on the gold token; ``distribution``: K-way soft CE on the target's
    #: probabilities of the K candidates (renormalised over them, at module.label_temperature)
    target: str = "argmax"

    @classmethod
    def create(cls, given: Mapping[str, Any] | None) -> SelectorSettings:
        """Validated settings (a head without a selector refuses non-default ones:
        :func:`refuse_selector_settings`)."""
        given = dict(given or {})
        known = {f.name for f in fields(cls)}
        for key in given:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(f"module.selector.{key}: unknown key{hint}; known keys: "
                                 f"{sorted(known)} (conf/module/default.yaml)")
        settings = cls(**given)
        settings._validate()
        return settings

    def _validate(self) -> None:
        if self.target not in SELECTOR_TARGETS:
            raise ValueError(f"module.selector.target='{self.target}': use one of "
                             f"{list(SELECTOR_TARGETS)}")
        if self.missing_gold not in MISSING_GOLD:
            raise ValueError(f"module.selector.missing_gold='{self.missing_gold}': use one of "
                             f"{list(MISSING_GOLD)}")
        if not self.alpha >= 0:
            raise ValueError(f"module.selector.alpha={self.alpha}: must be >= 0")
        for key in ("alpha_warmup_steps", "alpha_ramp_steps"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"module.selector.{key}={value!r}: give a step count >= 0")

    @property
    def needs_distribution(self) -> str | None:
        """The setting that needs the target distribution, named (None: none does)."""
        return "module.selector.target=distribution" if self.target == "distribution" else None

    def alpha_at(self, step: int) -> float:
        """alpha at optimizer step ``step`` (0-based): 0 for the first ``alpha_warmup_steps``
        steps, then ``alpha * min(1, (step - warmup + 1) / ramp)``: full alpha from step
        ``warmup + ramp - 1``. A function of the step alone, so a resumed run continues it."""
        if step < self.alpha_warmup_steps:
            return 0.0
        if self.alpha_ramp_steps == 0:
            return float(self.alpha)
        done = (step - self.alpha_warmup_steps + 1) / self.alpha_ramp_steps
        return float(self.alpha) * min(1.0, done)


@dataclass
class SelectorOutput:
    """Selector loss pieces (local sums) and per-slot flags [Bt, N, B] (False where invalid)."""

    weighted_sum: Tensor  # sum over trained slots of w_t * K-way CE
    weight_sum: Tensor  # sum of their w_t
    in_candidates: Tensor  # gold among the unary top-K (recall; oracle path)
    selector_correct: Tensor  # teacher-forced argmax over the serving candidates == gold
    walk_correct: Tensor  # the greedy walk's own pick == label (selector path)
    #: expected acceptance length per real block at each asked temperature (selector path)
    expected_taus: dict[float, Tensor] | None = None


def previous_tokens(labels_bnp: Tensor, anchor_ids_bn: Tensor) -> Tensor:
    """The true token before each slot [Bt, N, B]: slot 1 -> the anchor token, slot t >= 2 ->
    the label of slot t-1 (slot 0 gets the anchor too; it is never scored)."""
    prev = torch.roll(labels_bnp, 1, dims=-1)
    prev[..., :2] = anchor_ids_bn[..., None]
    return prev.clamp(min=0)


def _scatter(values_m: Tensor, valid_bnp: Tensor, fill=0) -> Tensor:
    """[M, ...] rows of the valid slots -> [Bt, N, B, ...], ``fill`` elsewhere."""
    out = values_m.new_full((*valid_bnp.shape, *values_m.shape[1:]), fill)
    out[valid_bnp] = values_m
    return out


def _train_candidates(ids_mk: Tensor, hit_mk: Tensor, gold_m: Tensor, missing_gold: str):
    """(candidate ids [M, K], gold's index [M], trained rows [M]) under the missing-gold rule."""
    found = hit_mk.any(-1)
    index = hit_mk.int().argmax(-1)
    if missing_gold == "exclude":
        return ids_mk, index, found
    ids = ids_mk.clone()
    ids[~found, -1] = gold_m[~found]
    index = torch.where(found, index, torch.full_like(index, ids.shape[1] - 1))
    return ids, index, torch.ones_like(found)


@torch.no_grad()
def walk_correct(selector: CandidateSelector, hidden_bnph: Tensor, out: LossOutput,
                 labels_bnp: Tensor, anchor_ids_bn: Tensor) -> Tensor:
    """[Bt, N, B]: the serving walk's pick at slot t equals its label (valid slots only).

    The walk uses its own previous picks from the anchor on (never the gold). Invalid slots get
    placeholder candidates: their picks are never counted, and a block's acceptance stops at its
    first invalid slot, so later slots' placeholders cannot change any counted result.
    """
    valid = out.valid
    # detached: a view made under no_grad of a tensor that requires grad still says it does
    # (with no grad_fn), which hooks on module inputs (FlopCounterMode's tracker) reject
    hidden_bnph = hidden_bnph.detach()
    ids_bntk = _scatter(out.top_ids, valid)[:, :, 1:]
    values_bntk = _scatter(out.top_values, valid)[:, :, 1:]
    bt, n, t, k = ids_bntk.shape
    tokens, _ = selector.walk(hidden_bnph[:, :, 1:].reshape(bt * n, t, -1),
                              ids_bntk.reshape(bt * n, t, k), values_bntk.reshape(bt * n, t, k),
                              anchor_ids_bn.reshape(bt * n))
    correct = torch.zeros_like(valid)
    correct[..., 1:] = (tokens.view(bt, n, t) == labels_bnp[..., 1:]) & valid[..., 1:]
    return correct


def selector_loss(selector: CandidateSelector, hidden_bnph: Tensor, out: LossOutput,
                  targets: BlockTargets, anchor_ids_bn: Tensor, lm_head: nn.Module,
                  gamma: float, missing_gold: str = "exclude", scale: LogitScale = NO_SCALE,
                  chunk_bytes: int = CE_CHUNK_BYTES, *, weighting: str = "exp_decay",
                  dpace_alpha: float = 0.5, teacher=None,
                  label_temperature: float = 1.0, temperatures: tuple[float, ...] = (),
                  eval_teacher=None) -> SelectorOutput:
    """The teacher-forced K-way selector CE over the unary top-K of objective.dflash_loss's
    valid slots (``out.top_ids`` [M, K]), and the selector metrics.

    Slot weights as the unary term's (``weighting``, :func:`~dflash_lab.train.loss.slot_weights`):
    exp_decay on the trained slots; dpace from the selector's own K-way CE, its chain running
    over the trained slots only (an excluded slot counts as invalid), as the unary D-PACE
    weights come from the unary CE.

    Gradients reach the selector (codebooks, hidden projection) and the drafter's hidden states,
    also through the candidates' unary logits (recomputed for the K ids only, differentiable).

    ``teacher`` (:class:`~dflash_lab.train.distill.Teacher` of the valid slots): with it the
    K-way loss is a soft CE on the target's probabilities of the K candidates, renormalised over
    them at ``label_temperature`` (``module.selector.target=distribution``; every valid slot
    trains, whether or not the gold token is a candidate). ``temperatures``: where to measure
    the selector path's expected acceptance (``expected_taus``, teacher-forced along the text)
    against ``eval_teacher`` (the same slots' target distribution).
    """
    valid = targets.valid
    hidden_mh, gold_m = hidden_bnph[valid], targets.labels[valid]
    prev_m = previous_tokens(targets.labels, anchor_ids_bn)[valid]
    hit_mk = out.top_ids == gold_m[:, None]
    ids_mk, index_m, trained_m = _train_candidates(out.top_ids, hit_mk, gold_m, missing_gold)
    unary_mk = candidate_logits(hidden_mh, ids_mk, lm_head, chunk_bytes, scale)
    scores_mk = selector.score(hidden_mh, prev_m, ids_mk, unary_mk)
    if teacher is not None:
        soft_mk = candidate_logprobs(teacher, ids_mk, lm_head, label_temperature).exp()
        ce_m = -(soft_mk * scores_mk.float().log_softmax(-1)).sum(-1)
        trained_m = torch.ones_like(trained_m)
    else:
        ce_m = F.cross_entropy(scores_mk, index_m, reduction="none")
    if weighting == "dpace":
        w_m = torch.zeros_like(ce_m, dtype=torch.float32)
        w_m[trained_m] = slot_weights(_scatter(trained_m, valid, False), ce_m[trained_m], gamma,
                                      weighting, dpace_alpha)
    else:  # the unary term's weights of the valid slots, zero where the selector trains none
        w_m = slot_weights(valid, ce_m, gamma, weighting, dpace_alpha) * trained_m
    with torch.no_grad():  # metrics on the candidates serving sees, with their serving values
        serving = selector.score(hidden_mh, prev_m, out.top_ids, out.top_values)
        picked_ok = hit_mk.gather(-1, serving.argmax(-1, keepdim=True))[:, 0]
    result = SelectorOutput(
        (w_m * ce_m).sum(), w_m.sum(), _scatter(hit_mk.any(-1), valid, False),
        _scatter(picked_ok, valid, False),
        walk_correct(selector, hidden_bnph, out, targets.labels, anchor_ids_bn))
    if temperatures:
        result.expected_taus = expected_selector_taus(serving, result.walk_correct, out,
                                                      eval_teacher, lm_head, temperatures)
    return result


@torch.no_grad()
def expected_selector_taus(serving_mk: Tensor, walk_bnp: Tensor, out: LossOutput, teacher,
                           lm_head, temperatures: tuple[float, ...]) -> dict[float, Tensor]:
    """Expected acceptance length per real block [K] of the selector path at each T (T > 0):
    slot t drafts from q = softmax(score / T) over its K candidates (the serving rule,
    teacher-forced on the text's previous token), accepted with probability
    sum_c min(p_T(c), q(c)), p_T the target's distribution over the whole vocabulary; T = 0
    is the greedy walk's count (``walk_correct``)."""
    taus = {}
    for t in temperatures:
        if t == 0:
            alpha_m = walk_bnp[out.valid].float()
        else:
            q_mk = (serving_mk.float() / t).softmax(-1)
            p_mk = candidate_logprobs(teacher, out.top_ids, lm_head, t, renormalise=False).exp()
            alpha_m = torch.minimum(p_mk, q_mk).sum(-1)
        alpha = on_slots(alpha_m.float(), out.valid)
        blocks = out.block_valid if out.block_valid is not None else out.valid.any(-1)
        taus[t] = 1.0 + expected_accepted(alpha, out.valid, blocks)
    return taus


class SelectorMetrics:
    """Validation accumulator: pooled per-slot counts and per-block acceptance lengths."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.counts: Tensor | None = None  # [3, B]: valid, in candidates, selector correct
        self.taus: dict[str, list[Tensor]] = {"tau": [], "unary_tau": [], "oracle_tau": []}
        self.loss = torch.zeros(2)  # selector weighted sum, weight sum

    def update(self, out: LossOutput) -> None:
        sel = out.selector
        counts = torch.stack([f.sum(dim=(0, 1)) for f in
                              (out.valid, sel.in_candidates, sel.selector_correct)]).cpu()
        self.counts = counts if self.counts is None else self.counts + counts
        for key, flags in (("tau", sel.walk_correct), ("unary_tau", out.correct),
                           ("oracle_tau", sel.in_candidates)):
            self.taus[key].append(acceptance_lengths(flags, out.block_valid).cpu())
        # out of place: reset() may run under inference mode (trainer.validate) and an
        # inference tensor cannot be updated in place by the fit loop's validation
        pieces = torch.stack([sel.weighted_sum, sel.weight_sum]).detach().float().cpu()
        self.loss = self.loss + pieces

    def compute(self) -> dict[str, float]:
        """``val/...`` metrics: tau (selector path), unary_tau, oracle_tau, recall_at_k,
        selector_acc, recall_pos{t}, selector_acc_pos{t}, selector_loss."""
        result = {f"val/{k}": (torch.cat(v).mean().item() if v and torch.cat(v).numel() else 1.0)
                  for k, v in self.taus.items()}
        result["val/selector_loss"] = (self.loss[0] / self.loss[1].clamp(min=1e-8)).item()
        if self.counts is None:
            return result
        valid, found, right = self.counts[:, 1:].float()
        total = valid.sum().clamp(min=1)
        result["val/recall_at_k"] = (found.sum() / total).item()
        result["val/selector_acc"] = (right.sum() / total).item()
        for t in range(len(valid)):
            if valid[t] > 0:
                result[f"val/recall_pos{t + 1}"] = (found[t] / valid[t]).item()
                result[f"val/selector_acc_pos{t + 1}"] = (right[t] / valid[t]).item()
        return result
