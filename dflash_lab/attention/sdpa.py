"""Reference backend: torch SDPA with the dense boolean mask (CPU and GPU, with gradients).

Sinks are exact: one extra key column whose value row is zero and whose additive mask entry is
the sink logit ``b_h`` (so its score is exactly b_h, unscaled). Gradients reach ``b_h`` through
the float mask.

Key tiles (training layout): a dense call scores every query against all K = S + N*B keys,
while a block sees only the context before its anchor and its own B slots (about a third of the
keys at S = 512, N = 32, B = 8). With sorted anchors, consecutive blocks see nearly the same
context prefix, so :meth:`SdpaBackend.prepare` cuts the N blocks into up to
:data:`KEY_TILES` runs of consecutive blocks and keeps, per run, only the key columns some of
its queries can see (read off the dense mask itself, so the predicate stays the only rule).
Each run is one SDPA call over its own keys: the same softmax rows without the masked-out
columns, about half the attention work at that size (benchmarks/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_lab.attention.mask import BlockLayout, LayerSpec, dense_mask

KEY_TILES = 4  # runs of consecutive blocks per call; 1 turns tiling off
MIN_TILED_PAIRS = 1 << 16  # below this many query-key pairs, per-call overhead wins: one call


@dataclass
class KeyTile:
    """Queries [q0, q1) attend to the keys ``key_idx`` [K'] under ``mask`` [Bt, 1, q1-q0, K']."""

    q0: int
    q1: int
    key_idx: Tensor
    mask: Tensor


class SdpaBackend:
    name = "sdpa"

    def __init__(self, key_tiles: int = KEY_TILES, min_pairs: int = MIN_TILED_PAIRS):
        self.key_tiles, self.min_pairs = key_tiles, min_pairs

    def prepare(self, layout: BlockLayout, spec: LayerSpec) -> Tensor | list[KeyTile]:
        """Dense bool mask [Bt, 1, Q, K], or its key tiles for a large call of several blocks."""
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
               prepared: Tensor | list[KeyTile], *, scale: float,
               sink_h: Tensor | None = None) -> Tensor:
        if isinstance(prepared, Tensor):
            return _dense_attend(q_bhqd, k_bhkd, v_bhkd, prepared, scale, sink_h)
        return torch.cat([
            _dense_attend(q_bhqd[:, :, t.q0:t.q1], k_bhkd.index_select(2, t.key_idx),
                          v_bhkd.index_select(2, t.key_idx), t.mask, scale, sink_h)
            for t in prepared], dim=2)


def _dense_attend(q_bhqd: Tensor, k_bhkd: Tensor, v_bhkd: Tensor, mask: Tensor, scale: float,
                  sink_h: Tensor | None) -> Tensor:
    """One SDPA call: queries [Bt, Hq, Q, D] over keys [Bt, Hkv, K, D] with mask [Bt, 1, Q, K]."""
    if sink_h is None:
        return F.scaled_dot_product_attention(
            q_bhqd, k_bhkd, v_bhkd, attn_mask=mask, scale=scale, enable_gqa=True)
    bt, hq, nq, _ = q_bhqd.shape
    bias = torch.zeros(mask.shape, dtype=q_bhqd.dtype, device=q_bhqd.device)
    bias = bias.masked_fill(~mask, float("-inf")).expand(bt, hq, nq, -1)
    sink_col = sink_h.to(q_bhqd.dtype).view(1, hq, 1, 1).expand(bt, hq, nq, 1)
    bias = torch.cat([bias, sink_col], dim=-1)  # [Bt, Hq, Q, K+1]
    zero_kv = k_bhkd.new_zeros(*k_bhkd.shape[:2], 1, k_bhkd.shape[-1])
    k = torch.cat([k_bhkd, zero_kv], dim=2)
    v = torch.cat([v_bhkd, zero_kv], dim=2)
    return F.scaled_dot_product_attention(
        q_bhqd, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
