"""Small deterministic building blocks for tests (no downloads): tiny drafter configs over every
layer layout, a pure-torch flash-attn stand-in and its visibility rule, a kill-at-step callback."""

from __future__ import annotations

from typing import Any

from dflash_lab.model.config import FULL, SLIDING, DrafterConfig

#: Layer layouts worth covering everywhere: name -> (layer_types, is_causal, sliding_window).
LAYOUTS: dict[str, tuple[list[str], Any, int | None]] = {
    "full_bidirectional": ([FULL, FULL], None, None),
    "full_causal": ([FULL, FULL], True, None),
    "sliding_causal": ([SLIDING, SLIDING], None, 6),
    "sliding_bidirectional": ([SLIDING, SLIDING], False, 6),
    "sliding_bidirectional_narrow": ([SLIDING, SLIDING], False, 2),  # W < B
    "mixed_swa": ([SLIDING, FULL], None, 5),  # sliding causal + full bidirectional
    "mixed_per_layer": ([FULL, SLIDING], [True, False], 3),
}


def tiny_drafter_config(layout: str = "full_bidirectional", **overrides: Any) -> DrafterConfig:
    """A 2-layer GQA drafter over a 48-wide, 6-layer, 97-token pretend target."""
    layer_types, is_causal, window = LAYOUTS[layout]
    kwargs: dict[str, Any] = dict(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, vocab_size=97, mask_token_id=96,
        num_target_layers=6, target_layer_ids=[1, 3, 4], block_size=4,
        layer_types=layer_types, is_causal=is_causal, sliding_window=window,
    )
    kwargs.update(overrides)
    return DrafterConfig.create(source=f"tiny_drafter_config({layout})", **kwargs)


def flash_window_mask(num_q: int, num_k: int, window: tuple[int, int], causal: bool):
    """flash-attn's documented visibility rule, in plain torch (bool [num_q, num_k]).

    Query i sees keys in ``[i + Lk - Lq - left, i + Lk - Lq + right]`` (bottom-right aligned,
    -1 = unbounded); ``causal`` additionally caps the right side at 0.
    """
    import torch

    left, right = window
    i = torch.arange(num_q)[:, None]
    j = torch.arange(num_k)[None, :]
    diag = i + num_k - num_q
    ok = torch.ones(num_q, num_k, dtype=torch.bool)
    if causal:
        ok &= j <= diag
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def emulated_flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                             return_attn_probs=False, **_: Any):
    """A pure-torch stand-in for ``flash_attn.flash_attn_func`` (CPU tests of the flash wiring).

    q [Bt, Lq, Hq, D], k/v [Bt, Lk, Hkv, D] -> (out [Bt, Lq, Hq, D], lse [Bt, Hq, Lq], None).
    """
    import torch

    hq, hkv = q.shape[2], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    qh = q.transpose(1, 2).float()
    kh = k.transpose(1, 2).float().repeat_interleave(hq // hkv, dim=1)
    vh = v.transpose(1, 2).float().repeat_interleave(hq // hkv, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale
    allowed = flash_window_mask(q.shape[1], k.shape[1], window_size, causal).to(q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2).to(q.dtype)
    return (out, lse, None) if return_attn_probs else out


def kill_at_step_callback(step: int):
    """A Lightning callback that SIGKILLs its own process when training reaches ``step``:
    the closest thing to pulling the plug, used to test resume."""
    import os
    import signal

    import lightning as L

    class KillAtStep(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step >= step:
                os.kill(os.getpid(), signal.SIGKILL)

    return KillAtStep()
