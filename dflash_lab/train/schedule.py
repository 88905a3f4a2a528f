"""Learning-rate schedule: linear warmup then cosine decay (paper: 4% warmup)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float = 0.04,
                  min_lr_ratio: float = 0.0) -> LambdaLR:
    """LR factor rises linearly over ``warmup_ratio * total_steps`` steps, then follows a cosine
    down to ``min_lr_ratio`` at ``total_steps``. Stepped once per optimizer step."""
    if total_steps < 1:
        raise ValueError(f"scheduler total_steps={total_steps}: must be >= 1")
    if not 0 <= warmup_ratio < 1:
        raise ValueError(f"scheduler warmup_ratio={warmup_ratio}: must be in [0, 1)")
    warmup = int(round(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
