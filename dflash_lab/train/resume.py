"""Resume points that survive faults, and resumes that match the run they continue: the atomic
end of a checkpoint save (:func:`finish_checkpoint`), ``ckpt_path=auto`` with its fall back to
``last.prev.ckpt`` (:func:`resolve_ckpt_path`), and the refusal of changed settings
(:func:`check_resume_config`) (docs/guarantees.md).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from dflash_lab.checksums import checksum_problem, sha256_file, sidecar, sidecar_text
from dflash_lab.launch import is_global_zero
from dflash_lab.paths import atomic_path

log = logging.getLogger("dflash_lab.train")
LAST, PREVIOUS_LAST = "last.ckpt", "last.prev.ckpt"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finish_checkpoint(tmp: Path, dest: Path, keep_previous_as: str | None = None) -> None:
    """Make the fully written ``tmp`` the checkpoint ``dest`` (the ``finish`` of
    :func:`dflash_lab.paths.atomic_path`): fsync, write ``dest.sha256``, move an existing
    ``dest`` to ``keep_previous_as`` (same directory), rename. A crash leaves ``dest`` or the kept
    one whole (a sidecar that does not match is caught at resume: :func:`checkpoint_problem`)."""
    if tmp.is_dir():  # a sharded strategy's checkpoint directory: no single file to hash
        os.replace(tmp, dest)
        return
    _fsync(tmp)
    digest = sha256_file(tmp)
    if keep_previous_as and dest.is_file():
        prev = dest.with_name(keep_previous_as)
        os.replace(dest, prev)
        if sidecar(dest).is_file():
            os.replace(sidecar(dest), sidecar(prev))
        else:
            sidecar(prev).unlink(missing_ok=True)
    with atomic_path(sidecar(dest)) as side_tmp:  # renamed right after the checkpoint
        side_tmp.write_text(sidecar_text(digest, dest))
        os.replace(tmp, dest)
    _fsync(dest.parent)


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be resumed from, or None: a sidecar mismatch, else (no sidecar: older
    run) a file ``torch.load`` cannot open (a truncated zip fails at once; mmap reads no data)."""
    problem = checksum_problem(path)
    if problem is not None or sidecar(path).is_file():
        return problem
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises several error types for a damaged file
        return f"cannot be loaded ({type(err).__name__}: {str(err)[:200]})"
    return None


def resolve_ckpt_path(ckpt_path: str | None, output_dir: str | Path) -> str | None:
    """``auto``: ``<output_dir>/checkpoints/last.ckpt``, else ``last.prev.ckpt`` when missing or
    damaged (warned), else None (fresh). A given path must pass :func:`checkpoint_problem`."""
    if ckpt_path is None:
        return None
    if ckpt_path != "auto":
        if not Path(ckpt_path).is_file():
            raise ValueError(f"ckpt_path={ckpt_path!r} does not exist; give a .ckpt file, "
                             "'auto' (resume from the run's last.ckpt) or null (start fresh)")
        problem = checkpoint_problem(Path(ckpt_path))
        if problem:
            raise ValueError(f"ckpt_path={ckpt_path!r}: {problem}; pass another checkpoint")
        return ckpt_path
    ckdir = Path(output_dir) / "checkpoints"
    for path in (ckdir / LAST, ckdir / PREVIOUS_LAST):
        if not path.is_file():
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        log.warning("%s: %s; set aside, resuming from the previous checkpoint if any", path,
                    problem)
        # kept for inspection, never deleted; out of the way, so the next save does not rotate
        # it over the good previous one
        if is_global_zero():
            bad = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, bad)
            if sidecar(path).is_file():
                os.replace(sidecar(path), sidecar(bad))
    return None


#: Settings that may change on resume without changing what is trained: loader workers,
#: checksum policy, devices and file locations of the same inputs.
RESUME_FREE_KEYS = ("data.num_workers", "data.persistent_workers", "data.pin_memory",
                    "data.prefetch_factor", "data.verify_checksums", "data.demo_file",
                    "target.device", "target.device_map", "target.attn_implementation",
                    "target.local_files_only", "module.val_temperatures")
RESUME_CHECKED_GROUPS = ("target", "drafter", "data", "module", "seed")


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def _normalised(config: dict[str, Any]) -> dict[str, Any]:
    """The checked keys of a resolved config, flat, with the run directory written as
    ``${paths.output_dir}`` (a moved run directory changes no setting)."""
    run_dir = str((config.get("paths") or {}).get("output_dir", "")).rstrip("/")
    flat = _flatten({k: config[k] for k in RESUME_CHECKED_GROUPS if k in config})
    if not run_dir:
        return flat
    return {k: v.replace(run_dir, "${paths.output_dir}") if isinstance(v, str) else v
            for k, v in flat.items()}


def _allowed(key: str, allow: list[str]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in (*RESUME_FREE_KEYS, *allow))


def check_resume_config(recorded: dict[str, Any], current: dict[str, Any], source: str,
                        allow: list[str] | None = None, force: bool = False) -> None:
    """Refuse (ValueError) a resume whose settings differ from the run's recorded config: each
    checked setting that differs and is not allowed (:data:`RESUME_FREE_KEYS`, ``allow``: keys
    or key prefixes). A key the record lacks (a setting added after the run started) is none."""
    old, new = _normalised(recorded), _normalised(current)
    changes = [f"{k}: {old.get(k)!r} -> {new.get(k, '<unset>')!r}" for k in sorted(old)
               if old[k] != new.get(k, "<unset>") and not _allowed(k, list(allow or []))]
    if not changes:
        return
    if force:
        log.warning("resume_force=true: resuming with changed settings: %s", "; ".join(changes))
        return
    raise ValueError(
        f"resuming the run recorded in {source} with other settings ({'; '.join(changes)}): "
        "the result would mix two experiments. Start a new run (another paths.output_dir or "
        "ckpt_path=null), or accept the changes: resume_allow_changes=[KEY,...] (e.g. "
        "[module.optimizer.lr]) or resume_force=true")
