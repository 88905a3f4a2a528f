"""What the speculative loop asks of a drafter (:class:`Proposer`, so tests plug in doubles such
as an oracle of the target's continuation), and the DFlash implementation of it. The context
holds the features of committed positions 0..C-1; the anchor (the last committed token, the
target's bonus) sits at C, its features not known yet. A proposer returns draft logits
(:meth:`Proposer.propose`; the loop samples from them) or, with a ``draft`` method like
:class:`DFlashProposer`, the drafts themselves (:class:`Draft`): a selector walk picks each slot
given the previous pick, so its drafts and q cannot come from one logits tensor.

Shape legend: n new positions, F = nL*H target features, B block size, k drafts, V vocab.
"""

from __future__ import annotations

import copy
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn

from dflash_lab.eval.sampling import propose
from dflash_lab.model.drafter import DFlashDrafter


class Draft(NamedTuple):
    """One round's drafts: ``tokens`` [k]; ``probs`` q [k, V] (rejection sampling) or None;
    ``unary_tokens`` [k]: a DFlash 2 drafter's unary argmax (for the unary tau) or None."""

    tokens: Tensor
    probs: Tensor | None = None
    unary_tokens: Tensor | None = None


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


def max_drafts(proposer: Proposer) -> int:
    """Drafts per round of ``proposer``: ``num_draft_tokens`` (B: sample_from_anchor), else B-1."""
    return int(getattr(proposer, "num_draft_tokens", proposer.block_size - 1))


def draft_block(proposer: Proposer, anchor_id: int, num_drafts: int, temperature: float,
                mode: str, generator: torch.Generator | None) -> Draft:
    """``num_drafts`` (<= B-1) drafts from any proposer: its own ``draft``, else sampled
    (:func:`~dflash_lab.eval.sampling.propose`) from the first ``num_drafts`` rows of its logits."""
    own = getattr(proposer, "draft", None)
    if own is not None:
        return own(anchor_id, num_drafts, temperature, mode, generator)
    tokens, q = propose(proposer.propose(anchor_id)[:num_drafts], temperature, mode, generator)
    return Draft(tokens, q)


class DFlashProposer:
    """A :class:`DFlashDrafter` over the target's frozen embedding and LM head. ``block_size``
    may be below the trained one: blocks of that size (anchor + block_size-1 MASK slots), as
    engines run ``num_speculative_tokens = block_size - 1``. A round asking for fewer drafts (near
    the budget) runs a block of just that many slots, as z-lab's ``dflash_generate``: with
    bidirectional attention and the DFlash 2 conv a shorter block is not a prefix of a longer
    one. A head with its own walk drafts with it (``Head.draft``); a ``sample_from_anchor``
    drafter drafts from slot 0 too: B drafts (``num_draft_tokens``)."""

    def __init__(self, drafter: DFlashDrafter, embed_tokens: nn.Module, lm_head: nn.Module,
                 block_size: int | None = None):
        trained = drafter.config.block_size
        block_size = trained if block_size is None else int(block_size)
        if not 2 <= block_size <= trained:
            raise ValueError(f"block_size={block_size}: must be in [2, {trained}] (the drafter "
                             f"was trained with block_size={trained}; larger blocks were never "
                             "trained); omit it to use the trained size")
        self.min_slots = drafter.config.head.min_slots(drafter.config)  # DFlash 2: K - 1 taps
        if block_size < self.min_slots:
            raise ValueError(f"block_size={block_size}: this {drafter.config.head.title} "
                             f"drafter runs on blocks of at least {self.min_slots} slots (the "
                             f"head's min_slots); use block_size >= {self.min_slots}")
        self._trained = drafter
        self._views = {trained: drafter}
        self.drafter = self._view(block_size)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = block_size
        #: the first drafting slot (DrafterConfig.first_draft_slot: 1, or 0 sample_from_anchor)
        self.first_slot = drafter.config.first_draft_slot
        self.num_draft_tokens = block_size - self.first_slot
        self.cache = drafter.new_cache()

    @property
    def context_length(self) -> int:
        return self.cache.length

    def start(self, features_nf: Tensor) -> None:
        self.cache = self.drafter.new_cache()
        self.extend(features_nf)

    def extend(self, features_nf: Tensor) -> None:
        self.drafter.extend_context(self.cache, features_nf.to(self.drafter.fc.weight.device))

    def _view(self, num_slots: int) -> DFlashDrafter:
        """The drafter running blocks of ``num_slots`` slots (built once, weights shared)."""
        if num_slots not in self._views:
            self._views[num_slots] = _with_block_size(self._trained, num_slots)
        return self._views[num_slots]

    def _hidden(self, anchor_id: int, num_slots: int) -> Tensor:
        """Final-normed hidden [n, H] of a block of ``num_slots`` slots at the anchor."""
        drafter = self._view(num_slots)
        anchor = torch.tensor([anchor_id], dtype=torch.long, device=drafter.fc.weight.device)
        return drafter.draft(self.cache, anchor, self.embed_tokens)[0]

    def _unary(self, hidden_kh: Tensor) -> Tensor:
        """Unary logits [k, V] float32 (output_multiplier, softcap) in the head's dtype."""
        return self.drafter.unary_logits(hidden_kh.to(self.lm_head.weight.dtype),
                                         self.lm_head).float()

    @torch.no_grad()
    def propose(self, anchor_id: int) -> Tensor:
        """Unary draft logits [num_draft_tokens, V] (B-1; B with sample_from_anchor; a DFlash 2
        drafter's selector re-ranks their top-K)."""
        return self._unary(self._hidden(anchor_id, self.block_size)[self.first_slot:])

    @torch.no_grad()
    def draft(self, anchor_id: int, num_drafts: int, temperature: float, mode: str,
              generator: torch.Generator | None) -> Draft:
        """``num_drafts`` drafts from a block of ``num_drafts + 1`` slots (``num_drafts`` with
        sample_from_anchor, at least 2; see the class doc). A head whose walk needs more slots
        than a short tail round drafts (``min_slots``: a DFlash 2 conv's taps, LiLiCorr's and
        XPress's whole block) walks the shortest block it runs on, every slot of it (LiLiCorr's
        lattice attends over all of them, as the engines' fixed-length draft), and keeps the
        first drafts (z-lab's loop fails there)."""
        first = self.first_slot
        if not 1 <= num_drafts <= self.num_draft_tokens:
            raise ValueError(f"num_drafts={num_drafts}: must be in [1, {self.num_draft_tokens}]")
        hidden_bh = self._hidden(anchor_id, max(num_drafts + first, self.min_slots))
        unary_kv = self._unary(hidden_bh[first:])
        head = self.drafter.config.head
        walked = head.draft(self.drafter, hidden_bh if head.block_rows else hidden_bh[first:],
                            unary_kv, anchor_id, temperature, mode, generator, self.embed_tokens,
                            None if self.cache.rows is None else self.cache.rows[0, -1])
        if walked is None:  # the unary head's draft
            return Draft(*propose(unary_kv[:num_drafts], temperature, mode, generator))
        tokens, q = walked
        return Draft(tokens[:num_drafts], None if q is None else q[:num_drafts],
                     unary_kv[:num_drafts].argmax(-1))


def _with_block_size(drafter: DFlashDrafter, block_size: int) -> DFlashDrafter:
    """A drafter sharing ``drafter``'s weights (no copy) whose blocks are ``block_size`` long: built
    on the meta device from a config of that block length and given ``drafter``'s tensors, so a
    short block costs no memory and a head's block-aware modules (DFlash 2's convs, cut at the
    block start) are built for it. The config is copied without re-validation: a tail block may
    be shorter than the conv kernel (``conv_kernel_size <= block_size`` is a training rule)."""
    config = copy.copy(drafter.config)
    config.block_size = block_size
    with torch.device("meta"):
        view = DFlashDrafter(config, backend=drafter.backend_name)
    view.load_state_dict(drafter.state_dict(), assign=True)
    view.rotary = drafter.rotary  # inv_freq is a non-persistent buffer: not in the state dict
    view.static_shapes = drafter.static_shapes
    return view.eval()
