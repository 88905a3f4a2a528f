"""Packed rows (``data.pack``): several whole documents per row, up to ``max_tokens_per_row``,
with ``document_ids`` [L] so that each document trains as it would alone in a row. The plan is
made once by greedy first-fit over a ``data.seed`` permutation; epochs shuffle the rows
(docs/data.md, "Packed rows").

Shape legend: L tokens of a packed row (<= max_tokens_per_row), F feature width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset


def sample_lengths(dataset: Dataset) -> list[int]:
    """Token count of every sample, without reading features where the dataset can tell:
    a ``lengths()`` method (captured shards), through ``Subset``."""
    if isinstance(dataset, Subset):
        inner = sample_lengths(dataset.dataset)
        return [inner[i] for i in dataset.indices]
    if hasattr(dataset, "lengths"):
        return list(dataset.lengths())
    return [int(dataset[i]["input_ids"].shape[0]) for i in range(len(dataset))]


def first_fit(lengths: Sequence[int], order: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy first-fit: documents in ``order`` go into the first row with room; returns rows of
    document indices (each total <= ``capacity``, as every length must be). A max segment tree
    over the rows' free space finds that row in O(log n): 100k documents pack in a second."""
    size = 1 << max(0, (len(order) - 1).bit_length())
    free = [0] * size + [capacity] * size  # leaves at [size, 2 size)
    for i in range(size - 1, 0, -1):
        free[i] = max(free[2 * i], free[2 * i + 1])
    rows: list[list[int]] = []
    for doc in order:
        need = lengths[doc]
        node = 1
        while node < size:  # leftmost leaf with free >= need
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(doc)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def check_fits(lengths: Sequence[int], capacity: int, where: str) -> None:
    """ValueError naming the longest document when one exceeds ``capacity``: packing refuses
    rather than truncates (capture and tokenisation already cut documents at their
    ``max_length``; cutting again here would silently drop supervised tokens)."""
    longest = max(lengths, default=0)
    if longest > capacity:
        k = list(lengths).index(longest)
        raise ValueError(
            f"data.max_tokens_per_row={capacity}: {where} holds a document of {longest} tokens "
            f"(sample {k}); packing never splits a document: set data.max_tokens_per_row >= "
            f"{longest}, or cut documents shorter (capture.max_length, data.max_length)")


class PackedRows(Dataset):
    """Item r: the per-token tensors (``keys`` present; [L] or [L, F]) of the documents ``rows[r]``
    of ``dataset`` concatenated, plus ``document_ids`` [L] long (0, 1, ... by document)."""

    def __init__(self, dataset: Dataset, rows: list[list[int]], keys: Sequence[str]):
        self.dataset, self.rows, self.keys = dataset, rows, tuple(keys)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, Tensor]:
        docs = [self.dataset[k] for k in self.rows[r]]
        row = {key: torch.cat([d[key] for d in docs]) for key in self.keys if key in docs[0]}
        row["document_ids"] = torch.cat([torch.full((d["input_ids"].shape[0],), i,
                                                    dtype=torch.long)
                                         for i, d in enumerate(docs)])
        return row

    def num_tokens(self) -> int:
        """Real tokens over all rows (the padding share's numerator is the rest)."""
        lengths = sample_lengths(self.dataset)
        return sum(lengths[k] for row in self.rows for k in row)


def pack(dataset: Dataset, capacity: int, keys: Sequence[str], where: str,
         seed: int | None) -> PackedRows:
    """The packed rows of ``dataset``: first-fit over a ``seed``-ed permutation (None: the
    dataset's order, as for validation). Refuses a document longer than ``capacity``."""
    lengths = sample_lengths(dataset)
    check_fits(lengths, capacity, where)
    order = list(range(len(lengths)))
    if seed is not None:
        # the stream "epoch -1" of the epoch sampler's seeds: distinct from every epoch's order
        g = torch.Generator().manual_seed((seed * 100_003 - 1) % 2**63)
        order = torch.randperm(len(lengths), generator=g).tolist()
    return PackedRows(dataset, first_fit(lengths, order, capacity), keys)
