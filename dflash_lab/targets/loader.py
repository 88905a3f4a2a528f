"""Load a target causal LM + tokenizer, expose its frozen pieces, and fingerprint it.

A target comes from a local directory, a hub id (through the HF cache; offline with
``HF_HUB_OFFLINE=1``) or a GGUF file (``name_or_path=FILE.gguf`` or ``gguf_file=``, needs the
``gguf`` package), with an optional replacement chat template. It is always frozen (eval mode,
no grad). :func:`load_target` is the one loader every entry point uses.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

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


class RawEmbedding(nn.Module):
    """The plain table lookup ``weight[ids]`` of a target embedding whose own module does more.

    Gemma's HF embedding multiplies every row by sqrt(H). z-lab's reference and vLLM give the
    drafter the bare rows (vLLM shares the target's ``embed_tokens`` module, whose Gemma scale
    lives in the model's forward), so training and the offline eval read the same unscaled rows
    (times ``input_embedding_scale`` when set). SGLang 0.5.23 calls the target's
    ``get_input_embeddings()(ids)``, which for Gemma 4 is the scaled module: the exporter's SGLang
    rules (export/engines/sglang.py) account for that.
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


#: Weight files a fingerprint reads, by preference (the first kind present in the directory).
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_PROBE, _NUM_SAMPLES, _HEAD_BYTES = 64, 16, 1 << 20


def _safetensors_probes(f, size: int) -> tuple[int, list[int]] | None:
    """(header length, offsets to sample) of a safetensors file: 64 bytes at the start, middle
    and end of every tensor's data, so a change to any one tensor changes the fingerprint.
    None when the file is not a readable safetensors file."""
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
    """sha256 over each weight file's name, size, header (names, dtypes, shapes) and sampled
    data: 64 bytes at the start, middle and end of every safetensors tensor (16 evenly spaced
    samples of other files). Reads kilobytes per tensor, not the weights, yet two checkpoints
    with the same config but other weights differ (a fine-tune changes every tensor it
    trains, so its samples)."""
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
    """The target's frozen token embedding, final norm and LM head, shared with the drafter.

    The modules are the target's own (not copies); every parameter has ``requires_grad=False``.
    ``embed_tokens``: ids [...] -> [..., H], the bare table rows the engines feed the drafter
    (:class:`RawEmbedding`); ``norm``: [..., H] -> [..., H];
    ``lm_head``: [..., H] -> [..., V].
    """

    def __init__(self, embed_tokens: nn.Module, norm: nn.Module, lm_head: nn.Module,
                 logit_softcap: float | None = None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.lm_head = lm_head
        #: the target's own final_logit_softcapping (its distribution is softmax of the capped
        #: logits: the distribution losses' teacher applies it)
        self.logit_softcap = logit_softcap
        for p in self.parameters():
            p.requires_grad_(False)

    @classmethod
    def from_model(cls, model: nn.Module) -> TargetPieces:
        """Pick the pieces out of an HF causal LM or multimodal model with a language model."""
        cap = getattr(text_config(model.config), "final_logit_softcapping", None)
        return cls(raw_embedding(model.get_input_embeddings()), final_norm(model),
                   model.get_output_embeddings(), float(cap) if cap else None)

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
        """Frozen embedding, final norm and LM head (shared modules)."""
        return TargetPieces.from_model(self.model)

    def token_id(self, token: str) -> int:
        """Id of a token that must exist in the vocabulary (e.g. the MASK token)."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"{self.name_or_path}: token {token!r} is not in the vocabulary")
        return int(tid)

    def weights_fingerprint(self) -> str | None:
        """:func:`weights_fingerprint` of the files this target was loaded from (computed once;
        the same for full and head-only loads of one directory or hub snapshot), None when the
        weights are not in files (a model built in memory)."""
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
        """What a capture manifest records to recognise this target later (config, tokenizer
        and weights: ``weights_fingerprint``)."""
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


def read_chat_template(spec: str) -> str:
    """``target.chat_template``: a built-in name (:data:`BUILTIN_CHAT_TEMPLATES`) or a file
    holding the Jinja text (``.jinja``/``.txt``) or a tokenizer_config.json-style JSON with a
    ``chat_template`` key."""
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


def _hub_kwargs(name_or_path: str, local_files_only: bool | None) -> dict[str, Any]:
    """``local_files_only``: True for local paths and under ``HF_HUB_OFFLINE``; hub ids are
    otherwise fetched (or read from the cache) by transformers."""
    if local_files_only is None:
        local_files_only = Path(name_or_path).is_dir() or bool(os.environ.get("HF_HUB_OFFLINE"))
    return {"local_files_only": local_files_only}


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
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    kwargs = {**_hub_kwargs(name_or_path, local_files_only), **extra}
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
    """Load a frozen causal LM and its tokenizer: the ONE target loader of every entry point.

    ``name_or_path``: a local directory, a hub id (through the HF cache; offline with
    ``HF_HUB_OFFLINE=1``) or a ``.gguf`` file (also ``gguf_file=`` inside a directory; needs
    the ``gguf`` package). ``device_map`` (e.g. ``"auto"``) spreads a target bigger than one
    GPU over the visible GPUs and overrides ``device``. ``attn_implementation`` None lets
    transformers choose (sdpa where the architecture supports it, else eager: MiMo-V2-Flash has
    no sdpa). ``head_only``: load only the embedding, final norm and LM head (offline
    training; :mod:`dflash_lab.targets.head_only`). ``chat_template``: replace the tokenizer's
    template (a file or a built-in name, :func:`read_chat_template`): GGUF files often carry
    none.
    """
    name_or_path, gguf_file = split_gguf_path(str(name_or_path), gguf_file)
    _check_source(name_or_path, gguf_file)
    template = read_chat_template(chat_template) if chat_template else None
    if head_only:
        if gguf_file:
            raise ValueError(f"target.head_only=true reads safetensors weights; {gguf_file!r} "
                             "is a GGUF file: set target.head_only=false")
        from dflash_lab.targets.head_only import load_target_head

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


def _gguf_arch_and_head_dim(path: str) -> tuple[str, int | None]:
    """``general.architecture`` and ``{arch}.attention.key_length`` (None when absent) of the
    GGUF file at ``path``."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch_field = fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    field = fields.get(f"{arch}.attention.key_length")
    return arch, None if field is None else int(field.parts[field.data[0]][0])


def _gguf_config(name_or_path: str, gguf_file: str, common: dict[str, Any]):
    """The transformers config of a GGUF target, ``head_dim`` taken from the file.

    transformers' GGUF mapping of some architectures (qwen3) drops
    ``{arch}.attention.key_length``, so ``head_dim`` falls back to the config class default
    (Qwen3: 128) and any other head width fails at load with a size mismatch.
    """
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.utils import cached_file

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"target {gguf_file!r} is a GGUF file: transformers reads it with "
                         f"{missing}; pip install -c constraints.txt gguf accelerate")
    config = AutoConfig.from_pretrained(name_or_path, **common)
    path = cached_file(name_or_path, gguf_file, local_files_only=common["local_files_only"])
    arch, head_dim = _gguf_arch_and_head_dim(path)
    mapped = "attention.key_length" in GGUF_CONFIG_MAPPING.get(arch, {})
    if head_dim is not None and not mapped and hasattr(config, "head_dim"):
        config.head_dim = head_dim
    return config


def _check_loaded(name_or_path: str, gguf_file: str | None, info: dict) -> None:
    """A GGUF whose tensors transformers does not map loads as random weights with a warning:
    refuse it instead."""
    bad = list(info.get("missing_keys") or []) + list(info.get("mismatched_keys") or [])
    if gguf_file and bad:
        raise ValueError(f"target {name_or_path}/{gguf_file}: transformers left {len(bad)} "
                         f"weights unloaded ({sorted(map(str, bad))[:4]} ...); this GGUF's "
                         "architecture or tensor names are not supported by this transformers")


def _load_full(name_or_path: str, gguf_file: str | None, dtype, device, device_map,
               attn_implementation, local_files_only) -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common: dict[str, Any] = _hub_kwargs(name_or_path, local_files_only)
    if gguf_file:
        common["gguf_file"] = gguf_file
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
    _check_loaded(name_or_path, gguf_file, info)
    if device_map is None:
        model.to(resolve_device(device))
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name_or_path=name_or_path, gguf_file=gguf_file)
