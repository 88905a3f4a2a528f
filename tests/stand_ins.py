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
