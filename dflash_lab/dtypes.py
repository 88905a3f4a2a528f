"""The one table of dtype names -> torch dtypes (target loading, capture shards, export).
Imports only torch: dflash_lab.export (no Lightning, no Hydra) reads it too.
"""

from __future__ import annotations

import torch

#: The names configs, shard manifests and ``dflash-export --dtype`` spell.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: Short spellings also accepted where a user types a target's dtype (``target.dtype=bf16``).
DTYPE_ALIASES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
