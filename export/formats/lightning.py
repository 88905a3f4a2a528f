"""Our Lightning checkpoints (``.ckpt``) and training run directories (their best checkpoint),
opened with ``torch.load(weights_only=True)`` only: an export never runs code hidden in a pickle.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import torch

from dflash_lab.export.formats.base import Format
from dflash_lab.export.weights import Source, plain_key
from dflash_lab.model.config import DrafterConfig

DRAFTER_PREFIX = "drafter."


def load_checkpoint(path: Path) -> Source:
    """A Lightning ``.ckpt``: ``state_dict`` keys prefixed ``drafter.`` and
    ``hyper_parameters["drafter_config"]`` = ``DrafterConfig.to_dict()``. A checkpoint whose
    ``.sha256`` sidecar (written by training) does not match is refused."""
    from dflash_lab.checksums import checksum_problem

    if problem := checksum_problem(Path(path)):
        raise ValueError(f"{path}: {problem}; export another checkpoint of the run")
    if not zipfile.is_zipfile(path):  # what torch.save writes (a config.yaml, a log, ...)
        run = Path(path).parent
        hint = (f"the run directory {run} (its best checkpoint)" if (run / "checkpoints").is_dir()
                else "a training run directory (it holds checkpoints/)")
        raise ValueError(f"{path} is a file but not a checkpoint (torch.save writes a zip "
                         f"archive): pass a .ckpt file, {hint}, or a serving directory")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{path}: cannot be loaded with torch.load(weights_only=True): {err}. The checkpoint "
            "holds Python objects besides tensors and plain containers; save "
            "hyper_parameters['drafter_config'] as DrafterConfig.to_dict() (a plain dict). "
            "The exporter never unpickles arbitrary objects.") from err
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path}: not a Lightning checkpoint (no 'state_dict')")
    cfg = (ckpt.get("hyper_parameters") or {}).get("drafter_config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: hyper_parameters['drafter_config'] is missing or not a dict; "
                         "the training module must save DrafterConfig.to_dict() there")
    config = DrafterConfig.from_dict(cfg, source=f"{path}:hyper_parameters.drafter_config")
    state = {plain_key(k[len(DRAFTER_PREFIX):]): v for k, v in ckpt["state_dict"].items()
             if k.startswith(DRAFTER_PREFIX)}
    if not state:
        raise ValueError(f"{path}: no '{DRAFTER_PREFIX}*' tensors in state_dict")
    identity = ckpt.get("dflash_target")
    return Source(config, state, "checkpoint", f"checkpoint {path}", reads=[path],
                  target_identity=identity if isinstance(identity, dict) else None)


def resolve_run_dir(run: Path) -> tuple[Path, str]:
    """The run's best checkpoint (``checkpoints/best.json``), else ``last.ckpt`` with a warning."""
    ckdir = run / "checkpoints"
    best = ckdir / "best.json"
    if best.exists():
        data = json.loads(best.read_text())
        path = Path(data["path"])
        path = path if path.is_absolute() else run / path
        if not path.exists():
            raise ValueError(f"{best}: points to {path}, which does not exist")
        return path, f"best checkpoint (val/tau={data.get('val/tau')})"
    last = ckdir / "last.ckpt"
    if not last.exists():
        found = sorted(p.name for p in ckdir.glob("*.ckpt"))
        raise ValueError(f"{run}: no checkpoints/best.json and no checkpoints/last.ckpt "
                         f"(found {found}); pass the .ckpt file itself")
    print(f"dflash-export: warning: {best} is missing; exporting {last} instead of the best "
          "checkpoint", file=sys.stderr)
    return last, "last checkpoint (no best.json)"


class Lightning(Format):
    """A Lightning ``.ckpt`` of a training run, or the run directory (its best checkpoint)."""

    name = "lightning"
    kind = "checkpoint"

    def detect_path(self, path: Path) -> bool:
        return path.is_file() or (path / "checkpoints").is_dir()

    def load(self, path: Path, verify: bool, assume: str | None = None) -> Source:
        if path.is_file():
            return load_checkpoint(path)
        ckpt, why = resolve_run_dir(path)
        source = load_checkpoint(ckpt)
        source.description = f"{why} {ckpt} of run {path}"
        source.reads.append(path)
        return source


LIGHTNING = Lightning()
