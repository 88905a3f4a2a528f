"""Tiny random targets of the architectures the recipes name, for tests without a download.

The recipes train drafters for Gemma-4 (a multimodal class whose language model sits one level
down, with a scaled embedding and final logit soft-capping), Qwen3.5/3.6 (published as a
multimodal checkpoint with ``model.language_model.*`` keys; its decoder mixes linear-attention
layers, whose cache cannot be cropped, with full attention) and MiMo-V2-Flash (MoE, sliding
layers, no sdpa support). Each builder writes an ordinary Hugging Face directory in the layout
the published checkpoint has, with the built-in tiny target's tokenizer (vocab 768, MASK token),
so the whole pipeline (capture, training, head-only loading, eval) can run on it in seconds.
Weights are random: these targets test plumbing, not acceptance.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

#: Architectures with a builder: name -> the recipe that uses the real model.
ARCHITECTURES = {"gemma4": "gemma4_swa", "qwen3_5": "qwen3.6_27b_swa",
                 "mimo_v2_flash": "mimo_swa_sinks"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_VOCAB = 768  # the tiny target's vocabulary
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=_VOCAB, pad_token_id=0,
             eos_token_id=2, bos_token_id=None)


def _config(arch: str):
    from transformers import AutoConfig

    if arch == "gemma4":
        text = dict(_TEXT, vocab_size_per_layer_input=_VOCAB, hidden_size_per_layer_input=16,
                    sliding_window=8, final_logit_softcapping=30.0,
                    layer_types=["sliding_attention"] * 3 + ["full_attention"])
        return AutoConfig.for_model("gemma4", text_config=text, vision_config=None,
                                    audio_config=None, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3_5":
        text = dict(_TEXT, layer_types=["linear_attention"] * 3 + ["full_attention"],
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64)
        return AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    if arch == "mimo_v2_flash":
        return AutoConfig.for_model(
            "mimo_v2_flash", **dict(_TEXT, layer_types=["full_attention"]
                                    + ["sliding_attention"] * 3, sliding_window=8,
                                    n_routed_experts=4, moe_intermediate_size=32,
                                    num_experts_per_tok=2))
    raise ValueError(f"no tiny builder for architecture {arch!r}; known: {sorted(ARCHITECTURES)}")


def _model(arch: str, config) -> Any:
    """The class the published checkpoint is saved from (multimodal for Gemma-4 and Qwen3.5)."""
    import transformers

    name = {"gemma4": "Gemma4ForConditionalGeneration",
            "qwen3_5": "Qwen3_5ForConditionalGeneration",
            "mimo_v2_flash": "MiMoV2FlashForCausalLM"}[arch]
    return getattr(transformers, name)(config)


def build_tiny_arch_target(arch: str, out_dir: str | Path, tokenizer_dir: str | Path,
                           seed: int = 0) -> Path:
    """Write a tiny random ``arch`` target to ``out_dir`` (config, safetensors, tokenizer).

    ``tokenizer_dir``: the built-in tiny target's directory (its tokenizer is reused). Matrices
    are drawn with std 0.2 so greedy continuations vary instead of repeating one token.
    """
    out = Path(out_dir)
    torch.manual_seed(seed)
    model = _model(arch, _config(arch))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out
