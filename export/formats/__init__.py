"""The checkpoint formats: one module each, one registry (:data:`REGISTRY`, in match order),
asked through :func:`format_of`, :func:`format_at`, :func:`get` and extended with
:func:`register` (docs/architecture.md, "Add a format").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_lab.export.engines import ENGINES
from dflash_lab.export.engines.common import Artifacts, EngineReading
from dflash_lab.export.formats.base import Format, lost_fields
from dflash_lab.export.formats.dspark import DSPARK_FORMAT
from dflash_lab.export.formats.laguna import LAGUNA, features_lines
from dflash_lab.export.formats.lightning import LIGHTNING
from dflash_lab.export.formats.muse_glimmer import MUSE_GLIMMER
from dflash_lab.export.formats.ours import OURS, OURS_FORMAT, ZLAB
from dflash_lab.export.formats.specforge import SPECFORGE
from dflash_lab.export.formats.speculators import SPECULATORS
from dflash_lab.export.sources import ImportedDrafter, import_serving_dir, read_config_json
from dflash_lab.export.weights import WEIGHTS_FILE, Source
from dflash_lab.model.config import DrafterConfig

#: Match order (see the module docstring); z-lab claims every serving directory left over.
REGISTRY: list[Format] = [SPECFORGE, DSPARK_FORMAT, SPECULATORS, OURS_FORMAT, LAGUNA, MUSE_GLIMMER,
                          ZLAB, LIGHTNING]


def register(fmt: Format) -> Format:
    """Add ``fmt``, matched before the catch-all z-lab reader (ValueError: its name is taken)."""
    if any(f.name == fmt.name for f in REGISTRY):
        raise ValueError(f"format {fmt.name!r} is registered already")
    REGISTRY.insert(REGISTRY.index(ZLAB), fmt)
    return fmt


def unregister(fmt: Format) -> None:
    """Remove a format :func:`register` added (a test's)."""
    REGISTRY.remove(fmt)


def options() -> tuple[str, ...]:
    """The ``--format`` values: every writable format chosen by name."""
    return tuple(f.name for f in REGISTRY if f.writable and f.option)


def get(name: str) -> Format:
    """The format named ``name`` (ValueError naming the ``--format`` values)."""
    for fmt in REGISTRY:
        if fmt.name == name:
            return fmt
    raise ValueError(f"format '{name}' is not one of {list(options())}")


def format_of(raw: dict[str, Any]) -> Format:
    """The format of a config.json dict (z-lab's when no other claims it)."""
    return next(f for f in REGISTRY if f.detect(raw))


def format_at(path: str | Path) -> Format:
    """The format of what ``path`` holds (ValueError: none of them)."""
    for fmt in REGISTRY:
        if fmt.detect_path(Path(path)):
            return fmt
    raise ValueError(f"{path}: not a .ckpt file, a serving directory (config.json + "
                     f"{WEIGHTS_FILE}), a training run directory (checkpoints/), a speculators "
                     "directory or a SpecForge checkpoint (training_state.pt)")


# ---------------------------------------------------------------------------- read
def load_source(path: str | Path, verify: bool = True, assume: str | None = None) -> Source:
    """The drafter at ``path`` in whatever format it is (:func:`format_at`). ``verify``: a
    serving directory is checked against its ``SHA256SUMS``; ``assume``: the rule set resolving
    a serving directory's layout (default: ours exactly, a third-party one vllm-main-v2)."""
    return format_at(path).load(Path(path), verify, assume)


def import_drafter(path: str | Path, assume: str | None = None,
                   verify: bool = True) -> ImportedDrafter:
    """A serving directory read into our config + weights (sources.import_serving_dir) with
    its format's hooks; ``assume`` names the rule set resolving a layout the file leaves
    implicit (our own exports are read exactly unless ``assume`` is given)."""
    path = Path(path)
    return import_serving_dir(path, format_of(read_config_json(path)), assume, verify)


def load_serving_dir(path: str | Path, assume: str | None = None, verify: bool = True
                     ) -> tuple[DrafterConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """``(config, state_dict, mask_embedding or None)`` of a serving directory."""
    imported = import_drafter(path, assume, verify)
    return imported.config, imported.state_dict, imported.mask_embedding


# ---------------------------------------------------------------------------- engines
def read_all(raw: dict[str, Any], artifacts: Artifacts,
             engines: tuple[str, ...] | list[str] = ENGINES) -> dict[str, EngineReading]:
    """Every selected rule set's reading of one config.json, keyed by rule-set name, through
    its format's view (a Muse Glimmer or Laguna config through each engine's config class)."""
    return format_of(raw).read_all(raw, artifacts, engines)


# ---------------------------------------------------------------------------- write
def writer_for(name: str, config: DrafterConfig) -> Format:
    """The format that writes ``config`` when ``--format name`` is asked for (ValueError:
    none can)."""
    return get(name).writer_for(config)


def check_writable(fmt: Format, config: DrafterConfig) -> None:
    """ValueError naming every field of ``config`` that does not survive ``fmt``'s write ->
    detect -> read (:func:`~dflash_lab.export.formats.base.lost_fields`), with what the
    engines or the format's owner would run otherwise, and the fix."""
    artifacts = Artifacts(mask_embedding_file=config.learned_mask_embedding,
                          sink_weights=config.attention_sink_bias)
    problems = fmt.engine_problems(config)
    lost = lost_fields(fmt, config, artifacts, format_of)
    if lost:
        problems.append(f"the fields {lost} (they do not survive its write -> read round trip)")
    if problems:
        raise ValueError(f"{config._source}: cannot be exported --format {fmt.name}: the format "
                         f"cannot carry " + "; ".join(problems) + f". Fix: {fmt.fix}")


def write_config(name: str, config: DrafterConfig, dtype: str,
                 target_identity: dict[str, Any] | None, vocab_known: bool) -> dict[str, Any]:
    """The config.json of ``--format name`` for ``config``, refused (ValueError) where the
    format cannot carry it (:func:`check_writable`)."""
    fmt = writer_for(name, config)
    check_writable(fmt, config)
    return fmt.write_config(config, dtype, target_identity, vocab_known)


def variant_lines(config: DrafterConfig) -> list[str]:
    """The report's variant lines, as the writer of our format for ``config`` words them."""
    return OURS_FORMAT.writer_for(config).drafter_lines(config)


__all__ = ["OURS", "REGISTRY", "ZLAB", "Format", "check_writable", "features_lines",
           "format_at", "format_of", "get", "import_drafter", "load_serving_dir", "load_source",
           "options", "read_all", "register", "unregister", "variant_lines",
           "write_config", "writer_for"]
