"""Anchor sampling for DFlash training blocks (dflash.md section 2): p anchors a block when p and
p+1 are in the loss mask (and, packed, in one document); up to N per sequence (per document when
packed), without replacement, sorted, seeded by (seed, step, rank) (docs/data.md, "Packed rows").

Shape legend: Bt batch, S sequence length, N anchors per row.
"""

from __future__ import annotations

import torch
from torch import Tensor


def anchor_candidates(loss_mask_bs: Tensor, document_ids_bs: Tensor | None = None) -> Tensor:
    """Bool [Bt, S]: ``loss_mask[p] and loss_mask[p+1]`` (the last position never qualifies);
    with ``document_ids_bs`` also ``doc[p] == doc[p+1]`` (nor does a document's last one)."""
    lm = loss_mask_bs.bool()
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:]
    if document_ids_bs is not None:
        ok[:, :-1] &= document_ids_bs[:, :-1] == document_ids_bs[:, 1:]
    return ok


def sample_anchors(loss_mask_bs: Tensor, num_anchors: int, generator: torch.Generator,
                   document_ids_bs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Draw up to ``num_anchors`` sorted anchors per row (per document with ``document_ids_bs``
    [Bt, S]: :func:`sample_document_anchors`). Returns (anchors_bn long [Bt, N], valid_bn bool
    [Bt, N]), N = min(num_anchors, most candidates in a row); invalid padding entries repeat the
    row's last anchor (0 if none), keeping rows sorted, and carry no loss."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors}: must be >= 1")
    if document_ids_bs is not None:
        return sample_document_anchors(loss_mask_bs, document_ids_bs, num_anchors, generator)
    cand = anchor_candidates(loss_mask_bs).cpu()
    # Random keys, -1 for non-candidates: top-k picks a uniform sample without replacement.
    keys = torch.rand(cand.shape, generator=generator).masked_fill(~cand, -1.0)
    n = max(1, min(num_anchors, int(cand.sum(1).max())))
    top_keys, picked = keys.topk(n, dim=1)
    valid = top_keys >= 0
    order = torch.where(valid, picked, torch.full_like(picked, cand.shape[1])).argsort(dim=1)
    picked, valid = picked.gather(1, order), valid.gather(1, order)
    last = torch.where(valid, picked, torch.zeros_like(picked)).max(dim=1, keepdim=True).values
    anchors = torch.where(valid, picked, last)
    return anchors.to(loss_mask_bs.device), valid.to(loss_mask_bs.device)


def sample_document_anchors(loss_mask_bs: Tensor, document_ids_bs: Tensor, num_anchors: int,
                            generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to ``num_anchors`` anchors per document of packed rows, as :func:`sample_anchors`
    returns them (N = the most any row got): one random key per position, rows sorted by
    (document, key descending), a candidate kept when its rank in its document is below
    ``num_anchors``: a uniform sample without replacement per document."""
    cand = anchor_candidates(loss_mask_bs, document_ids_bs).cpu()
    docs = document_ids_bs.cpu().long()
    keys = torch.rand(cand.shape, generator=generator, dtype=torch.float64)
    keys = keys.masked_fill(~cand, -1.0)  # in [-1, 1): a non-candidate ranks after its document
    order = (docs.double() * 4.0 - keys).argsort(dim=1, stable=True)
    sorted_docs = docs.gather(1, order)
    pos = torch.arange(cand.shape[1]).expand_as(docs)
    first = torch.ones_like(cand)
    first[:, 1:] = sorted_docs[:, 1:] != sorted_docs[:, :-1]
    group_start = torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values
    rank = torch.empty_like(pos).scatter_(1, order, pos - group_start)
    picked_bs = cand & (rank < num_anchors)
    n = max(1, int(picked_bs.sum(1).max()))
    seq = cand.shape[1]
    picked = torch.where(picked_bs, pos, torch.full_like(pos, seq)).sort(dim=1).values[:, :n]
    valid = picked < seq
    last = torch.where(valid, picked, torch.zeros_like(picked)).max(dim=1, keepdim=True).values
    anchors = torch.where(valid, picked, last)
    return anchors.to(loss_mask_bs.device), valid.to(loss_mask_bs.device)


def step_generator(seed: int, step: int, rank: int = 0) -> torch.Generator:
    """A CPU generator per (seed, step, rank): same anchors after a resume, other per step/rank."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63 - 1))
    return g
