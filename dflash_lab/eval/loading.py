"""Load what the eval needs: the target's config, the drafter from any path a registered format
reads (export/formats/, the sources ``drafter.init_from`` reads: docs/warm_start.md) turned into a
:class:`DFlashDrafter`, and the check that they belong together (the trace: docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dflash_lab.export.formats import load_source
from dflash_lab.export.formats.base import with_target_vocab
from dflash_lab.model.drafter import DFlashDrafter


@dataclass
class LoadedDrafter:
    """A drafter ready for inference plus where it came from (recorded in the report)."""

    drafter: DFlashDrafter
    description: str
    trained_block_size: int
    notes: list[str] = field(default_factory=list)
    #: False when the format records no target depth (``export.weights.Source.depth_recorded``)
    depth_recorded: bool = True


def load_drafter(path: str | Path, *, backend: str = "sdpa", device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, block_size: int | None = None,
                 assume: str | None = None, verify_checksums: bool = True,
                 target_vocab_size: int | None = None) -> LoadedDrafter:
    """Load a drafter from a checkpoint, run directory or serving directory. ``block_size`` (<= the
    trained one): the inference block; ``assume``: the engine rules that read a third-party
    serving directory (default: the exporter's); ``verify_checksums``: check its ``SHA256SUMS``
    first; ``target_vocab_size``: the vocabulary when the format records none (Muse Glimmer)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"drafter.path={str(path)!r} does not exist; pass a training checkpoint "
                         "(.ckpt), a run directory, a serving directory (config.json + "
                         "model.safetensors), a speculators directory or a SpecForge checkpoint")
    source = load_source(path, verify_checksums, assume)
    notes = list(source.notes)
    config = with_target_vocab(source.config, target_vocab_size, source.vocab_recorded)
    trained = config.block_size
    if block_size is not None and block_size != trained:
        if not 2 <= int(block_size) <= trained:
            raise ValueError(f"block_size={block_size}: must be in [2, {trained}] (the drafter "
                             f"was trained with block_size={trained}); omit it to use the "
                             "trained size")
        notes.append(f"block_size {block_size} (trained with {config.block_size})")
        config = dataclasses.replace(config, block_size=int(block_size))
    drafter = DFlashDrafter(config, backend=backend)
    drafter.load_state_dict(source.state_dict, strict=True)
    drafter = drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return LoadedDrafter(drafter, source.description, trained, notes, source.depth_recorded)


def check_pair(drafter: DFlashDrafter, target, depth_recorded: bool = True) -> None:
    """ValueError when the drafter was not built for this target: hidden size, vocab, layer ids
    inside the target's depth, the recorded target depth (not compared where the format records
    none, ``depth_recorded``: speculators'): ids picked on another depth read other layers."""
    cfg = drafter.config
    problems = [f"{key}={want} but the target has {have}" for key, want, have in (
        ("hidden_size", cfg.hidden_size, target.hidden_size),
        ("vocab_size", cfg.vocab_size, target.vocab_size)) if want != have]
    if depth_recorded and cfg.num_target_layers != target.num_hidden_layers:
        problems.append(f"num_target_layers={cfg.num_target_layers} (its target_layer_ids "
                        f"{cfg.target_layer_ids} pick layers of that depth) but the target has "
                        f"{target.num_hidden_layers} layers")
    if max(cfg.target_layer_ids) >= target.num_hidden_layers:
        problems.append(f"target_layer_ids={cfg.target_layer_ids} but the target has only "
                        f"{target.num_hidden_layers} layers")
    if problems:
        raise ValueError(f"drafter ({cfg._source}) does not fit target {target.name_or_path!r}: "
                         + "; ".join(problems) + "; pass the target the drafter was trained for "
                         "(target=hf target.name_or_path=...)")


def resolve_eval_target(cfg: DictConfig) -> None:
    """Complete ``cfg.target`` (conf/target/, instantiated as dflash-train does) in place before
    anything is loaded. ``target=hf`` without ``target.name_or_path``: mode=features takes the
    target (and GGUF file) of the capture manifest; mode=generate raises ValueError with the fix."""
    if not OmegaConf.is_missing(cfg.target, "name_or_path"):  # given, or target=tiny
        return
    if cfg.mode != "features":
        raise ValueError(f"target.name_or_path is required for mode={cfg.mode}: pass "
                         "target=hf target.name_or_path=DIR (a model directory, hub id or GGUF "
                         "file), or target=tiny for the built-in tiny target")
    from dflash_lab.data.shards import read_manifest

    recorded = read_manifest(cfg.data.path)["target"]
    cfg.target.name_or_path = recorded["name_or_path"]
    if cfg.target.get("gguf_file") is None and recorded.get("gguf_file"):
        cfg.target.gguf_file = recorded["gguf_file"]
