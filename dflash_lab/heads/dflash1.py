"""DFlash 1: the plain head. The backbone's final-normed hidden state of every block slot goes
through the target's frozen LM head (the unary logits); the draft is their argmax (or a sample
at T > 0). It adds no config field, no module and no training term."""

from __future__ import annotations

from typing import Any

from dflash_lab.heads.dflash2 import refuse_selector_settings
from dflash_lab.model.heads import Head, register


class DFlash1(Head):
    name = "dflash1"
    title = "DFlash 1"
    architecture = "DFlashDraftModel"

    def check_training(self, config: Any, module: Any) -> None:
        """``module.selector`` settings would do nothing without a selector: refused."""
        refuse_selector_settings(module.selector, self.name)


HEAD = register(DFlash1())
