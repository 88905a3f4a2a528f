"""A reduced draft vocabulary (docs/draft_vocab.md; train/draft_vocab.py chooses it): the
drafter drafts from the N most frequent target tokens of its training data with its own frozen
[N, H] head (the target's rows of those tokens) and vLLM's d2t / t2d id maps. Any head that
drafts from the unary logits may switch it on (``drafter.draft_vocab_size``; DFlash 2 refuses
it); N = V normalises to None, the whole vocabulary."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_lab.model.heads import Head, register


class DraftVocab(Head):
    name = "draft_vocab"
    title = "draft vocabulary"

    def attach(self, drafter: Any) -> None:
        """Serving layout: ``lm_head.weight`` [N, H], ``d2t`` [N], ``t2d`` [V]."""
        n = drafter.config.draft_vocab_size
        if n is None:
            return
        drafter.lm_head = nn.Linear(drafter.config.hidden_size, n,
                                    bias=False).requires_grad_(False)
        drafter.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
        drafter.register_buffer("t2d", torch.zeros(drafter.config.vocab_size, dtype=torch.bool))

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """The draft head and vLLM's id maps (docs/draft_vocab.md)."""
        n = config.draft_vocab_size
        if n is None:
            return {}
        return {"lm_head.weight": (n, config.hidden_size), "d2t": (n,),
                "t2d": (config.vocab_size,)}

    def check_training(self, config: Any, module: Any) -> None:
        """A top-k capture's ids span the whole vocabulary: no teacher over N tokens."""
        n = config.draft_vocab_size
        if n is not None and module.teacher_kind not in ("none", "dense"):
            raise ValueError(
                f"drafter.draft_vocab_size={n} with a top-k capture "
                "(capture.distribution_topk): its ids span the target's whole vocabulary, so "
                "the teacher cannot be restricted to the draft vocabulary; capture with "
                "capture.distribution=[last_hidden] (or train online), or drop the "
                "distribution loss (module.loss=ce)")


FEATURE = register(DraftVocab(), feature=True)
