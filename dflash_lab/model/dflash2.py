"""DFlash 2 modules: the grouped dynamic causal conv and the candidate selector (dflash.md s. 7).

- :class:`GroupedDynamicCausalConv` wraps a sublayer (attention or MLP) of a draft layer:
  ``prepare`` convolves the normed sublayer input along the block slots and returns the dynamic
  taps of the output side, ``finish`` convolves the sublayer output with them. For slot t,
  channel c: ``out[t, c] = sum_{o<K} (base[side, o, c] + delta[t, o, group(c)]) * x[t - o, c]``,
  ``delta`` = ``kernel_projection`` of the normed input at slot t (both sides from one projection),
  and ``x[t - o]`` is zero before the block's first slot: taps never cross a block start, in the
  training layout (N packed blocks of B slots per row) as in the inference layout (one block).
- :class:`CandidateSelector` re-ranks the top-K of the unary logits along the block:
  ``score[c] = unary[c] + <A[prev] * (W h_t), S[c]>`` with the predecessor codebook A, the
  successor codebook S (both [V, R]) and the hidden projection W [R, H]. Serving walks left to
  right from the anchor (:meth:`CandidateSelector.walk`); training scores the candidates against
  the true previous tokens (:meth:`CandidateSelector.score`).

Initialisation makes a fresh DFlash 2 drafter compute exactly what DFlash 1 computes: the conv is
the identity (``base[:, 0] = 1``, other taps 0, projection 0) and the successor codebook is zero
(scores = unary logits, so the walk picks the unary argmax).

Shape legend: Bt batch, Q = N*B block slots of a row (N blocks of B slots), H hidden, K conv taps,
G conv groups (H / conv_group_size), V vocab, C candidates (selector_top_k), R selector rank,
T scored slots, ``x`` any leading dims. Suffix letters (``x_bnph``): docs/architecture.md; ``b`` is
the batch, ``p`` a position in a block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def scale_logits(logits_xv: Tensor, output_multiplier: float,
                 softcap: float | None) -> Tensor:
    """Unary logits: ``logits * output_multiplier``, then ``c * tanh(logits / c)`` if capped.

    Both are monotone, so the argmax is unchanged; they matter for sampling and the losses.
    """
    if output_multiplier != 1.0:
        logits_xv = logits_xv * output_multiplier
    if softcap is not None:
        logits_xv = torch.tanh(logits_xv / softcap) * softcap
    return logits_xv


#: Vocabulary rows per block of :func:`vocab_topk` (the per-block maxima it ranks first).
TOPK_BLOCK = 64


def vocab_topk(logits: Tensor, k: int, dim: int = -1) -> tuple[Tensor, Tensor]:
    """``logits.topk(k, dim)`` (values and ids, best first) for a 2-D tensor over a large
    vocabulary, ~5-10x faster on CPU than ``torch.topk`` there (49k-152k entries; benchmark 2).

    Exact: the vocabulary is cut into blocks of ``TOPK_BLOCK`` entries; every top-k entry lies
    in a block whose maximum is among the k largest block maxima (a block outside them has k
    blocks above it, each holding an entry at least as large), so the top-k of those k blocks
    (plus the ragged tail) is the top-k. Values equal ``torch.topk``'s; ids too, except which
    of exactly equal logits is kept, which ``torch.topk`` leaves unspecified as well.
    ``dim``: the vocabulary dimension, 0 ([V, m], the loss's vocab-major chunks) or -1 ([m, V]).
    """
    if logits.dim() != 2 or dim not in (0, 1, -1):
        raise ValueError(f"vocab_topk takes a 2-D tensor and dim 0 or -1, got "
                         f"{tuple(logits.shape)} and dim={dim}")
    x_vm = logits if dim == 0 else logits.t()
    num_blocks = x_vm.shape[0] // TOPK_BLOCK
    if num_blocks < 16 * k:  # small vocabularies: torch.topk is as fast
        return logits.topk(k, dim=dim)
    m = x_vm.shape[1]
    body = num_blocks * TOPK_BLOCK
    best_km = x_vm[:body].reshape(num_blocks, TOPK_BLOCK, m).amax(dim=1).topk(k, dim=0).indices
    offsets = torch.arange(TOPK_BLOCK, device=logits.device)
    rows = (best_km[:, None] * TOPK_BLOCK + offsets[None, :, None]).reshape(k * TOPK_BLOCK, m)
    if body < x_vm.shape[0]:  # the ragged tail is always a candidate
        tail = torch.arange(body, x_vm.shape[0], device=logits.device)
        rows = torch.cat([rows, tail[:, None].expand(-1, m)])
    values, pos = x_vm.gather(0, rows).topk(k, dim=0)
    ids = rows.gather(0, pos)
    return (values, ids) if dim == 0 else (values.t(), ids.t())


def grouped_dynamic_conv(x_bqh: Tensor, dyn_bqkg: Tensor, base_kh: Tensor,
                         block_size: int) -> Tensor:
    """``out[t, c] = sum_o (base[o, c] + dyn[t, o, c // group_size]) * x[t - o, c]`` per block.

    x [Bt, Q, H] with Q a multiple of ``block_size`` (blocks contiguous); dyn [Bt, Q, K, G];
    base [K, H]. Shifting inside the [N, B] view with zero fill keeps every tap in its block.
    """
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
    zero_codebook_grads_` wrote and nothing since (the next backward may add its rows in place)."""

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


def _argmax(scores_bc: Tensor) -> Tensor:
    return scores_bc.argmax(dim=-1)


class CandidateSelector(nn.Module):
    """Re-ranks the unary top-C with a low-rank (predecessor, successor) interaction.

    Codebooks are bare parameters so the state_dict keys are the serving names
    ``candidate_selector.{predecessor,successor}_codebook`` (no ``.weight``).
    """

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

    def zero_codebook_grads_(self) -> list[nn.Parameter]:
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

    def _pair(self, hidden_xh: Tensor, prev_x: Tensor) -> Tensor:
        """``A[prev] * (W h)`` [x, R]: the query side of the interaction."""
        return (self._lookup("predecessor_codebook", prev_x)
                * self.hidden_projection(hidden_xh))

    def score(self, hidden_xh: Tensor, prev_x: Tensor, cand_ids_xc: Tensor,
              cand_unary_xc: Tensor) -> Tensor:
        """Candidate scores [x, C] given each slot's predecessor token ``prev_x``.

        Training (teacher forcing): hidden [Bt, N, T, H] of slots 1..B-1, prev = the true tokens
        at slots 0..B-2 (slot 0 = the anchor), candidates from :meth:`candidates` (the caller
        may swap the gold token in before scoring).
        """
        succ_xcr = self._lookup("successor_codebook", cand_ids_xc)
        inter = torch.einsum("...r,...cr->...c", self._pair(hidden_xh, prev_x), succ_xcr)
        return cand_unary_xc + inter.to(cand_unary_xc.dtype)

    def walk(self, hidden_bth: Tensor, cand_ids_btc: Tensor, cand_unary_btc: Tensor,
             anchor_b: Tensor, pick: Callable[[Tensor], Tensor] = _argmax
             ) -> tuple[Tensor, Tensor]:
        """Serving: left to right, each slot's predecessor is the token chosen for the slot
        before (the anchor for the first). ``pick``: scores [Bt, C] -> candidate index [Bt]
        (argmax at T=0; a sampler for T>0). Returns (tokens [Bt, T], scores [Bt, T, C])."""
        proj_btr = self.hidden_projection(hidden_bth)
        succ_btcr = F.embedding(cand_ids_btc, self.successor_codebook)
        prev, tokens, scores = anchor_b, [], []
        for t in range(hidden_bth.shape[1]):
            pair_br = F.embedding(prev, self.predecessor_codebook) * proj_btr[:, t]
            inter = torch.einsum("br,bcr->bc", pair_br, succ_btcr[:, t])
            s_bc = cand_unary_btc[:, t] + inter.to(cand_unary_btc.dtype)
            prev = cand_ids_btc[:, t].gather(-1, pick(s_bc)[:, None])[:, 0]
            tokens.append(prev)
            scores.append(s_bc)
        return torch.stack(tokens, dim=1), torch.stack(scores, dim=1)
