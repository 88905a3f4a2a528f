"""Test utility: write a float32 GGUF file from a Hugging Face Qwen3 directory.

The project's GGUF tests need a GGUF that nobody downloads: this turns the built-in tiny target
(``tests/conftest.py::tiny_target_dir``: ``Qwen3ForCausalLM``, byte-level BPE with merges,
special tokens, a chat template) into the file a llama.cpp conversion of it would be, with the
``gguf`` package (dev extra). What transformers' GGUF loader reads for ``qwen3``:

- ``qwen3.*`` shape keys (block count, embedding/FFN lengths, head counts, RoPE base, RMS eps);
  ``attention.key_length``/``value_length`` carry ``head_dim`` as llama.cpp writes them (the
  loader in dflash_lab.targets.loader reads them; transformers' qwen3 mapping does not);
- ``tokenizer.ggml.*``: model ``gpt2`` (byte-level BPE), the tokens by id padded to the
  embedding's row count with ``[PAD{i}]`` (type UNUSED, as llama.cpp pads), token types
  (special added tokens CONTROL, other added tokens USER_DEFINED), merges, eos/padding/bos ids,
  and optionally ``tokenizer.chat_template``;
- tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ..., ``output``), F32 (or
  matrices quantised, e.g. Q8_0), in the HF layout: llama.cpp permutes q/k rows only for the
  llama architecture, not for qwen3.

The write is atomic (a temporary sibling renamed into place).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from dflash_lab.paths import atomic_path

#: tokenizer.ggml.pre for the tiny target: none of llama.cpp's named splits is its pre-tokenizer
#: (GPT-2's regex with single digits), and transformers keeps GPT-2's own split for a name it
#: does not know, which tokenizes the tiny target's vocabulary identically.
TINY_PRE_TOKENIZER = "default"


def _token_table(tokenizer_json: dict, num_rows: int) -> tuple[list[str], list[int]]:
    """Tokens by id for ids 0..num_rows-1 and their GGUF token types."""
    tokens: list[str | None] = [None] * num_rows
    types = [int(gguf.TokenType.UNUSED)] * num_rows
    for text, tid in tokenizer_json["model"]["vocab"].items():
        tokens[tid], types[tid] = text, int(gguf.TokenType.NORMAL)
    for added in tokenizer_json["added_tokens"]:
        kind = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        tokens[added["id"]], types[added["id"]] = added["content"], int(kind)
    return [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)], types


def _merges(tokenizer_json: dict) -> list[str]:
    """BPE merges as ``"a b"`` strings (tokenizers writes pairs or strings by version)."""
    return [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]


def _add_shape(writer: gguf.GGUFWriter, config: dict) -> None:
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 1e6))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict, num_rows: int,
                   chat_template: bool) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens, types = _token_table(tok, num_rows)
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(TINY_PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_merges(tok))
    writer.add_eos_token_id(ids[tok_config["eos_token"]])
    if tok_config.get("pad_token"):
        writer.add_pad_token_id(ids[tok_config["pad_token"]])
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])
    writer.add_add_bos_token(False)
    template_file = model_dir / "chat_template.jinja"
    if chat_template:
        writer.add_chat_template(template_file.read_text(encoding="utf-8"))


def quantized(array: np.ndarray, quant: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """``array`` as written: matrices in ``quant`` (``F32``, ``Q8_0``, ``Q4_0``, ...), vectors
    (norms) in F32 as llama.cpp keeps them. Returns (data, its GGML type)."""
    qtype = gguf.GGMLQuantizationType[quant]
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32:
        return array, gguf.GGMLQuantizationType.F32
    return gguf.quantize(array, qtype), qtype


def _add_tensors(writer: gguf.GGUFWriter, model_dir: Path, num_layers: int,
                 skip: tuple[str, ...], quant: str) -> None:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, num_layers)
    for hf_name, array in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{model_dir}: no GGUF name for tensor {hf_name!r}")
        if gguf_name in skip:
            continue
        data, qtype = quantized(array, quant)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)


def write_qwen3_gguf(model_dir: str | Path, out_path: str | Path, *,
                     chat_template: bool = True, skip_tensors: tuple[str, ...] = (),
                     quant: str = "F32") -> Path:
    """Write ``out_path`` (a ``.gguf``) from the Qwen3 HF directory ``model_dir``.

    ``chat_template=False`` leaves ``tokenizer.chat_template`` out, as many GGUF conversions
    do; ``skip_tensors`` (GGUF names, e.g. ``blk.0.ffn_up.weight``) leaves tensors out, the
    shape of a file whose tensors the loader cannot map; ``quant`` (e.g. ``Q8_0``) quantises
    the matrices with the gguf package (:func:`quantized`). Returns ``out_path``.
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "qwen3":
        raise ValueError(f"{model_dir}: model_type {config.get('model_type')!r}; this writer "
                         "only writes qwen3")
    with atomic_path(out_path) as tmp:
        writer = gguf.GGUFWriter(tmp, "qwen3")
        writer.add_name(model_dir.name)
        _add_shape(writer, config)
        _add_tokenizer(writer, model_dir, config, config["vocab_size"], chat_template)
        _add_tensors(writer, model_dir, config["num_hidden_layers"], skip_tensors, quant)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out_path
