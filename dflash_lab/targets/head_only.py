"""Load only the target's token embedding, final norm and LM head (``target.head_only=true``):
offline training needs just those, so the model is built on the meta device and only their
tensors are read; config, tokenizer and :meth:`Target.identity` match a full load, and running
the meta decoder layers fails loudly, by design (docs/targets.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dflash_lab.targets.target import Target, final_norm, resolve_device, resolve_dtype, text_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def resolve_local_dir(name_or_path: str) -> Path:
    """A local model directory, or the snapshot of a hub id already in the local HF cache."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception as err:
        raise ValueError(
            f"target.head_only=true reads the weight files directly: {name_or_path!r} is neither "
            f"a directory nor a hub id in the local Hugging Face cache ({type(err).__name__}). "
            f"Download it first (`hf download {name_or_path} --local-dir DIR`, then "
            "target.name_or_path=DIR) or set target.head_only=false") from err


def weight_locations(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded index or one file)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open: no __iter__)
    raise ValueError(f"{model_dir}: no {INDEX_FILE} or {SINGLE_FILE}; target.head_only=true "
                     "needs safetensors weights (GGUF and .bin targets: head_only=false)")


def _param_name(model: nn.Module, module: nn.Module) -> str:
    """Full name of ``module.weight`` inside ``model`` (its checkpoint key)."""
    for name, sub in model.named_modules():
        if sub is module:
            return f"{name}.weight" if name else "weight"
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def _language_path(key: str) -> str:
    """``key`` without its ``model.`` / ``language_model.`` path parts: a multimodal checkpoint
    stores ``model.language_model.embed_tokens.weight`` where the causal LM class that
    transformers builds for it names the parameter ``model.embed_tokens.weight`` (Qwen3.5/3.6)."""
    return ".".join(part for part in key.split(".") if part not in ("model", "language_model"))


def _candidates(locations: dict[str, Path], name: str) -> list[str]:
    """Keys that may hold parameter ``name``: itself, else those equal up to path parts."""
    if name in locations:
        return [name]
    short = _language_path(name)
    return sorted(k for k in locations if _language_path(k) == short)


def checkpoint_key(locations: dict[str, Path], name: str, where: Path) -> str:
    """The checkpoint key of parameter ``name``: itself, else the one key that differs from it
    only by ``model.`` / ``language_model.`` parts (ValueError when none or several do)."""
    found = _candidates(locations, name)
    if len(found) == 1:
        return found[0]
    what = f"several candidates {found}" if found else "no such tensor"
    raise ValueError(f"{where}: tensor {name!r} is not in the weight files ({what}); this "
                     "checkpoint names its embedding/norm/LM head differently: use head_only=false")


def _read(locations: dict[str, Path], name: str, like: torch.Tensor, dtype: torch.dtype,
          device: str, where: Path) -> nn.Parameter:
    from safetensors import safe_open

    key = checkpoint_key(locations, name, where)
    with safe_open(str(locations[key]), framework="pt", device="cpu") as f:
        tensor = f.get_tensor(key)
    if tuple(tensor.shape) != tuple(like.shape):
        raise ValueError(f"{where}: {key} has shape {tuple(tensor.shape)}, the config implies "
                         f"{tuple(like.shape)}")
    return nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)


def _check_materialised(model: nn.Module, modules: tuple[nn.Module, ...]) -> None:
    """The norm and LM head must hold no meta tensor (a non-persistent buffer that the
    checkpoint cannot provide): they would fail deep inside training otherwise. The embedding
    is read as its bare weight (``RawEmbedding``), so its buffers (Gemma's scale) do not count."""
    for module in modules:
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_meta:
                raise ValueError(f"{type(model).__name__}: {type(module).__name__}.{name} cannot "
                                 "be read from the weight files (computed at load time); "
                                 "set target.head_only=false")


def load_target_head(name_or_path: str, *, dtype: str | torch.dtype = "bfloat16",
                     device: str | None = "auto") -> Target:
    """Config + tokenizer + embedding, final norm and LM head; decoder layers on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_local_dir(name_or_path)
    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    locations = weight_locations(model_dir)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    norm = final_norm(model)
    for module in (embed, norm):
        name = _param_name(model, module)
        module.weight = _read(locations, name, module.weight, torch_dtype, dev, model_dir)
    head_name = _param_name(model, head)
    tied = (getattr(config, "tie_word_embeddings", False)
            or getattr(text_config(config), "tie_word_embeddings", False))
    if tied and not _candidates(locations, head_name):
        head.weight = embed.weight  # tied: the checkpoint stores the embedding once
    else:
        head.weight = _read(locations, head_name, head.weight, torch_dtype, dev, model_dir)
    _check_materialised(model, (norm, head))
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name_or_path=name_or_path, head_only=True)
