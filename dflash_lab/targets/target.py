"""A loaded target (:class:`Target`, from :func:`dflash_lab.targets.loader.load_target` or
:mod:`dflash_lab.targets.head_only`): its frozen pieces (embedding, final norm, LM head) and its
fingerprints (config, tokenizer, chat template, weights), which identify it in captures,
checkpoints and exports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_lab.checksums import sha256_of
from dflash_lab.dtypes import DTYPE_ALIASES, DTYPES

log = logging.getLogger(__name__)

#: Config keys that change with the saving tool or the load dtype, not with the model itself.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype",
     "_commit_hash", "_attn_implementation_autoset", "use_cache", "quantization_config"}
)
_DTYPES = {**DTYPES, **{alias: DTYPES[name] for alias, name in DTYPE_ALIASES.items()}}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/... or a torch dtype -> torch dtype (ValueError if unknown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str | None) -> str:
    """``"auto"`` -> ``cuda:<local rank>`` when CUDA is available, else ``cpu``. The local rank
    is torchrun's LOCAL_RANK, else SLURM's SLURM_LOCALID (a plain ``srun`` launch)."""
    if device in (None, "auto"):
        if torch.cuda.is_available():
            local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0))
            return f"cuda:{int(local)}"
        return "cpu"
    return device


def text_config(config):
    """The language model's config: ``text_config`` of multimodal configs (Gemma-4, Qwen3.5/3.6
    VLM checkpoints), the config itself otherwise. Layer count, hidden size and vocab live there."""
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def logit_softcap(config) -> float | None:
    """The target's own ``final_logit_softcapping`` (Gemma 2/3: logits = c tanh(z / c)), None
    when it has none: its distribution is softmax of the capped logits."""
    cap = getattr(text_config(config), "final_logit_softcapping", None)
    return float(cap) if cap else None


class RawEmbedding(nn.Module):
    """The plain table lookup ``weight[ids]`` (ids [...] -> [..., H]) of a target embedding whose
    module does more (Gemma's x sqrt(H)): the bare rows z-lab and vLLM feed the drafter (times
    ``input_embedding_scale`` when set). ``weight`` is the target's own parameter. SGLang:
    (docs/capture.md, "Target architectures")."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


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


def config_hash(config) -> str:
    """sha256 of the model config without volatile keys (tool version, dtype, path)."""
    return sha256_of({k: v for k, v in config.to_dict().items()
                         if k not in _VOLATILE_CONFIG_KEYS})


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary, merges and special tokens (not the chat template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return sha256_of(json.loads(backend.to_str()) if backend is not None
                        else sorted(tokenizer.get_vocab().items()))


def chat_template_hash(tokenizer) -> str | None:
    """sha256 of the chat template text, or None when the tokenizer has none."""
    template = getattr(tokenizer, "chat_template", None)
    return sha256_of(template) if template else None


#: Weight files a fingerprint reads, by preference (the first kind present in the directory).
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_PROBE, _NUM_SAMPLES, _HEAD_BYTES = 64, 16, 1 << 20


def _safetensors_probes(f, size: int) -> tuple[int, list[int]] | None:
    """(header length, offsets to sample) of a safetensors file: 64 bytes at the start, middle and
    end of every tensor, so any tensor's change shows; None when not a readable safetensors."""
    try:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n)) if 8 + n <= size else None
    except (ValueError, UnicodeDecodeError):
        header = None
    f.seek(0)
    if not isinstance(header, dict):
        return None
    probes = []
    for name in sorted(k for k in header if k != "__metadata__"):
        start, end = (8 + n + o for o in header[name]["data_offsets"])
        probes += sorted({start, max(start, (start + end) // 2 - _PROBE // 2),
                          max(start, end - _PROBE)})
    return 8 + n, probes


def _file_fingerprint(h, path: Path) -> None:
    """Feed ``path``'s name, size, header and probed data bytes to the hash ``h``."""
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        found = _safetensors_probes(f, size) if path.suffix == ".safetensors" else None
        if found is None:  # GGUF (metadata + tensor info in the first MiB) or a pickle
            head = min(size, _HEAD_BYTES)
            span = max(size - head - _PROBE, 0)
            found = head, [head + span * i // (_NUM_SAMPLES - 1) for i in range(_NUM_SAMPLES)]
        head, probes = found
        h.update(f.read(head))
        for offset in probes:
            f.seek(offset)
            h.update(f.read(_PROBE))


def weights_fingerprint(files: list[Path]) -> str:
    """sha256 over each weight file's name, size, header (names, dtypes, shapes) and sampled data:
    64 bytes at the start, middle and end of every safetensors tensor (16 evenly spaced samples of
    other files). Reads kilobytes per tensor, not the weights, yet two checkpoints with the same
    config but other weights differ (a fine-tune changes every tensor it trains, so its samples)."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        _file_fingerprint(h, path)
    return h.hexdigest()


def target_weight_files(name_or_path: str, gguf_file: str | None) -> list[Path]:
    """The files holding a target's weights: the GGUF file, else the directory's (or the hub
    snapshot's, through the local HF cache) safetensors files (.bin/.pt when it has none)."""
    if gguf_file:
        from transformers.utils import cached_file

        local = Path(name_or_path) / gguf_file
        return [local if local.is_file() else
                Path(cached_file(name_or_path, gguf_file, local_files_only=True))]
    path = Path(name_or_path)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(name_or_path, local_files_only=True))
    for pattern in _WEIGHT_GLOBS:
        files = sorted(path.glob(pattern))
        if files:
            return files
    return []


class TargetPieces(nn.Module):
    """The target's own frozen embedding (ids [...] -> [..., H], bare rows: :class:`RawEmbedding`),
    ``norm`` and ``lm_head`` ([..., H] -> [..., V]), shared with the drafter; none requires grad."""

    def __init__(self, embed_tokens: nn.Module, norm: nn.Module, lm_head: nn.Module,
                 logit_softcap: float | None = None):
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = embed_tokens, norm, lm_head
        #: the target's own final_logit_softcapping (its distribution is softmax of the capped
        #: logits: the distribution losses' teacher applies it)
        self.logit_softcap = logit_softcap
        for p in self.parameters():
            p.requires_grad_(False)

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
    _fingerprint: str | None = field(default=None, repr=False, compare=False)

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
    def max_position_embeddings(self) -> int | None:
        """The context the target's config declares (None when it declares none)."""
        value = getattr(text_config(self.model.config), "max_position_embeddings", None)
        return int(value) if value is not None else None

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def pieces(self) -> TargetPieces:
        """Frozen embedding, final norm and LM head (shared modules) of the HF model."""
        embed = self.model.get_input_embeddings()
        if not (isinstance(embed, nn.Embedding) and type(embed).forward is nn.Embedding.forward):
            embed = RawEmbedding(embed.weight)  # its forward does more than the lookup
        return TargetPieces(embed, final_norm(self.model), self.model.get_output_embeddings(),
                            logit_softcap(self.model.config))

    def token_id(self, token: str) -> int:
        """Id of a token that must exist in the vocabulary (e.g. the MASK token)."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"{self.name_or_path}: token {token!r} is not in the vocabulary")
        return int(tid)

    def weights_fingerprint(self) -> str | None:
        """:func:`weights_fingerprint` of the files this target was loaded from (once; the same for
        full and head-only loads of one snapshot), None when not from files (built in memory)."""
        if self._fingerprint is None:
            try:
                files = target_weight_files(self.name_or_path, self.gguf_file)
            except Exception as err:  # not a directory nor a cached hub snapshot
                log.warning("target %s: no weight files to fingerprint (%s)", self.name_or_path,
                            err)
                files = []
            self._fingerprint = weights_fingerprint(files) if files else ""
        return self._fingerprint or None

    def identity(self) -> dict[str, Any]:
        """What a capture manifest records to recognise this target (config, tokenizer, weights)."""
        return {
            "name_or_path": self.name_or_path,
            "gguf_file": self.gguf_file,
            "architecture": (self.model.config.architectures or [type(self.model).__name__])[0],
            "config_hash": config_hash(self.model.config),
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "weights_fingerprint": self.weights_fingerprint(),
            "chat_template_hash": chat_template_hash(self.tokenizer),
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "dtype": str(self.model.dtype).removeprefix("torch."),
        }


#: Chat templates shipped for targets whose files carry none (GGUF conversions often do not):
#: ``target.chat_template=NAME``. Each is the family's turn format (contents are not trimmed).
BUILTIN_CHAT_TEMPLATES = {
    "chatml": (  # Qwen, SmolLM2 and other ChatML models
        "{%- for m in messages -%}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"),
    "gemma": (  # Gemma 2/3: system text folded into the first user turn, role "model"
        "{{ bos_token }}"
        "{%- set ns = namespace(system='') -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] + '\\n\\n' -%}"
        "{%- else -%}"
        "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
        "{{ '<start_of_turn>' + role + '\\n' }}"
        "{%- if role == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
        "{{ m['content'] }}{{ '<end_of_turn>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"),
    "llama3": (  # Llama 3.x instruct
        "{{ bos_token }}"
        "{%- for m in messages -%}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
        "{{ m['content'] + '<|eot_id|>' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"),
}
