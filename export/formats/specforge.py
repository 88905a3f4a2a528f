"""SpecForge checkpoints (sgl-project/SpecForge main at a6b6b02, ``CheckpointManager``):
``{run_id}-step{N}/training_state.pt`` with the ``--draft-model-config`` JSON beside it or in the
run's output directory, ``torch.load(weights_only=True)`` only; DFlash 1 only
(docs/warm_start.md, "What PATH may be").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from dflash_lab.export.formats.base import Format
from dflash_lab.export.formats.speculators import _QWEN3_SHAPE, _rope, trainer_layout
from dflash_lab.export.weights import CONFIG_FILE, Source, plain_key, validate_state_dict
from dflash_lab.model.config import DrafterConfig, build_target_layer_ids

SPECFORGE_STATE = "training_state.pt"


def specforge_state_file(path: Path) -> Path | None:
    """``training_state.pt`` of a SpecForge checkpoint path (the file, a ``-stepN`` dir, or a
    run output dir: its ``-best``, else ``-latest`` link, else the highest step), or None."""
    if path.is_file():
        return path if path.name == SPECFORGE_STATE else None
    if (path / SPECFORGE_STATE).is_file():
        return path / SPECFORGE_STATE
    if not path.is_dir():
        return None
    for pattern in ("*-best", "*-latest"):
        links = sorted(p for p in path.glob(pattern) if (p / SPECFORGE_STATE).is_file())
        if len(links) > 1:
            raise ValueError(f"{path}: holds several SpecForge runs {[p.name for p in links]}; "
                             "pass one {run_id}-step{N} directory")
        if links:
            return links[0].resolve() / SPECFORGE_STATE
    steps = [(int(m.group(1)), p) for p in path.glob("*-step*")
             if (m := re.search(r"-step(\d+)$", p.name)) and (p / SPECFORGE_STATE).is_file()]
    return max(steps)[1] / SPECFORGE_STATE if steps else None


def _specforge_config(state_file: Path) -> Path:
    for where in (state_file.parent, state_file.parent.parent):
        if (where / CONFIG_FILE).is_file():
            return where / CONFIG_FILE
    raise ValueError(f"{state_file}: SpecForge keeps the draft config outside its checkpoint; "
                     f"copy the --draft-model-config JSON the run used (e.g. SpecForge's "
                     f"configs/qwen3-8b-dflash.json) to {state_file.parent / CONFIG_FILE}")


def specforge_config(d: dict[str, Any], file: Path) -> DrafterConfig:
    """Our DrafterConfig of a SpecForge draft config (a Qwen3 config plus ``block_size``,
    ``num_target_layers`` and ``dflash_config``), read as its ``DFlashDraftModel`` reads it."""
    dfc = d.get("dflash_config") or {}
    for key, off in (("projector_type", None), ("pure_draft_prefix_len", 0),
                     ("shift_label", False)):
        if dfc.get(key, off) != off:
            raise ValueError(f"{file}: dflash_config.{key}={dfc[key]!r} is a SpecForge variant "
                             "feature the drafter here does not implement")
    if d.get("architectures", ["DFlashDraftModel"]) != ["DFlashDraftModel"]:
        raise ValueError(f"{file}: architectures={d['architectures']}; only SpecForge's "
                         "DFlashDraftModel is read")
    n = int(d["num_hidden_layers"])
    ids = dfc.get("target_layer_ids") or build_target_layer_ids(int(d["num_target_layers"]), n)
    fields = {k: d[k] for k in _QWEN3_SHAPE if d.get(k) is not None}
    # SpecForge's mask (dflash_family_model): sliding layers causal, window counting the query
    fields.update(_rope(d), **trainer_layout(d, sliding_causal=True),
                  mask_token_id=int(dfc["mask_token_id"]), block_size=int(d["block_size"]),
                  target_layer_ids=list(ids),
                  num_target_layers=int(d.get("num_target_layers") or max(ids) + 1))
    return DrafterConfig.create(source=str(file), **fields)


class SpecForge(Format):
    """A SpecForge DFlash checkpoint: the file, a ``-stepN`` directory or a run's output."""

    name = "specforge"
    kind = "SpecForge checkpoint"

    def detect_path(self, path: Path) -> bool:
        return specforge_state_file(path) is not None

    def load(self, path: Path, verify: bool, assume: str | None = None) -> Source:
        """A SpecForge DFlash ``training_state.pt`` (+ its draft config) as a Source."""
        state_file = specforge_state_file(path)
        try:
            state = torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"{state_file}: cannot be loaded with torch.load(weights_only=True): "
                             f"{err}") from err
        if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
            raise ValueError(f"{state_file}: no 'draft_state_dict'; not a SpecForge checkpoint")
        if state.get("strategy", "dflash") != "dflash":
            raise ValueError(f"{state_file}: written by SpecForge strategy {state['strategy']!r}; "
                             "only plain 'dflash' drafters (no extra heads) are read")
        config_file = _specforge_config(state_file)
        try:
            config = specforge_config(json.loads(config_file.read_text()), config_file)
        except (KeyError, json.JSONDecodeError) as err:
            raise ValueError(f"{config_file}: not a SpecForge DFlash draft config "
                             f"({err!r})") from err
        weights = {plain_key(k): v for k, v in state["draft_state_dict"].items()
                   if "embed" not in k}
        validate_state_dict(weights, config, str(state_file))
        notes = [f"draft config {config_file}; SpecForge step {state.get('global_step')}; "
                 "sliding layers causal, full bidirectional (SpecForge's mask)"]
        return Source(config, weights, "checkpoint", f"SpecForge checkpoint {state_file}", notes,
                      reads=[state_file, config_file],
                      depth_recorded="num_target_layers" in json.loads(config_file.read_text()))


SPECFORGE = SpecForge()
