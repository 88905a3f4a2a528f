"""Anchor sampling for DFlash training blocks (dflash.md section 2).

A position p can anchor a block when the token at p and the token at p+1 are both inside the loss
mask (the block must predict at least one supervised token). Per sequence we draw up to N of
them without replacement, SORTED (sorted anchors keep the flex BlockMask sparse), freshly for
every step from a generator seeded by (seed, step, rank) so runs and resumes are reproducible.

Shape legend: Bt batch, S sequence length, N anchors per row.
"""

from __future__ import annotations

import torch
from torch import Tensor


def anchor_candidates(loss_mask_bs: Tensor) -> Tensor:
    """Bool [Bt, S]: ``loss_mask[p] and loss_mask[p+1]`` (the last position never qualifies)."""
    lm = loss_mask_bs.bool()
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return ok


def sample_anchors(loss_mask_bs: Tensor, num_anchors: int, generator: torch.Generator,
                   ) -> tuple[Tensor, Tensor]:
    """Draw up to ``num_anchors`` sorted anchors per row.

    Returns (anchors_bn long [Bt, N], valid_bn bool [Bt, N]) with N = min(num_anchors, most
    candidates in any row). Padding entries repeat the row's last anchor (0 when the row has none)
    so rows stay sorted; they are marked invalid and carry no loss.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors}: must be >= 1")
    cand = anchor_candidates(loss_mask_bs).cpu()
    # Random keys, -1 for non-candidates: top-k picks a uniform sample without replacement.
    keys = torch.rand(cand.shape, generator=generator).masked_fill(~cand, -1.0)
    n = max(1, min(num_anchors, int(cand.sum(1).max())))
    top_keys, picked = keys.topk(n, dim=1)
    valid = top_keys >= 0
    picked = torch.where(valid, picked, torch.full_like(picked, -1))
    order = torch.where(valid, picked, torch.full_like(picked, cand.shape[1])).argsort(dim=1)
    picked, valid = picked.gather(1, order), valid.gather(1, order)
    last = torch.where(valid, picked, torch.zeros_like(picked)).max(dim=1, keepdim=True).values
    anchors = torch.where(valid, picked, last)
    return anchors.to(loss_mask_bs.device), valid.to(loss_mask_bs.device)


def step_generator(seed: int, step: int, rank: int = 0) -> torch.Generator:
    """A CPU generator for one (seed, step, rank): same anchors after a resume, different per
    step and per rank."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63 - 1))
    return g
