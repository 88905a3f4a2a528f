"""flash-attn backend for the inference layout (one block right after each cached context),
where the bottom-right causal flag and (left, right) window express the DFlash predicate exactly
(:func:`dflash_lab.attention.mask.flash_window_args`); training layouts and packed documents are
refused; lazily imported (docs/training.md, "The drafter and its attention").
"""

from __future__ import annotations

import importlib.util
from typing import Any

from torch import Tensor

from dflash_lab.attention.mask import (
    BlockLayout,
    LayerSpec,
    apply_sink,
    flash_window_args,
    is_inference_layout,
)

#: The kernel, ``flash_attn.flash_attn_func``; loaded on first use (tests may replace it).
_flash_attn_func: Any = None


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _kernel() -> Any:
    global _flash_attn_func
    if _flash_attn_func is None:
        try:
            from flash_attn import flash_attn_func
        except ImportError as err:
            raise RuntimeError(
                "attention backend 'flash' needs flash-attn, which is not installed: on a CUDA "
                "machine run `pip install -e \".[gpu]\"`, or choose backend 'flex' or 'sdpa'"
            ) from err
        _flash_attn_func = flash_attn_func
    return _flash_attn_func


class FlashBackend:
    name = "flash"

    def prepare(self, layout: BlockLayout, spec: LayerSpec) -> tuple[tuple[int, int], bool]:
        if not is_inference_layout(layout):
            raise ValueError(
                "attention backend 'flash' supports the inference layout only (one block per "
                "sequence anchored right after its context, one document per row); use 'flex' "
                "for packed training and for packed documents (data.pack=true)")
        return flash_window_args(spec)

    def attend(self, q_bhqd: Tensor, k_bhkd: Tensor, v_bhkd: Tensor,
               prepared: tuple[tuple[int, int], bool], *, scale: float,
               sink_h: Tensor | None = None) -> Tensor:
        window, causal = prepared
        # flash-attn takes [Bt, L, H, D]; GQA is native (fewer k/v heads).
        out_bqhd, lse_bhq, _ = _kernel()(
            q_bhqd.transpose(1, 2), k_bhkd.transpose(1, 2), v_bhkd.transpose(1, 2),
            softmax_scale=scale, causal=causal, window_size=window, return_attn_probs=True)
        return apply_sink(out_bqhd.transpose(1, 2), lse_bhq, sink_h)
