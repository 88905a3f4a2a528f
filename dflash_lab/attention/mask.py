"""The ONE DFlash attention mask predicate (dflash.md section 3) and what each backend needs:
query q is slot ``t = q % B`` of block ``j = q // B`` at position ``a_j + t``; keys are S context
slots then the N*B block slots. A context key is visible before the anchor, in its document and
window; a block key only in the query's own block, causal or windowed as the layer says
(docs/training.md, "The mask predicate": packing, padding, inference as N = 1, a = S).

Shape legend: Bt batch, N blocks, B block size, S context slots, Q = N*B queries, K = S + Q keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class LayerSpec(NamedTuple):
    """How one draft layer attends: ``window`` (W keys counting the query itself, or None for
    full attention) and ``causal`` (inside the block: slot t sees slots u <= t)."""

    window: int | None
    causal: bool


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """Where the blocks of one attention call sit: ``anchors_bn`` [Bt, N] long anchor positions
    (sorted per row, for speed), ``num_context`` S context key slots (padded), ``block_size`` B,
    ``doc_starts_bn`` [Bt, N] long document start of each anchor (packed; None: 0)."""

    anchors_bn: Tensor
    num_context: int
    block_size: int
    doc_starts_bn: Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.anchors_bn.shape[1]

    @property
    def num_queries(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_keys(self) -> int:
        return self.num_context + self.num_queries

    def starts_bn(self) -> Tensor:
        """Document start of every anchor [Bt, N] (zeros for unpacked rows)."""
        if self.doc_starts_bn is None:
            return torch.zeros_like(self.anchors_bn)
        return self.doc_starts_bn

    def positions_bq(self) -> Tensor:
        """RoPE positions of the block slots, [Bt, N*B]: ``a_j - d_j + t``, the slot's position
        inside its document (the absolute position for an unpacked row)."""
        offs = torch.arange(self.block_size, device=self.anchors_bn.device)
        return (self.anchors_bn - self.starts_bn())[:, :, None].add(offs).flatten(1)


def visible(q_idx: Tensor, kv_idx: Tensor, anchors_b_n: Tensor, num_context: int,
            block_size: int, spec: LayerSpec, starts_b_n: Tensor | None = None) -> Tensor:
    """The predicate: broadcasting index tensors in, bool out. ``anchors_b_n`` [N]: the anchors of
    the indices' batch element (by block ``q_idx // block_size``); ``starts_b_n`` [N]: each
    anchor's document start (None: 0). :func:`dense_mask` vmaps it over rows; flex, per element."""
    j = q_idx // block_size
    t = q_idx % block_size
    anchor = anchors_b_n[j]
    is_ctx = kv_idx < num_context
    blk = (kv_idx - num_context).clamp(min=0)
    k, u = blk // block_size, blk % block_size
    ctx_ok = kv_idx < anchor
    if starts_b_n is not None:
        ctx_ok = ctx_ok & (kv_idx >= starts_b_n[j])  # same document as the anchor
    blk_ok = k == j
    if spec.causal:
        blk_ok = blk_ok & (u <= t)
    if spec.window is not None:
        reach = spec.window - 1
        ctx_ok = ctx_ok & (kv_idx >= anchor + t - reach)  # (a_j + t) - p <= W - 1
        blk_ok = blk_ok & ((t - u).abs() <= reach)
    return torch.where(is_ctx, ctx_ok, blk_ok)


def dense_mask(layout: BlockLayout, spec: LayerSpec) -> Tensor:
    """Boolean mask [Bt, 1, Q, K] (True = attend) for SDPA-style backends: the whole
    :func:`mask_tile`. Quadratic in the row: long rows use tiles instead (sdpa's streaming)."""
    return mask_tile(layout, spec, 0, layout.num_queries, 0, layout.num_keys)


def mask_tile(layout: BlockLayout, spec: LayerSpec, q0: int, q1: int, k0: int, k1: int
              ) -> Tensor:
    """Boolean mask [Bt, 1, q1-q0, k1-k0] of queries [q0, q1) x keys [k0, k1), equal to that
    slice of :func:`dense_mask` without building the rest: one ``torch.vmap`` of :func:`visible`
    over the anchor rows (no Python loop); the batch-sized temporaries are booleans."""
    dev = layout.anchors_bn.device
    q_idx = torch.arange(q0, q1, device=dev)[:, None]
    kv_idx = torch.arange(k0, k1, device=dev)[None, :]

    def one_row(anchors_n: Tensor, starts_n: Tensor | None = None) -> Tensor:
        return visible(q_idx, kv_idx, anchors_n, layout.num_context, layout.block_size, spec,
                       starts_n)

    if layout.doc_starts_bn is None:
        return torch.vmap(one_row)(layout.anchors_bn)[:, None]
    return torch.vmap(one_row)(layout.anchors_bn, layout.doc_starts_bn)[:, None]


def visible_key_ranges(layout: BlockLayout, spec: LayerSpec, n0: int, n1: int
                       ) -> list[tuple[int, int]]:
    """Key ranges ``[(k0, k1), ...]`` outside which blocks [n0, n1) see nothing, in any row (a
    bound; :func:`mask_tile` decides inside): the context from the blocks' lowest first visible
    key (document start, or ``a_j - (W-1)`` under a window) to the last anchor (keys ``p < a_j``),
    dropped when empty, and the slots ``S + n0*B .. S + n1*B``. Sliding layers' tiles keep a fixed
    size as rows grow (docs/training.md, "The mask predicate")."""
    s, b = layout.num_context, layout.block_size
    anchors = layout.anchors_bn[:, n0:n1]
    first = layout.starts_bn()[:, n0:n1]
    if spec.window is not None:
        first = torch.maximum(first, anchors - (spec.window - 1))
    c0, c1 = int(first.min().clamp(min=0)), int(anchors.max().clamp(max=s))
    blocks = (s + n0 * b, s + n1 * b)
    return [(c0, c1), blocks] if c1 > c0 else [blocks]


def flex_mask_mod(layout: BlockLayout, spec: LayerSpec):
    """A flex_attention ``mask_mod(b, h, q_idx, kv_idx)`` over the same predicate."""
    anchors_bn, num_context, block_size = layout.anchors_bn, layout.num_context, layout.block_size
    starts_bn = layout.doc_starts_bn

    def mask_mod(b, h, q_idx, kv_idx):
        starts = None if starts_bn is None else starts_bn[b]
        return visible(q_idx, kv_idx, anchors_bn[b], num_context, block_size, spec, starts)

    return mask_mod


def document_starts(document_ids_bs: Tensor) -> Tensor:
    """Row position where each position's document starts [Bt, S] long, from ``document_ids_bs``
    [Bt, S] (contiguous runs; padding is one more run): ``cummax`` carries each run's start right.
    ``arange(S) - starts`` is the RoPE position, restarting at 0 as in an unpacked row."""
    s = document_ids_bs.shape[1]
    pos = torch.arange(s, device=document_ids_bs.device).expand_as(document_ids_bs)
    new = torch.ones_like(document_ids_bs, dtype=torch.bool)
    new[:, 1:] = document_ids_bs[:, 1:] != document_ids_bs[:, :-1]
    return torch.where(new, pos, torch.zeros_like(pos)).cummax(dim=1).values


def flash_window_args(spec: LayerSpec) -> tuple[tuple[int, int], bool]:
    """flash-attn ``(window_size=(left, right), causal)`` for the inference layout, where the
    B queries are the LAST B keys (flash aligns causal masks and windows bottom-right): causal
    window W -> (W-1, 0), bidirectional W -> (W-1, W-1), none -> (-1, -1)."""
    if spec.window is None:
        return (-1, -1), spec.causal
    reach = spec.window - 1
    return (reach, 0 if spec.causal else reach), spec.causal


def is_inference_layout(layout: BlockLayout) -> bool:
    """True when every row has one block anchored right after its full context (a == S) and the
    context is one document (no packed document start after 0)."""
    one_doc = layout.doc_starts_bn is None or not bool(layout.doc_starts_bn.any())
    return (layout.num_blocks == 1 and one_doc
            and bool((layout.anchors_bn == layout.num_context).all()))


def apply_sink(out_bhqd: torch.Tensor, lse_bhq: torch.Tensor,
               sink_h: torch.Tensor | None) -> torch.Tensor:
    """The sink column for kernels that return a log-sum-exp (flash, flex), exactly:
    ``out * sigmoid(lse - b_h)`` (= e^lse / (e^lse + e^b))."""
    if sink_h is None:
        return out_bhqd
    gate = torch.sigmoid(lse_bhq.float() - sink_h.float()[None, :, None])
    return (out_bhqd.float() * gate[..., None]).to(out_bhqd.dtype)
