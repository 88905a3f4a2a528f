"""Config-only stand-ins for targets in tests that need a target's shape but not its weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace


def config_target(config: dict | str | Path, tokenizer=None, name: str = "stand-in"):
    """A target with only ``model.config`` (a transformers config built from a dict or a
    directory's config.json; Qwen3 when it names no model_type) and an optional tokenizer
    (the directory's own when it has one): what the drafter factory reads."""
    from transformers import AutoConfig, Qwen3Config

    if isinstance(config, dict):
        cfg = Qwen3Config(**config)
    else:
        path = Path(config)
        name = str(path)
        raw = json.loads((path / "config.json").read_text())
        cfg = (AutoConfig.from_pretrained(str(path), local_files_only=True)
               if "model_type" in raw else Qwen3Config(**raw))
        if tokenizer is None and (path / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return SimpleNamespace(model=SimpleNamespace(config=cfg), tokenizer=tokenizer,
                           name_or_path=name)


def hub_snapshot_dir(repo_id: str, hub_cache: str | Path) -> Path:
    """The snapshot directory of hub repo ``repo_id`` in the HF cache layout
    (``models--Org--Name/{refs/main, snapshots/<sha>/}``) under ``hub_cache``, created with its
    ``refs/main``: files written into it are what ``from_pretrained(repo_id)`` finds with
    ``HF_HUB_OFFLINE=1``, as if downloaded."""
    import hashlib

    repo = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def publish_to_hf_cache(src: str | Path, repo_id: str, hub_cache: str | Path) -> Path:
    """Copy the files of model directory ``src`` into hub repo ``repo_id``'s snapshot in the HF
    cache under ``hub_cache`` (:func:`hub_snapshot_dir`). Returns the snapshot directory."""
    import shutil

    snapshot = hub_snapshot_dir(repo_id, hub_cache)
    shutil.copytree(src, snapshot, dirs_exist_ok=True)
    return snapshot
