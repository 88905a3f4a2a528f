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

from dflash_lab.attention import flash, flex, sdpa
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


def _is_cuda(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device (one place, so tests can tell the selection it is)."""
    return torch.device(device).type == "cuda"


def resolve_backend_name(name: str, device: torch.device | str, *, packed: bool) -> str:
    """THE backend choice: ``sdpa`` | ``flex`` | ``flash`` as given, or ``auto``: sdpa on CPU; on
    CUDA flex when ``packed`` (many blocks per row: training, validation, features mode), else
    flash if installed, else flex. flash for packed blocks is an error, not a fallback."""
    if name not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown attention backend '{name}': use one of {list(BACKENDS)} or "
                         "'auto'")
    if name == "flash" and packed:
        raise ValueError("attention backend 'flash' serves the one-block inference layout only; "
                         "training, validation and features-mode eval attend packed blocks: use "
                         "backend 'auto' (flex on GPU, flash for decoding) or 'flex' / 'sdpa'")
    if name != "auto":
        return name
    if not _is_cuda(device):
        return "sdpa"
    if packed:
        return "flex"
    if flash.flash_attn_available():
        return "flash"
    _log_once(("no-flash", str(device)), logging.WARNING,
              "flash-attn is not installed (pip install -e '.[gpu]'); auto uses flex for decoding")
    return "flex"


_LOGGED: set = set()


def _log_once(key: Any, level: int, msg: str, *args: Any) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.log(level, msg, *args)


def get_backend(name: str, device: torch.device | str = "cpu", *, packed: bool = True,
                static_shapes: bool = False) -> AttentionBackend:
    """The backend for one layout kind (:func:`resolve_backend_name`); ``auto``'s choice is logged
    once per device and layout kind. ``static_shapes``: the caller is compiled and needs the same
    shapes every step (sdpa then makes one dense call instead of anchor-dependent key tiles)."""
    chosen = resolve_backend_name(name, device, packed=packed)
    if name == "auto":
        _log_once((chosen, str(device), packed), logging.INFO,
                  "attention backend 'auto' resolved to '%s' on %s (%s layout)", chosen, device,
                  "packed blocks" if packed else "inference")
    if chosen == "sdpa":
        return sdpa.SdpaBackend(key_tiles=1 if static_shapes else sdpa.KEY_TILES)
    if chosen == "flex":
        return flex.FlexBackend(compile_mask=torch.device(device).type == "cuda")
    return flash.FlashBackend()
