"""Record how a run was made: resolved config, git SHA, command line and package versions."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dflash_lab.launch import detect_launch, is_global_zero
from dflash_lab.paths import REPO_ROOT, atomic_write_text

RUN_INFO_FILE = "run_info.json"
_PACKAGES = ("dflash-lab", "torch", "transformers", "tokenizers", "lightning", "hydra-core",
             "datasets", "safetensors", "gguf", "flash-attn")


def git_sha(repo: Path = REPO_ROOT) -> str | None:
    """HEAD commit of the checkout (with ``-dirty`` when modified), or None outside git."""
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "")


def package_versions(names: tuple[str, ...] = _PACKAGES) -> dict[str, str]:
    """Installed versions of the packages that decide numerics and formats."""
    out = {"python": sys.version.split()[0]}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def record_paths(out_dir: Path) -> list[tuple[Path, Path]]:
    """The directory's records, oldest first: (``config.yaml``, ``run_info.json``), then
    (``config.1.yaml``, ``run_info.1.json``), ... (one per later run in the directory)."""
    out, n = [], 0
    while True:
        suffix = f".{n}" if n else ""
        pair = (out_dir / f"config{suffix}.yaml", out_dir / f"run_info{suffix}.json")
        if not (pair[0].exists() or pair[1].exists()):
            return out
        out.append(pair)
        n += 1


def latest_config(out_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """(file, resolved config) of the directory's latest record with a config, or None."""
    for config, _ in reversed(record_paths(Path(out_dir))):
        if config.is_file():
            return config, OmegaConf.to_container(OmegaConf.load(config))
    return None


def write_run_info(out_dir: str | Path, cfg: Any = None, **extra: Any) -> Path:
    """Write ``config.yaml`` (resolved ``cfg``: OmegaConf or dict) and ``run_info.json`` (git SHA,
    argv, versions, time, launch, ``extra``) into ``out_dir``; only global rank 0 writes, others
    return the path. A first record is never overwritten: later runs write ``config.N.yaml`` /
    ``run_info.N.json`` (:func:`record_paths`); callers validate first (a refused run: none)."""
    out_dir = Path(out_dir)
    n = len(record_paths(out_dir))
    suffix = f".{n}" if n else ""
    path = out_dir / f"run_info{suffix}.json"
    if not is_global_zero():
        return out_dir / RUN_INFO_FILE
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        conf = cfg if OmegaConf.is_config(cfg) else OmegaConf.create(cfg)
        atomic_write_text(out_dir / f"config{suffix}.yaml", OmegaConf.to_yaml(conf, resolve=True))
    launch = detect_launch()  # torchrun / slurm; None: one process or Lightning's own launcher
    info = {
        "git_sha": git_sha(),
        "argv": list(sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": package_versions(),
        "launch": {"launcher": "none"} if launch is None else {
            "launcher": launch.launcher, "world_size": launch.world_size,
            "num_nodes": launch.num_nodes, "processes_per_node": launch.local_world_size},
        **extra,
    }
    atomic_write_text(path, json.dumps(info, indent=2, default=str) + "\n")
    return path
