"""Load a target causal LM + tokenizer, expose its frozen pieces, and fingerprint it.

A target comes from a local directory, a hub id (only when online) or a GGUF file
(``gguf_file=``, needs the ``gguf`` package). It is always frozen (eval mode, no grad).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

#: Config keys that change with the saving tool or the load dtype, not with the model itself.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype",
     "_commit_hash", "_attn_implementation_autoset", "use_cache", "quantization_config"}
)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/... or a torch dtype -> torch dtype (ValueError if unknown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str | None) -> str:
    """``"auto"`` -> ``cuda:$LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if device in (None, "auto"):
        if torch.cuda.is_available():
            return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return "cpu"
    return device


def text_config(config):
    """The language model's config: ``text_config`` of multimodal configs (Gemma-4, Qwen3.5/3.6
    VLM checkpoints), the config itself otherwise. Layer count, hidden size and vocab live there."""
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


class RawEmbedding(nn.Module):
    """The plain table lookup ``weight[ids]`` of a target embedding whose own module does more.

    Gemma's HF embedding multiplies every row by sqrt(H). Serving engines give the drafter the
    target's bare vocabulary table (vLLM shares the target's ``embed_tokens`` module, SGLang its
    weight via ``get_embed_and_head``; Gemma's scale lives in the target model's forward, not in
    that module), so training and the offline eval must read the same unscaled rows.
    ``weight`` is the target's own parameter (not a copy). ids [...] -> [..., H].
    """

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


def raw_embedding(module: nn.Module) -> nn.Module:
    """``module`` itself when its forward is ``nn.Embedding``'s, else a :class:`RawEmbedding`."""
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        return module
    return RawEmbedding(module.weight)


def final_norm(model: nn.Module) -> nn.Module:
    """The target's final norm: on the decoder (``get_decoder().norm``: causal LMs and the
    language model of multimodal ones) or ``base_model.norm``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for owner in (decoder, model.base_model):
        norm = getattr(owner, "norm", None) if owner is not None else None
        if isinstance(norm, nn.Module):
            return norm
    raise ValueError(f"{type(model).__name__}: no final norm on its decoder or base model; this "
                     "architecture is not supported as a DFlash target yet")


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def config_hash(config) -> str:
    """sha256 of the model config without volatile keys (tool version, dtype, path)."""
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return _sha256_json(d)


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary, merges and special tokens (not the chat template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload: Any = json.loads(backend.to_str())
    else:
        payload = sorted(tokenizer.get_vocab().items())
    return _sha256_json(payload)


def chat_template_hash(tokenizer) -> str | None:
    """sha256 of the chat template text, or None when the tokenizer has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()


class TargetPieces(nn.Module):
    """The target's frozen token embedding, final norm and LM head, shared with the drafter.

    The modules are the target's own (not copies); every parameter has ``requires_grad=False``.
    ``embed_tokens``: ids [...] -> [..., H], the bare table rows the engines feed the drafter
    (:class:`RawEmbedding`); ``norm``: [..., H] -> [..., H];
    ``lm_head``: [..., H] -> [..., V].
    """

    def __init__(self, embed_tokens: nn.Module, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.lm_head = lm_head
        for p in self.parameters():
            p.requires_grad_(False)

    @classmethod
    def from_model(cls, model: nn.Module) -> TargetPieces:
        """Pick the pieces out of an HF causal LM or multimodal model with a language model."""
        return cls(raw_embedding(model.get_input_embeddings()), final_norm(model),
                   model.get_output_embeddings())

    def train(self, mode: bool = True) -> TargetPieces:
        # Frozen forever: stay in eval mode whatever the parent module does.
        return super().train(False)


@dataclass
class Target:
    """A loaded, frozen target: HF model, tokenizer and where it came from."""

    model: Any
    tokenizer: Any
    name_or_path: str
    gguf_file: str | None = None
    head_only: bool = False  # only embedding, final norm and LM head are loaded (head_only.py)

    @property
    def num_hidden_layers(self) -> int:
        return int(text_config(self.model.config).num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(text_config(self.model.config).hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.model.config).vocab_size)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def pieces(self) -> TargetPieces:
        """Frozen embedding, final norm and LM head (shared modules)."""
        return TargetPieces.from_model(self.model)

    def token_id(self, token: str) -> int:
        """Id of a token that must exist in the vocabulary (e.g. the MASK token)."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"{self.name_or_path}: token {token!r} is not in the vocabulary")
        return int(tid)

    def identity(self) -> dict[str, Any]:
        """What a capture manifest records to recognise this target later."""
        return {
            "name_or_path": self.name_or_path,
            "gguf_file": self.gguf_file,
            "architecture": (self.model.config.architectures or [type(self.model).__name__])[0],
            "config_hash": config_hash(self.model.config),
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "chat_template_hash": chat_template_hash(self.tokenizer),
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "dtype": str(self.model.dtype).removeprefix("torch."),
        }


def _check_source(name_or_path: str, gguf_file: str | None) -> None:
    path = Path(name_or_path)
    looks_local = path.is_absolute() or name_or_path.startswith(".") or path.exists()
    if looks_local and not path.is_dir():
        raise ValueError(
            f"target path {name_or_path!r} does not exist; materialise the tiny target with "
            "dflash_lab.target.tiny.materialize_tiny_target() or pass a model directory / hub id"
        )
    if gguf_file and looks_local and not (path / gguf_file).is_file():
        raise ValueError(f"gguf_file {gguf_file!r} not found in {name_or_path!r}")


def load_target(name_or_path: str, *, gguf_file: str | None = None,
                dtype: str | torch.dtype = "bfloat16", device: str | None = "auto",
                device_map: str | dict | None = None, attn_implementation: str | None = None,
                local_files_only: bool | None = None, head_only: bool = False) -> Target:
    """Load a frozen causal LM and its tokenizer.

    ``device_map`` (e.g. ``"auto"``) spreads a target bigger than one GPU over the visible GPUs
    and overrides ``device``. ``attn_implementation`` None lets transformers choose (sdpa where
    the architecture supports it, else eager: MiMo-V2-Flash has no sdpa). ``local_files_only``
    defaults to True for existing local paths and to ``HF_HUB_OFFLINE`` otherwise.
    ``head_only``: load only the embedding, final norm and LM head (offline training;
    :mod:`dflash_lab.target.head_only`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_source(name_or_path, gguf_file)
    if head_only:
        if gguf_file:
            raise ValueError(f"target.head_only=true reads safetensors weights; {gguf_file!r} "
                             "is a GGUF file: set target.head_only=false")
        from dflash_lab.target.head_only import load_target_head

        return load_target_head(name_or_path, dtype=dtype, device=device)
    if local_files_only is None:
        local_files_only = Path(name_or_path).is_dir() or bool(os.environ.get("HF_HUB_OFFLINE"))
    common: dict[str, Any] = {"local_files_only": local_files_only}
    if gguf_file:
        common["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **common)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=resolve_dtype(dtype), device_map=device_map,
        attn_implementation=attn_implementation, **common)
    if device_map is None:
        model.to(resolve_device(device))
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name_or_path=name_or_path, gguf_file=gguf_file)
