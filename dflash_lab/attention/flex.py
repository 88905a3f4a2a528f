"""flex_attention backend: a BlockMask (H=None) built from the one predicate.

Sorted anchors make most (query tile, key tile) pairs empty, so the BlockMask skips them. On CUDA
the mask builder and the kernel are compiled. torch 2.13 has no flex backward on CPU: there this
backend is forward-only and says so instead of failing deep inside torch.
Sinks use the returned log-sum-exp (natural log).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dflash_lab.attention.base import apply_sink
from dflash_lab.attention.mask import BlockLayout, flex_mask_mod
from dflash_lab.model.config import LayerSpec


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


class FlexBackend:
    name = "flex"

    def __init__(self, compile_mask: bool = False):
        self.compile_mask = compile_mask

    def prepare(self, layout: BlockLayout, spec: LayerSpec) -> BlockMask:
        build = _compiled(create_block_mask) if self.compile_mask else create_block_mask
        return build(flex_mask_mod(layout, spec), B=layout.anchors_bn.shape[0], H=None,
                     Q_LEN=layout.num_queries, KV_LEN=layout.num_keys,
                     device=layout.anchors_bn.device)

    def attend(self, q_bhqd: Tensor, k_bhkd: Tensor, v_bhkd: Tensor, prepared: BlockMask, *,
               scale: float, sink_h: Tensor | None = None) -> Tensor:
        on_cpu = q_bhqd.device.type == "cpu"
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (q_bhqd, k_bhkd, v_bhkd))
        if on_cpu and needs_grad:
            raise RuntimeError(
                "the flex backend has no backward on CPU (torch 2.13): train on CPU with "
                "attention backend 'sdpa', or run flex under torch.no_grad()")
        kernel = flex_attention if on_cpu else _compiled(flex_attention)
        out, lse = kernel(q_bhqd, k_bhkd, v_bhkd, block_mask=prepared, scale=scale,
                          enable_gqa=True, return_lse=True)
        return apply_sink(out, lse, sink_h)
