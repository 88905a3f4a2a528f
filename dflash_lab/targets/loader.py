"""The one target loader of every entry point (:func:`load_target`): a frozen (eval mode, no grad)
causal LM + tokenizer from a local directory, a hub id (through the HF cache; offline with
``HF_HUB_OFFLINE=1``) or a GGUF file (``name_or_path=FILE.gguf`` or ``gguf_file=``, needs
``gguf``), with an optional replacement chat template.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from dflash_lab.targets.head_only import load_target_head
from dflash_lab.targets.target import (
    BUILTIN_CHAT_TEMPLATES,
    Target,
    resolve_device,
    resolve_dtype,
)

log = logging.getLogger(__name__)


def read_chat_template(spec: str) -> str:
    """``target.chat_template``: a built-in name (:data:`BUILTIN_CHAT_TEMPLATES`), a Jinja file
    (``.jinja``/``.txt``) or a tokenizer_config.json-style JSON with a ``chat_template`` key."""
    if spec in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"target.chat_template={spec!r} is neither a file nor a built-in "
                         f"template name ({sorted(BUILTIN_CHAT_TEMPLATES)})")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        template = json.loads(text).get("chat_template")
        if not isinstance(template, str):
            raise ValueError(f"{path}: no string 'chat_template' key in this JSON file")
        return template
    return text


def split_gguf_path(name_or_path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """``DIR/model.gguf`` given as the name -> (``DIR``, ``model.gguf``); else unchanged."""
    if gguf_file is None and name_or_path.endswith(".gguf") and Path(name_or_path).is_file():
        path = Path(name_or_path)
        return str(path.parent), path.name
    return name_or_path, gguf_file


def is_local(name_or_path: str) -> bool:
    """A local path (absolute, relative with ``.``, or existing) rather than a hub id."""
    path = Path(name_or_path)
    return path.is_absolute() or name_or_path.startswith(".") or path.exists()


def _check_source(name_or_path: str, gguf_file: str | None) -> None:
    path = Path(name_or_path)
    if is_local(name_or_path) and not path.is_dir():
        raise ValueError(
            f"target path {name_or_path!r} does not exist; pass a model directory, a hub id "
            "(Org/Name, read from the HF cache when HF_HUB_OFFLINE=1) or a .gguf file")
    if gguf_file and is_local(name_or_path) and not (path / gguf_file).is_file():
        raise ValueError(f"gguf_file {gguf_file!r} not found in {name_or_path!r}")


def _hub_kwargs(name_or_path: str, local_files_only: bool | None,
                gguf_file: str | None) -> dict[str, Any]:
    """``from_pretrained``'s ``gguf_file`` and ``local_files_only``: True for local paths and
    under ``HF_HUB_OFFLINE``; hub ids are otherwise fetched (or read from the cache)."""
    if local_files_only is None:
        local_files_only = Path(name_or_path).is_dir() or bool(os.environ.get("HF_HUB_OFFLINE"))
    return {"local_files_only": local_files_only, **({"gguf_file": gguf_file} if gguf_file else {})}


def _explain_hub_error(name_or_path: str, err: Exception) -> ValueError:
    offline = os.environ.get("HF_HUB_OFFLINE")
    how = ("it is not in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline
           else "it could not be fetched")
    return ValueError(f"target {name_or_path!r}: {how} ({type(err).__name__}: {err}). Download "
                      f"it (`hf download {name_or_path}`) or pass a local directory")


def load_target_config(name_or_path: str, *, gguf_file: str | None = None,
                       local_files_only: bool | None = None):
    """The transformers config of a target (directory, hub id, GGUF), without its weights."""
    from transformers import AutoConfig

    name_or_path, gguf_file = split_gguf_path(str(name_or_path), gguf_file)
    _check_source(name_or_path, gguf_file)
    kwargs = _hub_kwargs(name_or_path, local_files_only, gguf_file)
    try:
        if gguf_file:
            return _gguf_config(name_or_path, gguf_file, kwargs)
        return AutoConfig.from_pretrained(name_or_path, **kwargs)
    except OSError as err:
        raise _explain_hub_error(name_or_path, err) from err


def load_target(name_or_path: str, *, gguf_file: str | None = None,
                dtype: str | torch.dtype = "bfloat16", device: str | None = "auto",
                device_map: str | dict | None = None, attn_implementation: str | None = None,
                local_files_only: bool | None = None, head_only: bool = False,
                chat_template: str | None = None) -> Target:
    """A frozen causal LM and its tokenizer from ``name_or_path`` (the module's sources).
    ``device_map`` overrides ``device``; ``attn_implementation`` None: transformers chooses;
    ``head_only``: embedding, norm, LM head (targets/head_only.py); ``chat_template``: a file or
    built-in name replacing the tokenizer's (docs/targets.md)."""
    name_or_path, gguf_file = split_gguf_path(str(name_or_path), gguf_file)
    _check_source(name_or_path, gguf_file)
    template = read_chat_template(chat_template) if chat_template else None
    if head_only:
        if gguf_file:
            raise ValueError(f"target.head_only=true reads safetensors weights; {gguf_file!r} "
                             "is a GGUF file: set target.head_only=false")
        target = load_target_head(name_or_path, dtype=dtype, device=device)
    else:
        target = _load_full(name_or_path, gguf_file, dtype, device, device_map,
                            attn_implementation, local_files_only)
    if template is not None:
        target.tokenizer.chat_template = template
    if not getattr(target.tokenizer, "chat_template", None):
        log.warning("target %s has no chat template: capture, regeneration and chat evaluation "
                    "need one; set target.chat_template=FILE or one of %s", name_or_path,
                    sorted(BUILTIN_CHAT_TEMPLATES))
    return target


def _gguf_config(name_or_path: str, gguf_file: str, common: dict[str, Any]):
    """The transformers config of a GGUF target with ``head_dim`` from the file: transformers'
    mapping of some architectures (qwen3) drops ``{arch}.attention.key_length``, so another head
    width would fail at load against the class default (Qwen3: 128)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.utils import cached_file

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"target {gguf_file!r} is a GGUF file: transformers reads it with "
                         f"{missing}; pip install -c constraints.txt gguf accelerate")
    from gguf import GGUFReader

    config = AutoConfig.from_pretrained(name_or_path, **common)
    fields = GGUFReader(cached_file(name_or_path, gguf_file,
                                    local_files_only=common["local_files_only"])).fields
    name = fields["general.architecture"]
    arch = bytes(name.parts[name.data[0]]).decode()
    key_length = fields.get(f"{arch}.attention.key_length")
    mapped = "attention.key_length" in GGUF_CONFIG_MAPPING.get(arch, {})
    if key_length is not None and not mapped and hasattr(config, "head_dim"):
        config.head_dim = int(key_length.parts[key_length.data[0]][0])
    return config


def _load_full(name_or_path: str, gguf_file: str | None, dtype, device, device_map,
               attn_implementation, local_files_only) -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = _hub_kwargs(name_or_path, local_files_only, gguf_file)
    try:
        config = {"config": _gguf_config(name_or_path, gguf_file, common)} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **common)
        model, info = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=resolve_dtype(dtype), device_map=device_map,
            attn_implementation=attn_implementation, output_loading_info=True, **config,
            **common)
    except OSError as err:
        if is_local(name_or_path):
            raise
        raise _explain_hub_error(name_or_path, err) from err
    bad = list(info.get("missing_keys") or []) + list(info.get("mismatched_keys") or [])
    if gguf_file and bad:  # tensors transformers does not map: it loads random ones, warning
        raise ValueError(f"target {name_or_path}/{gguf_file}: transformers left {len(bad)} "
                         f"weights unloaded ({sorted(map(str, bad))[:4]} ...); this GGUF's "
                         "architecture or tensor names are not supported by this transformers")
    if device_map is None:
        model.to(resolve_device(device))
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name_or_path=name_or_path, gguf_file=gguf_file)
