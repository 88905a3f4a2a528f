"""Record how a run was made: resolved config, git SHA, command line and package versions."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from dflash_lab.paths import REPO_ROOT

RUN_INFO_FILE = "run_info.json"
CONFIG_FILE = "config.yaml"
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


def write_run_info(out_dir: str | Path, cfg: Any = None, **extra: Any) -> Path:
    """Write ``config.yaml`` (resolved, when ``cfg`` is an OmegaConf config or dict) and
    ``run_info.json`` (git SHA, argv, versions, time, ``extra``) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        from omegaconf import OmegaConf

        conf = cfg if OmegaConf.is_config(cfg) else OmegaConf.create(cfg)
        (out_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(conf, resolve=True))
    info = {
        "git_sha": git_sha(),
        "argv": list(sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": package_versions(),
        **extra,
    }
    path = out_dir / RUN_INFO_FILE
    path.write_text(json.dumps(info, indent=2, default=str) + "\n")
    return path
