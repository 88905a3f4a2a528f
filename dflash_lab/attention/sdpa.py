"""Reference backend: torch SDPA with the dense boolean mask (CPU and GPU, with gradients).

Sinks are exact: one extra key column whose value row is zero and whose additive mask entry is
the sink logit ``b_h`` (so its score is exactly b_h, unscaled). Gradients reach ``b_h`` through
the float mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_lab.attention.mask import BlockLayout, dense_mask
from dflash_lab.model.config import LayerSpec


class SdpaBackend:
    name = "sdpa"

    def prepare(self, layout: BlockLayout, spec: LayerSpec) -> Tensor:
        """Dense bool mask [Bt, 1, Q, K]."""
        return dense_mask(layout, spec)

    def attend(self, q_bhqd: Tensor, k_bhkd: Tensor, v_bhkd: Tensor, prepared: Tensor, *,
               scale: float, sink_h: Tensor | None = None) -> Tensor:
        if sink_h is None:
            return F.scaled_dot_product_attention(
                q_bhqd, k_bhkd, v_bhkd, attn_mask=prepared, scale=scale, enable_gqa=True)
        bt, hq, nq, _ = q_bhqd.shape
        bias = torch.zeros(prepared.shape, dtype=q_bhqd.dtype, device=q_bhqd.device)
        bias = bias.masked_fill(~prepared, float("-inf")).expand(bt, hq, nq, -1)
        sink_col = sink_h.to(q_bhqd.dtype).view(1, hq, 1, 1).expand(bt, hq, nq, 1)
        bias = torch.cat([bias, sink_col], dim=-1)  # [Bt, Hq, Q, K+1]
        zero_kv = k_bhkd.new_zeros(*k_bhkd.shape[:2], 1, k_bhkd.shape[-1])
        k = torch.cat([k_bhkd, zero_kv], dim=2)
        v = torch.cat([v_bhkd, zero_kv], dim=2)
        return F.scaled_dot_product_attention(
            q_bhqd, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
