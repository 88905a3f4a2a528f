"""A test-only head, added the documented way (docs/architecture.md, "Add a head"): DFlash 1
plus a probe that learns, from each drafted slot's hidden state, whether the slot's draft is
right, trained with a BCE term beside the CE. It drafts as DFlash 1 (the probe never changes a
token), declares one config field, and is served under its own architecture name.

Registered on import; a process that should know it (a stage command) lists this module in
``DFLASH_LAB_HEADS``."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from dflash_lab.heads.dflash1 import DFlash1
from dflash_lab.model.heads import register
from dflash_lab.train.objective import Term


class Toy(DFlash1):
    name = "toy"
    title = "Toy"
    architecture = "ToyDraftModel"
    fields = {"toy_probe_weight": 0.5}

    def validate(self, config: Any) -> None:
        weight = config.toy_probe_weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight >= 0:
            config._fail("toy_probe_weight", weight, "must be a number >= 0 (0 = probe off)")

    def attach(self, drafter: Any) -> None:
        drafter.toy_probe = nn.Linear(drafter.config.hidden_size, 1)

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        return {"toy_probe.weight": (1, config.hidden_size), "toy_probe.bias": (1,)}

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """BCE of the probe's logit at every valid slot [M] against its correctness."""
        valid = step.tgt.valid
        logit_m = module.drafter.toy_probe(step.hidden[valid]).squeeze(-1).float()
        target_m = out.correct[valid].float()
        out.head_pieces["toy"] = (
            F.binary_cross_entropy_with_logits(logit_m, target_m, reduction="sum"),
            valid.sum().float())

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        total, count = out.head_pieces["toy"]
        return [Term("toy", total, count, module.drafter.config.toy_probe_weight, "toy_loss")]


HEAD = register(Toy())
