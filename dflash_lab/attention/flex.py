"""flex_attention backend: a BlockMask (H=None) built from the one predicate. Sorted anchors make
most (query tile, key tile) pairs empty, so the BlockMask skips them. On CUDA the mask builder and
the kernel are compiled. torch 2.13 has no flex backward on CPU: there this backend is
forward-only and says so instead of failing deep inside torch. Sinks use the returned
log-sum-exp (natural log).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dflash_lab.attention.mask import BlockLayout, LayerSpec, apply_sink, flex_mask_mod

log = logging.getLogger(__name__)

#: (Bt, Q, K) of every compiled flex call so far in this process (module-level: backends are
#: built per forward).
SEEN_SHAPES: set[tuple[int, int, int]] = set()


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _recompile_limit() -> int:
    """torch's per-function recompile limit (``recompile_limit``, ``cache_size_limit`` before)."""
    import torch._dynamo

    config = torch._dynamo.config
    return getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8)


def _note_compiled_shape(shape: tuple[int, int, int]) -> None:
    """Warn once when the compiled kernels have seen more shapes than torch recompiles for: one
    graph per (Bt, Q, K) (``dynamic=False``); past the limit new shapes run the slow unfused eager
    path, which materialises the scores. Fix: round lengths (``data.pad_to_multiple_of``)."""
    if shape in SEEN_SHAPES:
        return
    SEEN_SHAPES.add(shape)
    limit = _recompile_limit()
    if len(SEEN_SHAPES) == limit + 1:
        log.warning(
            "compiled flex attention has now seen %d distinct (batch, queries, keys) shapes, "
            "more than torch._dynamo.config recompile limit %d: new shapes run the slow eager "
            "flex path. Round batch lengths with data.pad_to_multiple_of=512 (the GPU recipes "
            "do) or keep batch size and length fixed.", len(SEEN_SHAPES), limit)


class FlexBackend:
    name = "flex"

    def __init__(self, compile_mask: bool = False):
        self.compile_mask = compile_mask

    def prepare(self, layout: BlockLayout, spec: LayerSpec) -> BlockMask:
        if self.compile_mask:
            _note_compiled_shape((layout.anchors_bn.shape[0], layout.num_queries,
                                  layout.num_keys))
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
