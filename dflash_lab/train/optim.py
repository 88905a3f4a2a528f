"""Muon for the drafter's weight matrices (attention and MLP projections, ``fc``), AdamW for the
rest (vectors, lookup tables, heads), as one optimizer: :class:`MuonAdamW`
(``module/optimizer=muon``), whose ``param_groups`` and ``state_dict`` hold both, so the schedule,
clipping and a resume act on both (docs/training.md, "Recipes, overrides and the run directory").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

#: Parameter-name parts that keep a 2-D parameter on AdamW (lookup tables and output heads).
ADAMW_ONLY = ("codebook", "embed", "lm_head")


def muon_params(named: Iterable[tuple[str, Tensor]]) -> tuple[list, list]:
    """Split trainable ``(name, parameter)`` pairs into (Muon, AdamW): Muon takes a 2-D
    matrix with both sides > 1 whose name has no :data:`ADAMW_ONLY` part."""
    muon, rest = [], []
    for name, param in named:
        if not param.requires_grad:
            continue
        matrix = param.ndim == 2 and min(param.shape) > 1
        (muon if matrix and not any(k in name for k in ADAMW_ONLY) else rest).append(
            (name, param))
    return muon, rest


class MuonAdamW(torch.optim.Optimizer):
    """Muon over the 2-D weight matrices, AdamW over the rest (:func:`muon_params`); ``params``:
    ``(name, parameter)`` pairs. ``lr``, ``weight_decay``, ``betas``, ``fused``: the AdamW group;
    ``muon_*`` the Muon group (``muon_lr`` None: ``lr``; ``match_rms_adamw`` scales Muon's update
    to AdamW's RMS, so one lr serves both)."""

    def __init__(self, params, lr: float = 6e-4, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), fused: bool | None = None,
                 muon_lr: float | None = None, muon_momentum: float = 0.95,
                 muon_weight_decay: float = 0.1, muon_ns_steps: int = 5,
                 muon_adjust_lr_fn: str = "match_rms_adamw"):
        named = list(params)
        if any(not (isinstance(p, tuple) and len(p) == 2) for p in named):
            raise ValueError("module/optimizer=muon needs (name, parameter) pairs, e.g. "
                             "model.named_parameters(): the names keep the codebooks and "
                             "heads on AdamW")
        matrices, rest = muon_params(named)
        self.parts: list[torch.optim.Optimizer] = []
        if matrices:
            self.parts.append(torch.optim.Muon(
                matrices, lr=lr if muon_lr is None else muon_lr, momentum=muon_momentum,
                weight_decay=muon_weight_decay, ns_steps=muon_ns_steps,
                adjust_lr_fn=muon_adjust_lr_fn))
        if rest:
            self.parts.append(torch.optim.AdamW(rest, lr=lr, betas=tuple(betas),
                                                weight_decay=weight_decay, fused=fused))
        if not self.parts:
            raise ValueError("module/optimizer=muon: the drafter has no trainable parameter")
        # the base class's own bookkeeping, without re-adding the groups the parts hold
        super().__init__([{"params": [torch.zeros(0, requires_grad=True)]}], {"lr": lr})
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict:  # type: ignore[override]
        """Both optimizers' per-parameter states (the same dicts: edits reach them)."""
        return {p: s for part in self.parts for p, s in part.state.items()}

    @state.setter
    def state(self, value) -> None:  # the base __init__ assigns one; the parts hold the state
        pass

    @torch.no_grad()
    def step(self, closure=None):
        """One step of both (the closure, Lightning's forward + backward, runs once)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [type(p).__name__ for p in self.parts],
                "states": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Both states back; ValueError when the checkpoint's optimizer was another one (an
        AdamW run resumed with module/optimizer=muon: start it fresh instead)."""
        kinds = [type(p).__name__ for p in self.parts]
        if state_dict.get("parts") != kinds:
            got = state_dict.get("parts") or "a single optimizer (module/optimizer=adamw)"
            raise ValueError(f"module/optimizer=muon: the checkpoint's optimizer state is {got}, "
                             f"not {kinds}; resume it with the optimizer it was trained with, or "
                             "start fresh (ckpt_path=null, drafter.init_from=the checkpoint)")
        for part, state in zip(self.parts, state_dict["states"], strict=True):
            part.load_state_dict(state)
        self.param_groups = [g for part in self.parts for g in part.param_groups]
