"""Reference backend: torch SDPA with the dense boolean mask (CPU and GPU, with gradients), exact
sinks (a zero-valued key column whose mask entry is the sink logit), key tiles over runs of sorted
blocks, and streaming of long rows in checkpointed runs that each build only their own mask tile
(docs/training.md, "The mask predicate").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflash_lab.attention.mask import (
    BlockLayout,
    LayerSpec,
    dense_mask,
    mask_tile,
    visible_key_ranges,
)

KEY_TILES = 4  # runs of consecutive blocks per call; 1 turns tiling off
MIN_TILED_PAIRS = 1 << 16  # below this many query-key pairs, per-call overhead wins: one call
#: Above this many query-key pairs (Q x K) prepare streams mask tiles and never builds the dense
#: [Q, K] mask (2^25: a 2K-token row with 128 blocks of 8 stays dense).
STREAM_PAIRS = 1 << 25
#: Queries per streamed run (whole blocks; at least one block). A run's keys are the union of
#: its blocks' context (their anchors' span plus W - 1 for a window) and its slots, so shorter
#: runs waste fewer masked-out pairs at the price of more SDPA calls.
STREAM_QUERIES = 256
#: Attend each streamed run under activation checkpointing (False: keep every run's mask, K/V
#: gather and scores for backward, the former path; benchmarks/long_rows.py measures both).
STREAM_CHECKPOINT = True


@dataclass
class KeyTile:
    """Queries [q0, q1) attend to the keys ``key_idx`` [K'] under ``mask`` [Bt, 1, q1-q0, K']."""

    q0: int
    q1: int
    key_idx: Tensor
    mask: Tensor
    _bias: dict[torch.dtype, Tensor] = field(default_factory=dict, repr=False)

    def bias(self, dtype: torch.dtype) -> Tensor:
        """The additive form of ``mask`` (0 / -inf) [Bt, 1, q1-q0, K'] in ``dtype``, built once
        and shared by every layer of the forward: SDPA keeps a float mask for backward by
        reference, while a bool mask is converted (and that copy kept) in every layer's call."""
        if dtype not in self._bias:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._bias[dtype] = zeros.masked_fill(~self.mask, float("-inf"))
        return self._bias[dtype]


@dataclass
class StreamTile:
    """Blocks [n0, n1) over the key ranges they can see; the mask is built when the tile is
    attended, inside the checkpointed call (:func:`_attend_streamed`)."""

    layout: BlockLayout
    spec: LayerSpec
    n0: int
    n1: int


class SdpaBackend:
    name = "sdpa"

    def __init__(self, key_tiles: int = KEY_TILES, min_pairs: int = MIN_TILED_PAIRS,
                 stream_pairs: int | None = None, stream_queries: int = STREAM_QUERIES):
        """``stream_pairs`` None: the module's :data:`STREAM_PAIRS` when built (benchmarks
        raise that to measure the dense path)."""
        self.key_tiles, self.min_pairs = key_tiles, min_pairs
        self.stream_pairs = STREAM_PAIRS if stream_pairs is None else stream_pairs
        self.stream_queries = stream_queries

    def prepare(self, layout: BlockLayout, spec: LayerSpec) -> Tensor | list[KeyTile]:
        """Dense bool mask [Bt, 1, Q, K], or its key tiles for a large call of several blocks,
        or streamed tiles (no dense mask) past ``stream_pairs``."""
        if layout.num_queries * layout.num_keys > self.stream_pairs:
            # runs of stream_queries // B blocks, each attended over only the keys it can see
            # (context range + own slots): neither the dense mask nor all runs' masks is built
            per_run = max(1, self.stream_queries // layout.block_size)
            return [StreamTile(layout, spec, n0, min(n0 + per_run, layout.num_blocks))
                    for n0 in range(0, layout.num_blocks, per_run)]
        mask = dense_mask(layout, spec)
        tiles = min(self.key_tiles, layout.num_blocks)
        if tiles <= 1 or layout.num_queries * layout.num_keys < self.min_pairs:
            return mask
        b = layout.block_size
        bounds = torch.linspace(0, layout.num_blocks, tiles + 1).round().long().tolist()
        out = []
        for n0, n1 in zip(bounds[:-1], bounds[1:]):
            rows = mask[:, :, n0 * b:n1 * b]
            key_idx = rows.any(dim=2).any(dim=0).any(dim=0).nonzero().squeeze(1)
            out.append(KeyTile(n0 * b, n1 * b, key_idx, rows.index_select(-1, key_idx)))
        return out

    def attend(self, q_bhqd: Tensor, k_bhkd: Tensor, v_bhkd: Tensor,
               prepared: Tensor | list[KeyTile] | list[StreamTile], *, scale: float,
               sink_h: Tensor | None = None) -> Tensor:
        if isinstance(prepared, Tensor):
            return _dense_attend(q_bhqd, k_bhkd, v_bhkd, prepared, scale, sink_h)
        if prepared and isinstance(prepared[0], StreamTile):
            return torch.cat([_attend_streamed(t, q_bhqd, k_bhkd, v_bhkd, scale, sink_h)
                              for t in prepared], dim=2)
        return torch.cat([
            _dense_attend(q_bhqd[:, :, t.q0:t.q1], k_bhkd.index_select(2, t.key_idx),
                          v_bhkd.index_select(2, t.key_idx), t.bias(q_bhqd.dtype), scale,
                          sink_h)
            for t in prepared], dim=2)


def _attend_streamed(tile: StreamTile, q_bhqd: Tensor, k_bhkd: Tensor, v_bhkd: Tensor,
                     scale: float, sink_h: Tensor | None) -> Tensor:
    """One streamed run [Bt, Hq, q1-q0, D]: under activation checkpointing when a gradient is
    being recorded, so the run's mask, gathered K/V and scores are freed after its forward and
    rebuilt for its backward (that is what keeps full layers linear in memory)."""
    q0, q1 = tile.n0 * tile.layout.block_size, tile.n1 * tile.layout.block_size

    def run(q: Tensor, k: Tensor, v: Tensor, sink: Tensor | None) -> Tensor:
        # the visible key indices [K'] and the bool mask [Bt, 1, q1-q0, K'] over them
        ranges = visible_key_ranges(tile.layout, tile.spec, tile.n0, tile.n1)
        dev = tile.layout.anchors_bn.device
        key_idx = torch.cat([torch.arange(k0, k1, device=dev) for k0, k1 in ranges])
        mask = torch.cat([mask_tile(tile.layout, tile.spec, q0, q1, k0, k1)
                          for k0, k1 in ranges], dim=-1)
        return _dense_attend(q[:, :, q0:q1], k.index_select(2, key_idx),
                             v.index_select(2, key_idx), mask, scale, sink)

    grads = STREAM_CHECKPOINT and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q_bhqd, k_bhkd, v_bhkd, sink_h))
    if not grads:
        return run(q_bhqd, k_bhkd, v_bhkd, sink_h)
    return checkpoint(run, q_bhqd, k_bhkd, v_bhkd, sink_h, use_reentrant=False)


def _dense_attend(q_bhqd: Tensor, k_bhkd: Tensor, v_bhkd: Tensor, mask: Tensor, scale: float,
                  sink_h: Tensor | None) -> Tensor:
    """One SDPA call: queries [Bt, Hq, Q, D] over keys [Bt, Hkv, K, D] with mask [Bt, 1, Q, K]
    (bool, True = attend, or additive in the queries' dtype)."""
    if sink_h is None:
        return F.scaled_dot_product_attention(
            q_bhqd, k_bhkd, v_bhkd, attn_mask=mask, scale=scale, enable_gqa=True)
    bt, hq, nq, _ = q_bhqd.shape
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q_bhqd.dtype, device=q_bhqd.device).masked_fill(
            ~mask, float("-inf"))
    bias = mask.expand(bt, hq, nq, -1)
    sink_col = sink_h.to(q_bhqd.dtype).view(1, hq, 1, 1).expand(bt, hq, nq, 1)
    bias = torch.cat([bias, sink_col], dim=-1)  # [Bt, Hq, Q, K+1]
    zero_kv = k_bhkd.new_zeros(*k_bhkd.shape[:2], 1, k_bhkd.shape[-1])
    k = torch.cat([k_bhkd, zero_kv], dim=2)
    v = torch.cat([v_bhkd, zero_kv], dim=2)
    return F.scaled_dot_product_attention(
        q_bhqd, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
