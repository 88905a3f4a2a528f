"""DFlash 2 (dflash.md section 7; docs/losses.md, "DFlash 2"): DFlash 1 plus a grouped dynamic
causal conv around every sublayer of every draft layer and a candidate selector that re-ranks the
unary top-K of every slot, trained with the selector CE beside the unary loss and walked left to
right when drafting. Served as z-lab's ``DFlash2DraftModel``. Both modules are initialised so
that a fresh drafter computes what DFlash 1 computes.

Shape legend: Bt batch, N blocks, B block size, Q = N*B block slots of a row, T = B-1 drafted
(scored) slots, H hidden, M valid slots, K conv taps, G conv groups (H / conv_group_size), V
vocab, C (or K in the loss) candidates (selector_top_k), R selector rank, ``x`` any leading
dims. Suffix letters (``x_bnph``): docs/architecture.md; ``b`` is the batch, ``p`` a position in
a block.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.model.heads import Head, register
from dflash_lab.model.layers import vocab_topk
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
from dflash_lab.train.objective import Term


def grouped_dynamic_conv(x_bqh: Tensor, dyn_bqkg: Tensor, base_kh: Tensor,
                         block_size: int) -> Tensor:
    """``out[t, c] = sum_o (base[o, c] + dyn[t, o, c // group_size]) * x[t - o, c]`` per block:
    x [Bt, Q, H] (Q a multiple of ``block_size``, blocks contiguous), dyn [Bt, Q, K, G], base
    [K, H]. Shifting inside the [N, B] view with zero fill keeps every tap in its block."""
    bt, q, h = x_bqh.shape
    k, g = base_kh.shape[0], dyn_bqkg.shape[-1]
    if q % block_size:
        raise ValueError(f"{q} block slots are not a whole number of blocks of {block_size}")
    x_bnpgc = x_bqh.reshape(bt, q // block_size, block_size, g, h // g)
    dyn_bnpkg1 = dyn_bqkg.reshape(bt, q // block_size, block_size, k, g, 1)
    base_kgc = base_kh.to(x_bqh.dtype).view(k, g, h // g)
    out = None
    for o in range(k):
        # slot t sees x[t - o]; the first o slots of each block see zeros
        shifted = x_bnpgc if o == 0 else F.pad(x_bnpgc[:, :, :-o], (0, 0, 0, 0, o, 0))
        term = (base_kgc[o] + dyn_bnpkg1[:, :, :, o]) * shifted
        out = term if out is None else out + term
    return out.reshape(bt, q, h)


class GroupedDynamicCausalConv(nn.Module):
    """The conv around one sublayer. base_kernel [2, K, H] (side 0 = input, 1 = output);
    kernel_projection H -> 2*K*G, laid out [side, tap, group] (z-lab's layout)."""

    owns_init = True  #: re-initialised by reset_parameters after the drafter's init

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups,
                                           bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity: tap 0 weight 1, other taps 0, no dynamic correction."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, normed_bqh: Tensor) -> tuple[Tensor, Tensor]:
        """Normed sublayer input [Bt, Q, H] -> (convolved input [Bt, Q, H], output-side taps
        [Bt, Q, K, G]); both sides' taps come from this normed input."""
        dyn = self.kernel_projection(normed_bqh).view(
            *normed_bqh.shape[:2], 2, self.kernel_size, self.num_groups)
        conv = grouped_dynamic_conv(normed_bqh, dyn[:, :, 0], self.base_kernel[0], self.block_size)
        return conv, dyn[:, :, 1]

    def finish(self, out_bqh: Tensor, dyn_bqkg: Tensor) -> Tensor:
        """Sublayer output [Bt, Q, H] -> convolved with the taps ``prepare`` returned."""
        return grouped_dynamic_conv(out_bqh, dyn_bqkg, self.base_kernel[1], self.block_size)


class _ZeroedGrad:
    """Whether a codebook's gradient buffer holds the zeros :meth:`CandidateSelector.
    zero_grads_in_place_` wrote and nothing since (the next backward may add its rows in place)."""

    __slots__ = ("zeroed",)

    def __init__(self) -> None:
        self.zeroed = False

    def take(self, weight: Tensor) -> bool:
        """True once after a zeroing, while the weight still has that dense CPU buffer."""
        ok = (self.zeroed and weight.grad is not None and weight.grad.layout == torch.strided
              and weight.grad.device.type == "cpu")
        self.zeroed = False
        return ok


class _CodebookLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward, right after an in-place zeroing of the
    weight's gradient (``state``), returns the looked-up rows' gradients as an (uncoalesced)
    sparse [V, R] tensor: autograd adds them into the zeroed dense buffer row by row, in
    the order a dense embedding backward sums them, so the gradient is bitwise the dense one
    (``tests/train/test_dflash2_codebook_grad.py``) without a fresh [V, R] buffer: above glibc's
    mmap threshold each step's fresh buffer is mapped and page-faulted in (~35 ms at
    [49152, 256] on CPU, benchmark 2b). Otherwise (first step, a gradient accumulated since
    the zeroing, CUDA) it is the dense embedding backward itself."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, state: _ZeroedGrad) -> Tensor:
        ctx.save_for_backward(ids, weight)
        ctx.state = state
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_xr: Tensor):
        ids, weight = ctx.saved_tensors
        num_rows, rank = weight.shape
        if ctx.state.take(weight):
            # ids are in range (the forward's lookup checked them): no invariant check
            grad = torch.sparse_coo_tensor(ids.reshape(1, -1), grad_xr.reshape(-1, rank),
                                           (num_rows, rank), check_invariants=False)
        else:
            grad = torch.ops.aten.embedding_dense_backward(grad_xr, ids, num_rows, -1, False)
        return None, grad, None


class CandidateSelector(nn.Module):
    """Re-ranks the unary top-C with a low-rank (predecessor, successor) interaction; the
    codebooks are bare parameters, so their state_dict keys are the serving names
    ``candidate_selector.{predecessor,successor}_codebook`` (no ``.weight``)."""

    owns_init = True  #: re-initialised by reset_parameters after the drafter's init

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self._zeroed = {name: _ZeroedGrad() for name in self.CODEBOOKS}
        self.reset_parameters()

    #: The two [V, R] parameters, looked up by token id (a few rows per step get a gradient).
    CODEBOOKS = ("predecessor_codebook", "successor_codebook")

    def reset_parameters(self) -> None:
        """Successor codebook 0 (scores = unary: DFlash 1's draft); the others N(0, 0.02) so
        the successor codebook gets a gradient from the first step."""
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, std=0.02)
            nn.init.normal_(self.hidden_projection.weight, std=0.02)
            self.successor_codebook.zero_()

    def candidates(self, unary_xv: Tensor) -> tuple[Tensor, Tensor]:
        """Top-C of the unary logits [x, V] -> (values [x, C], token ids [x, C]), best first."""
        flat_nv = unary_xv.reshape(-1, unary_xv.shape[-1])
        values, ids = vocab_topk(flat_nv, self.top_k, dim=-1)
        return (values.reshape(*unary_xv.shape[:-1], self.top_k),
                ids.reshape(*unary_xv.shape[:-1], self.top_k))

    def zero_grads_in_place_(self) -> list[nn.Parameter]:
        """Zero the codebooks' dense CPU gradient buffers in place and return those
        parameters (the caller sets the other gradients to None): the next backward adds its
        rows into them (:class:`_CodebookLookup`) instead of mapping a fresh [V, R] buffer.
        Codebooks without such a buffer (first step, CUDA) are left to the caller."""
        kept = []
        for name in self.CODEBOOKS:
            weight = getattr(self, name)
            grad = weight.grad
            if grad is not None and grad.layout == torch.strided and grad.device.type == "cpu":
                grad.zero_()
                self._zeroed[name].zeroed = True
                kept.append(weight)
        return kept

    def _lookup(self, name: str, ids: Tensor) -> Tensor:
        """Rows ``ids`` of codebook ``name`` [x, R] (:class:`_CodebookLookup` when tracked)."""
        weight = getattr(self, name)
        if torch.is_grad_enabled() and weight.requires_grad:
            return _CodebookLookup.apply(ids, weight, self._zeroed[name])
        return F.embedding(ids, weight)

    def score(self, hidden_xh: Tensor, prev_x: Tensor, cand_ids_xc: Tensor,
              cand_unary_xc: Tensor) -> Tensor:
        """Candidate scores [x, C] given each slot's predecessor token ``prev_x``. Training
        (teacher forcing): hidden [Bt, N, T, H] of slots 1..B-1, prev = the true tokens at slots
        0..B-2 (slot 0 = the anchor), candidates from :meth:`candidates` (the caller may swap
        the gold token in before scoring)."""
        pair_xr = self._lookup("predecessor_codebook", prev_x) * self.hidden_projection(hidden_xh)
        succ_xcr = self._lookup("successor_codebook", cand_ids_xc)
        inter = torch.einsum("...r,...cr->...c", pair_xr, succ_xcr)
        return cand_unary_xc + inter.to(cand_unary_xc.dtype)

    def walk(self, hidden_bth: Tensor, cand_ids_btc: Tensor, cand_unary_btc: Tensor,
             anchor_b: Tensor, pick: Callable[[Tensor], Tensor] | None = None
             ) -> tuple[Tensor, Tensor]:
        """Serving: left to right, each slot's predecessor is the token chosen for the slot
        before (the anchor for the first). ``pick``: scores [Bt, C] -> candidate index [Bt]
        (None: argmax, T=0; a sampler for T>0). Returns (tokens [Bt, T], scores [Bt, T, C])."""
        proj_btr = self.hidden_projection(hidden_bth)
        succ_btcr = F.embedding(cand_ids_btc, self.successor_codebook)
        prev, tokens, scores = anchor_b, [], []
        for t in range(hidden_bth.shape[1]):
            pair_br = F.embedding(prev, self.predecessor_codebook) * proj_btr[:, t]
            inter = torch.einsum("br,bcr->bc", pair_br, succ_btcr[:, t])
            s_bc = cand_unary_btc[:, t] + inter.to(cand_unary_btc.dtype)
            index = s_bc.argmax(dim=-1) if pick is None else pick(s_bc)
            prev = cand_ids_btc[:, t].gather(-1, index[:, None])[:, 0]
            tokens.append(prev)
            scores.append(s_bc)
        return torch.stack(tokens, dim=1), torch.stack(scores, dim=1)


MISSING_GOLD = ("exclude", "swap")


def refuse_selector_settings(given: Mapping[str, Any] | None, variant: str) -> None:
    """A drafter without a candidate selector refuses any non-default ``module.selector``
    value (it would silently do nothing; unknown keys and bad values are refused first)."""
    default = SelectorSettings()
    changed = {k: v for k, v in asdict(SelectorSettings.create(given)).items()
               if v != getattr(default, k)}
    if changed:
        raise ValueError(f"module.selector {changed}: only DFlash 2 drafters have a "
                         f"candidate selector, this drafter is variant='{variant}'; use "
                         "drafter=dflash2 (conf/drafter/dflash2.yaml) or drop the override")


#: ``module.selector.target``: what the K-way selector loss learns
SELECTOR_TARGETS = ("argmax", "distribution")


@dataclass(frozen=True)
class SelectorSettings:
    """``module.selector`` (conf/module/default.yaml). alpha: weight of the selector CE once
    ramped. alpha_warmup_steps: optimizer steps with alpha 0. alpha_ramp_steps: then a linear
    ramp to alpha (0 = jump). missing_gold: what a slot whose gold token is not among the K
    does: ``exclude`` (no selector loss there) or ``swap`` (the gold replaces the K-th best)."""

    alpha: float = 1.0
    alpha_warmup_steps: int = 0
    alpha_ramp_steps: int = 0
    missing_gold: str = "exclude"
    #: ``argmax``: K-way CE on the gold token; ``distribution``: K-way soft CE on the target's
    #: probabilities of the K candidates (renormalised over them, at module.label_temperature)
    target: str = "argmax"

    @classmethod
    def create(cls, given: Mapping[str, Any] | None) -> SelectorSettings:
        """Validated settings (without a selector: :func:`refuse_selector_settings`)."""
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
    """[Bt, N, B]: the serving walk's pick at slot t (on its own previous picks from the anchor
    on, never the gold) equals its label, valid slots only. Invalid slots get placeholder
    candidates: never counted, and a block's acceptance stops at its first invalid slot, so they
    cannot change any counted result."""
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
    valid slots (``out.top_ids`` [M, K]), and the selector metrics. Slot weights as the unary
    term's (``weighting``: exp_decay on the trained slots; dpace from the selector's own CE, as
    the unary one from the unary CE, its chain over the trained slots only: an excluded slot
    counts as invalid). Gradients reach the selector (codebooks, hidden projection) and the
    hidden states, also through the candidates' unary logits (recomputed for the K ids).
    ``teacher`` (the valid slots' :class:`~dflash_lab.train.distill.Teacher`): a soft CE on the
    target's probabilities of the K candidates instead (docs/losses.md, "DFlash 2").
    ``temperatures``: where to measure the selector path's ``expected_taus`` (teacher-forced
    along the text) against ``eval_teacher`` (the same slots' target distribution)."""
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


#: blocks per pass of :func:`selector_flags`: bounds the [blocks, T, V] fp32 logits held at once
_SELECTOR_CHUNK = 32


@torch.no_grad()
def selector_flags(drafter: Any, lm_head: nn.Module, hidden_bnph: Tensor, anchor_ids_bn: Tensor,
                   labels_bnp: Tensor, valid_bnp: Tensor) -> tuple[Tensor, Tensor]:
    """Features-mode per-slot flags [Bt, N, B] (False at slot 0 and invalid slots): the serving
    walk's pick equals the label; the label is among the slot's K candidates (recall, oracle
    path). Candidates: the top-K of the unary logits (output_multiplier, softcap), as served.
    Slots past a block's first invalid one are walked on placeholder labels, never counted."""
    selector = drafter.candidate_selector
    bt, n, b, h = hidden_bnph.shape
    hidden_xth = hidden_bnph[:, :, 1:].reshape(bt * n, b - 1, h)
    anchors_x = anchor_ids_bn.reshape(bt * n)
    picks, cands = [], []
    for s in range(0, bt * n, _SELECTOR_CHUNK):
        h_xth, a_x = hidden_xth[s:s + _SELECTOR_CHUNK], anchors_x[s:s + _SELECTOR_CHUNK]
        unary = drafter.unary_logits(h_xth.to(lm_head.weight.dtype), lm_head).float()
        cand_unary, cand_ids = selector.candidates(unary)
        picks.append(selector.walk(h_xth, cand_ids, cand_unary, a_x)[0])
        cands.append(cand_ids)
    labels = labels_bnp[:, :, 1:].reshape(bt * n, b - 1)
    walk, found = torch.zeros_like(valid_bnp), torch.zeros_like(valid_bnp)
    walk[:, :, 1:] = (torch.cat(picks) == labels).view(bt, n, b - 1)
    found[:, :, 1:] = (torch.cat(cands) == labels[..., None]).any(-1).view(bt, n, b - 1)
    return walk & valid_bnp, found & valid_bnp


class SelectorMetrics:
    """The selector walk's metrics (``Head.walk_metrics``): its per-slot correctness in a
    training step (:meth:`correct`), the validation accumulator (:meth:`update`,
    :meth:`compute`: pooled per-slot counts, per-block acceptance lengths, the walk's expected
    taus) and features mode's flags (:meth:`features`, :func:`selector_flags`)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.counts: Tensor | None = None  # [3, B]: valid, in candidates, selector correct
        self.taus: dict[str, list[Tensor]] = {"tau": [], "unary_tau": [], "oracle_tau": []}
        self.loss = torch.zeros(2)  # selector weighted sum, weight sum
        self.expected: dict[str, list[Tensor]] = {}  # val/tau_T{t}: the walk's, per block

    features = staticmethod(selector_flags)  #: features mode's (walk, oracle) flags

    @staticmethod
    def correct(out: LossOutput) -> Tensor:
        """[Bt, N, B]: the greedy walk's pick equals the label (what serving drafts)."""
        return out.head_pieces["selector"].walk_correct

    def update(self, out: LossOutput) -> None:
        sel = out.head_pieces["selector"]
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
        for t, taus in (sel.expected_taus or {}).items():
            self.expected.setdefault(f"val/tau_T{t:g}", []).append(taus.cpu())

    def compute(self) -> dict[str, float]:
        """``val/...`` metrics: tau and tau_T{t} (selector path), unary_tau, oracle_tau,
        recall_at_k, selector_acc, recall_pos{t}, selector_acc_pos{t}, selector_loss."""
        result = {f"val/{k}": (torch.cat(v).mean().item() if v and torch.cat(v).numel() else 1.0)
                  for k, v in self.taus.items()}
        result.update((k, torch.cat(v).mean().item() if torch.cat(v).numel() else 1.0)
                      for k, v in sorted(self.expected.items()))
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


#: Defaults when ``variant=dflash2`` leaves them unset: the released Qwen3.8-27B-DFlash2 setting.
DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
            "selector_top_k": 16}


class DFlash2(Head):
    name = "dflash2"
    title = "DFlash 2"
    architecture = "DFlash2DraftModel"
    fields = DEFAULTS
    walk = "selector"
    tensors = "conv and selector tensors"
    weight_fields = ("conv_kernel_size", "conv_group_size", "selector_rank")

    def validate(self, config: Any) -> None:
        for key in DEFAULTS:
            if int(getattr(config, key)) < 1:
                config._fail(key, getattr(config, key), "must be a positive integer")
        if config.hidden_size % config.conv_group_size:
            config._fail("conv_group_size", config.conv_group_size,
                         f"must divide hidden_size={config.hidden_size} (channels per dynamic "
                         "tap)")
        if config.conv_kernel_size > config.block_size:
            config._fail("conv_kernel_size", config.conv_kernel_size,
                         f"must be <= block_size={config.block_size}: taps never cross a block "
                         "start, so longer kernels have taps that never see a token")
        if config.selector_top_k > config.vocab_size:
            config._fail("selector_top_k", config.selector_top_k,
                         f"must be <= vocab_size={config.vocab_size} (candidates come from the "
                         "full target vocabulary)")
        if config.sample_from_anchor:
            config._fail("sample_from_anchor", True,
                         "is not implemented for variant='dflash2' (the selector's predecessor "
                         "tokens assume an anchor slot that predicts nothing); use "
                         "variant='dflash1' or sample_from_anchor=false")
        if config.draft_vocab_size is not None and config.draft_vocab_size < config.vocab_size:
            config._fail("draft_vocab_size", config.draft_vocab_size,
                         "DFlash 2's candidate selector scores candidates over the target's "
                         "whole vocabulary (its codebooks are vocabulary-sized): set "
                         "drafter.draft_vocab_size=null, or train a DFlash 1 drafter "
                         "(variant=dflash1) for a reduced draft vocabulary")

    def check_read(self, fields: dict[str, Any], source: str) -> None:
        """z-lab's loader needs the conv and the selector named."""
        missing = [f"dflash_config.{k}" for k in DEFAULTS if k not in fields]
        if missing:
            raise ValueError(f"{source}: a DFlash2DraftModel config needs {missing}")

    def attach(self, drafter: Any) -> None:
        c = drafter.config
        drafter.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size,
                                                       c.selector_rank, c.selector_top_k)

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Per layer two convs (base [2, K, H], projection [2*K*G, H], G = H / conv_group_size
        groups), and the selector (codebooks [V, R], projection [R, H])."""
        h, k, r = config.hidden_size, config.conv_kernel_size, config.selector_rank
        groups = h // config.conv_group_size
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(config.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * groups, h)
        for side in ("predecessor", "successor"):
            shapes[f"candidate_selector.{side}_codebook"] = (config.vocab_size, r)
        shapes["candidate_selector.hidden_projection.weight"] = (r, h)
        return shapes

    def layer_modules(self, config: Any) -> dict[str, Any]:
        def conv() -> GroupedDynamicCausalConv:
            return GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size,
                                            config.conv_group_size, config.block_size)
        return {"attention_conv": conv(), "mlp_conv": conv()}

    def min_slots(self, config: Any) -> int:
        """K - 1 for a conv of K taps (its shifted taps need offset <= slots)."""
        return max(2, config.conv_kernel_size - 1)

    def check_training(self, config: Any, module: Any) -> None:
        """``module.selector``, validated, as ``module.selector_settings``."""
        module.selector_settings = SelectorSettings.create(module.selector)

    def needs_distribution(self, module: Any) -> str | None:
        return module.selector_settings.needs_distribution

    def unary_top_k(self, config: Any) -> int:
        return config.selector_top_k

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """The selector CE over the unary top-K (``out.head_pieces["selector"]``)."""
        hp, settings = module.hparams, module.selector_settings
        out.head_pieces["selector"] = selector_loss(
            module.drafter.candidate_selector, step.hidden, out, step.tgt,
            step.batch["input_ids"].gather(1, step.anchors), step.lm_head, hp.gamma,
            settings.missing_gold, module.logit_scale, hp.ce_chunk_bytes, **step.weighting,
            teacher=step.teacher if settings.target == "distribution" else None,
            label_temperature=module.loss_spec.label_temperature,
            temperatures=step.temperatures, eval_teacher=step.teacher)

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        """The selector CE at ``alpha(step)``, also at 0 (every parameter stays in DDP's graph)."""
        alpha = module.selector_settings.alpha_at(step)
        sel = out.head_pieces["selector"]
        return [Term("selector", sel.weighted_sum, sel.weight_sum, alpha, "selector_loss",
                     extra=(("alpha", float(alpha)),))]

    def probe_outputs(self, drafter: Any, hidden_bph: Any, unary_bpv: Any,
                      anchor_b: Any) -> list[Any]:
        """The selector walk's scores [1, B-1, C] over the probe's top-K candidates."""
        selector = drafter.candidate_selector
        cand_unary, cand_ids = selector.candidates(unary_bpv[:, 1:])
        return [selector.walk(hidden_bph[:, 1:], cand_ids, cand_unary, anchor_b)[1]]

    def walk_metrics(self) -> SelectorMetrics:
        return SelectorMetrics()

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any,
              embed_tokens: Any = None, context_h: Any = None) -> tuple[Any, Any]:
        """DFlash 2 draft tokens [k] (and q [k, V] for rejection sampling, else None) from the
        final-normed hidden states of slots 1..k and their unary logits (multiplier and softcap
        applied; their top-K are the candidates), walked from the anchor. q is dense over the
        vocabulary (zero outside the K candidates) so :func:`~dflash_lab.eval.sampling.
        rejection_sample` reads p(x)/q(x) and the residual as for DFlash 1."""
        selector = drafter.candidate_selector
        cand_unary, cand_ids = selector.candidates(unary_kv[None])
        anchor = torch.tensor([anchor_id], dtype=torch.long, device=cand_ids.device)
        if not (temperature > 0 and mode == "rejection"):
            return selector.walk(hidden_kh[None], cand_ids, cand_unary, anchor)[0][0], None
        rows: list[Tensor] = []

        def pick(scores_bc: Tensor) -> Tensor:
            q_bc = torch.softmax(scores_bc.float() / temperature, dim=-1)
            rows.append(q_bc)
            return torch.multinomial(q_bc, 1, generator=generator)[:, 0]

        tokens = selector.walk(hidden_kh[None], cand_ids, cand_unary, anchor, pick=pick)[0][0]
        q_kc = torch.cat(rows)
        q_kv = q_kc.new_zeros(unary_kv.shape).scatter_(-1, cand_ids[0], q_kc)
        return tokens, q_kv


HEAD = register(DFlash2())
