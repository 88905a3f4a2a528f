"""Attention: one mask predicate (mask.py) and backends behind one signature (base.py)."""

from dflash_lab.attention.base import BACKENDS, AttentionBackend, get_backend
from dflash_lab.attention.mask import BlockLayout, dense_mask, visible

__all__ = ["BACKENDS", "AttentionBackend", "BlockLayout", "dense_mask", "get_backend", "visible"]
