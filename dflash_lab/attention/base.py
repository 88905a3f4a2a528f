"""The one signature every attention backend implements, and backend selection by name.

Shape legend: Bt batch, Hq query heads, Hkv key/value heads (GQA: Hkv divides Hq), Q queries,
K keys, D head dim. ``sink_h`` is one sink logit per query head (dflash.md section 1): it adds an
extra softmax column with no value and is NOT multiplied by the softmax scale.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch import Tensor

from dflash_lab.attention.mask import BlockLayout, LayerSpec

log = logging.getLogger(__name__)

BACKENDS = ("sdpa", "flex", "flash")


class AttentionBackend(Protocol):
    """``prepare`` runs once per (layout, layer spec) per forward; ``attend`` once per layer."""

    name: str

    def prepare(self, layout: BlockLayout, spec: LayerSpec) -> Any: ...

    def attend(self, q_bhqd: Tensor, k_bhkd: Tensor, v_bhkd: Tensor, prepared: Any, *,
               scale: float, sink_h: Tensor | None = None) -> Tensor:
        """Returns the attention output [Bt, Hq, Q, D]."""
        ...


def apply_sink(out_bhqd: Tensor, lse_bhq: Tensor, sink_h: Tensor | None) -> Tensor:
    """Exact sink via the log-sum-exp: ``out * sigmoid(lse - b_h)`` (= e^lse / (e^lse + e^b))."""
    if sink_h is None:
        return out_bhqd
    gate = torch.sigmoid(lse_bhq.float() - sink_h.float()[None, :, None])
    return (out_bhqd.float() * gate[..., None]).to(out_bhqd.dtype)


def get_backend(name: str, device: torch.device | str = "cpu", *,
                training: bool = False, static_shapes: bool = False) -> AttentionBackend:
    """Backend by name: ``sdpa`` | ``flex`` | ``flash`` | ``auto``.

    Only ``auto`` may pick a backend for you, and it logs what it picked: flex for training on
    CUDA, flash for inference on CUDA when flash-attn is installed (else flex), sdpa on CPU.
    ``static_shapes``: the caller is compiled and needs the same shapes every step (sdpa then
    makes one dense call instead of anchor-dependent key tiles).
    """
    device = torch.device(device)
    if name == "auto":
        name = _auto_choice(device, training)
        log.info("attention backend 'auto' resolved to '%s' on %s", name, device)
    if name == "sdpa":
        from dflash_lab.attention.sdpa import KEY_TILES, SdpaBackend
        return SdpaBackend(key_tiles=1 if static_shapes else KEY_TILES)
    if name == "flex":
        from dflash_lab.attention.flex import FlexBackend
        return FlexBackend(compile_mask=device.type == "cuda")
    if name == "flash":
        from dflash_lab.attention.flash import FlashBackend
        return FlashBackend()
    raise ValueError(f"unknown attention backend '{name}': use one of {list(BACKENDS)} or 'auto'")


def _auto_choice(device: torch.device, training: bool) -> str:
    if device.type != "cuda":
        return "sdpa"
    if training:
        return "flex"
    from dflash_lab.attention.flash import flash_attn_available
    if flash_attn_available():
        return "flash"
    log.warning("flash-attn is not installed (pip install -e '.[gpu]'); auto uses flex")
    return "flex"
