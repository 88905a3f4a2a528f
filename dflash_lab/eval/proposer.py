"""What the speculative loop asks of a drafter, and the DFlash implementation of it.

The loop talks to a :class:`Proposer` only, so tests can plug in doubles (an oracle that knows
the target's continuation) and benchmarks could plug in other drafters. Position bookkeeping:
the proposer's context holds the features of committed positions 0..C-1; the anchor (the last
committed token, the target's bonus) sits at position C and its features are not known yet.

Shape legend: n new positions, F = nL*H target features, B block size, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import Tensor, nn

from dflash_lab.model.drafter import DFlashDrafter


class Proposer(Protocol):
    """A drafter as the loop sees it."""

    #: B: slots per block (anchor + B-1 drafts)
    block_size: int

    def start(self, features_nf: Tensor) -> None:
        """Begin a sequence whose first n positions have features [1, n, F]."""

    def extend(self, features_nf: Tensor) -> None:
        """Append the features [1, n, F] of the next n committed positions."""

    @property
    def context_length(self) -> int:
        """C: number of positions whose features are in the context."""

    def propose(self, anchor_id: int) -> Tensor:
        """Draft logits [B-1, V] for positions C+1..C+B-1 given the anchor at position C."""


class DFlashProposer:
    """A :class:`DFlashDrafter` over the target's frozen embedding and LM head.

    ``block_size`` may be smaller than the trained one: the drafter then runs blocks of that
    size (anchor + block_size-1 MASK slots), as serving engines do with
    ``num_speculative_tokens = block_size - 1``.
    """

    def __init__(self, drafter: DFlashDrafter, embed_tokens: nn.Module, lm_head: nn.Module,
                 block_size: int | None = None):
        trained = drafter.config.block_size
        block_size = trained if block_size is None else int(block_size)
        if not 2 <= block_size <= trained:
            raise ValueError(f"block_size={block_size}: must be in [2, {trained}] (the drafter "
                             f"was trained with block_size={trained}; larger blocks were never "
                             "trained); omit it to use the trained size")
        if block_size != trained:
            drafter = _with_block_size(drafter, block_size)
        self.drafter = drafter
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = block_size
        self.cache = drafter.new_cache()

    @property
    def context_length(self) -> int:
        return self.cache.length

    def start(self, features_nf: Tensor) -> None:
        self.cache = self.drafter.new_cache()
        self.extend(features_nf)

    def extend(self, features_nf: Tensor) -> None:
        self.drafter.extend_context(self.cache, features_nf.to(self.drafter.fc.weight.device))

    @torch.no_grad()
    def propose(self, anchor_id: int) -> Tensor:
        device = self.drafter.fc.weight.device
        anchor = torch.tensor([anchor_id], dtype=torch.long, device=device)
        hidden_bh = self.drafter.draft(self.cache, anchor, self.embed_tokens)[0]
        head_dtype = self.lm_head.weight.dtype
        return self.lm_head(hidden_bh[1:].to(head_dtype)).float()


def _with_block_size(drafter: DFlashDrafter, block_size: int) -> DFlashDrafter:
    """A drafter sharing ``drafter``'s weights whose blocks are ``block_size`` long."""
    config = dataclasses.replace(drafter.config, block_size=block_size)
    view = DFlashDrafter(config, backend=drafter.backend_name)
    view.load_state_dict(drafter.state_dict(), assign=True)
    return view.to(drafter.fc.weight.device).eval()
