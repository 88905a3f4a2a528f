"""dflash-lab's own serving layout (``--format dflash-lab``, the default): z-lab's
(``DFlashDraftModel`` / ``DFlash2DraftModel``, dflash.md section 4) plus our exact training spec
(``dflash_lab_training_spec``), read back exactly by ``DrafterConfig.from_dict``. A z-lab
directory has no spec: its fields are z-lab's reading (engines/zlab.py), its layout one engine
rule set's (base.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_lab.export.engines.zlab import base_config
from dflash_lab.export.formats.base import OUR_SPEC, Format
from dflash_lab.export.formats.dspark import DSPARK_FORMAT
from dflash_lab.export.formats.laguna import features
from dflash_lab.model.config import (
    DFLASH2,
    DSPARK,
    TRAINING_SPEC_KEY,
    DrafterConfig,
)

OURS = "dflash-lab"


class ZLab(Format):
    """A z-lab style serving directory (DFlash 1 or 2, no training spec): the fallback reader."""

    name = "z-lab"
    fallback = True

    def detect(self, raw: dict[str, Any]) -> bool:
        return True

    base_config = staticmethod(base_config)

    def drafter_lines(self, config: DrafterConfig) -> list[str]:
        if config.variant != DFLASH2:  # DFlash 1, or a head sharing its class (Domino)
            fields = ", ".join(f"{k}={v}" for k, v in config.head_options.items())
            return [f"- variant: {config.variant} ({config.head.architecture})"] + \
                ([f"- {config.head.title}: {fields}"] if fields else [])
        groups = config.hidden_size // config.conv_group_size
        return ["- variant: dflash2 (DFlash2DraftModel)",
                f"- conv: conv_kernel_size={config.conv_kernel_size}, conv_group_size="
                f"{config.conv_group_size} ({groups} groups) around every attention and MLP",
                f"- selector: selector_rank={config.selector_rank}, selector_top_k="
                f"{config.selector_top_k} (full vocabulary {config.vocab_size})"]


class Ours(ZLab):
    """z-lab's layout plus our training spec: written by default, read back exactly."""

    name = OURS
    writable = True
    fix = ("export it with --format laguna (dflash-export) or export.format=laguna "
           "(dflash-train, e.g. dflash-train drafter=laguna export.format=laguna)")

    def detect(self, raw: dict[str, Any]) -> bool:
        return TRAINING_SPEC_KEY in raw

    def exact_reading(self, raw: dict[str, Any]) -> str | None:
        return OUR_SPEC

    def read_exact(self, raw: dict[str, Any], file: Path) -> tuple[DrafterConfig, list[str]]:
        return DrafterConfig.from_dict(raw, source=str(file)), []

    def writer_for(self, config: DrafterConfig) -> Format:
        return DSPARK_FORMAT if config.variant == DSPARK else self

    def write_config(self, config: DrafterConfig, dtype: str,
                     target_identity: dict[str, Any] | None, vocab_known: bool
                     ) -> dict[str, Any]:
        """config.json: ``DrafterConfig.to_dict()`` plus the HF dtype bookkeeping key."""
        out = config.to_dict()
        out["torch_dtype"] = dtype
        return out

    def engine_problems(self, config: DrafterConfig) -> list[str]:
        on = features(config)
        if not on:
            return []
        return [f"the Laguna features {on}, which no engine reads from dflash-lab's own format"]


ZLAB, OURS_FORMAT = ZLab(), Ours()
