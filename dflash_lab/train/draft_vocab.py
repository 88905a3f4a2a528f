"""Choosing a drafter's draft vocabulary from its training data: the N target tokens most often
labelled at loss-masked positions, counted once before training, recorded as
``draft_vocab.json`` and carried as the ``d2t`` / ``t2d`` buffers (docs/draft_vocab.md).

Shape legend: V target vocabulary, N draft vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset

from dflash_lab.paths import atomic_write_text
from dflash_lab.train.loss import token_targets

RECORD_FILE = "draft_vocab.json"


def _token_items(dataset: Dataset):
    """Each item's token columns; a capture reads them without its hidden states."""
    base, indices = dataset, range(len(dataset))
    if isinstance(dataset, Subset):
        base, indices = dataset.dataset, dataset.indices
    read = getattr(base, "tokens", base.__getitem__)
    for k in indices:
        yield read(int(k))


def count_label_tokens(dataset: Dataset, vocab_size: int, label_source: str) -> tuple[Tensor, str]:
    """How often each target token is a training label [V] int64, and what was counted: captured
    argmax labels for ``label_source=target_argmax`` (``token_targets``), else, and for samples
    without them (online data), the conversation's tokens at loss-masked positions."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    kinds = set()
    for item in _token_items(dataset):
        argmax = item.get("target_argmax") if label_source == "target_argmax" else None
        source = label_source if argmax is not None else "dataset"
        kinds.add("target argmax labels" if source == "target_argmax" else "conversation tokens")
        labels = token_targets(item["input_ids"][None], None if argmax is None else argmax[None],
                               source)[0]
        picked = labels[item["loss_mask"].bool() & (labels >= 0)]
        if picked.numel() and int(picked.max()) >= vocab_size:
            raise ValueError(f"a training label is token {int(picked.max())} but the target's "
                             f"vocabulary has {vocab_size} tokens: the data is not this "
                             "target's; recapture it with this target")
        counts += torch.bincount(picked, minlength=vocab_size)
    return counts, " and ".join(sorted(kinds)) or "nothing (empty training data)"


def most_frequent(counts_v: Tensor, n: int) -> Tensor:
    """The ``n`` most frequent token ids [n], ascending; ties go to the lower id (a stable
    choice: the same data always gives the same vocabulary)."""
    order = torch.sort(-counts_v, stable=True).indices
    return torch.sort(order[:n]).values


def prepare_draft_vocab(drafter, dataset: Dataset, target_lm_head,
                        label_source: str) -> dict[str, Any] | None:
    """Choose and install the draft vocabulary of ``drafter`` (DFlash 1, ``draft_vocab_size``
    set) from ``dataset`` unless it already holds one (warm start). Returns the record that
    :func:`write_record` keeps (None without a draft vocabulary)."""
    cfg = drafter.config
    if drafter.lm_head is None:  # the target's whole vocabulary
        return None
    if drafter.draft_vocab_set:
        ids, source = drafter.draft_token_ids().cpu(), "kept from drafter.init_from"
        counts = None
    else:
        counts, source = count_label_tokens(dataset, cfg.vocab_size, label_source)
        ids = most_frequent(counts, cfg.draft_vocab_size)
        drafter.set_draft_vocab(ids, target_lm_head)
    record: dict[str, Any] = {"draft_vocab_size": cfg.draft_vocab_size,
                              "vocab_size": cfg.vocab_size, "counted": source}
    if counts is not None:
        total = int(counts.sum())
        record.update(label_tokens=total, covered_labels=int(counts[ids].sum()),
                      coverage=float(counts[ids].sum()) / max(1, total),
                      distinct_labels=int((counts > 0).sum()))
    return {**record, "token_ids": ids.tolist()}


def write_record(out_dir: str | Path, record: dict[str, Any] | None) -> None:
    """``out_dir/draft_vocab.json``: N, what was counted, the label coverage and the ids."""
    if record is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(out_dir) / RECORD_FILE, json.dumps(record) + "\n")
