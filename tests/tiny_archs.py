"""Tiny random targets of the architectures the recipes name, for tests without a download.

The recipes train drafters for Qwen3 (the paper's target), Gemma-4 (a multimodal class whose
language model sits one level down, with a scaled embedding and final logit soft-capping),
Qwen3.5/3.6 (published as a multimodal checkpoint with ``model.language_model.*`` keys; its
decoder mixes linear-attention layers, whose cache cannot be cropped, with full attention),
MiMo-V2-Flash (MoE, sliding layers, no sdpa support) and SmolLM2 (Llama, tied head). Each builder
writes an ordinary Hugging Face directory in the layout the published checkpoint has, with the
built-in tiny target's tokenizer (ChatML, MASK token ``<|mask|>``), so the whole pipeline
(capture, training, head-only loading, eval) can run on it in seconds.

``vocab_size`` and ``num_hidden_layers`` give the real model's table size and depth (a recipe's
MASK id such as 151669 and its target layer ids such as 33 or 61 then mean what they mean on the
real model); the width stays tiny, so even a 262k-row table is a few MB per column. Gemma-4's
tokenizer declares ``mask_token: "<mask>"`` in tokenizer_config.json, as google/gemma-4-31B-it's
does. Weights are random: these targets test plumbing, not acceptance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

#: Architectures of new families: name -> the recipe that uses the real model
#: (tests/targets/test_archs.py runs each through every stage).
ARCHITECTURES = {"gemma4": "gemma4_swa", "qwen3_5": "qwen3.6_27b_swa",
                 "mimo_v2_flash": "mimo_swa_sinks"}
#: Every architecture with a builder (Qwen3 and Llama: the families the older recipes name;
#: DeepSeek-V4: a multi-stream target, hc_mult residual streams, tests/targets/test_streams.py).
BUILDERS = (*ARCHITECTURES, "qwen3", "llama", "deepseek_v4")
#: Residual streams of the tiny DeepSeek-V4 (DeepSeek-V4-Flash/Pro's hc_mult).
DEEPSEEK_V4_STREAMS = 4
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_VOCAB = 768  # the tiny target's vocabulary
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=_VOCAB, pad_token_id=0,
             eos_token_id=2, bos_token_id=None)
#: Layer pattern of each hybrid family, repeated to the requested depth.
_PATTERNS = {"gemma4": ["sliding_attention"] * 3 + ["full_attention"],
             "qwen3_5": ["linear_attention"] * 3 + ["full_attention"],
             "mimo_v2_flash": ["full_attention"] + ["sliding_attention"] * 3}
#: Gemma-4's declared mask token (google/gemma-4-31B-it tokenizer_config.json).
GEMMA_MASK_TOKEN = "<mask>"


def _layer_types(arch: str, depth: int) -> list[str]:
    pattern = _PATTERNS[arch]
    return [pattern[i % len(pattern)] for i in range(depth)]


def _config(arch: str, vocab: int, depth: int, width: int):
    from transformers import AutoConfig

    text = dict(_TEXT, vocab_size=vocab, num_hidden_layers=depth)
    if width != _TEXT["hidden_size"]:  # head_dim 16 kept; 2:1 grouped-query heads
        heads = max(2, width // 16)
        text.update(hidden_size=width, intermediate_size=2 * width, num_attention_heads=heads,
                    num_key_value_heads=heads // 2)
    if arch == "gemma4":
        # The per-layer input table is vocab x (depth x 16): with a real vocab and depth it
        # would dwarf the model, and the 31B model has none (only the E2B/E4B ones do).
        per_layer = {} if vocab == _VOCAB else {"hidden_size_per_layer_input": 0}
        text = dict(text, vocab_size_per_layer_input=vocab,
                    **({"hidden_size_per_layer_input": 16} | per_layer), sliding_window=8,
                    final_logit_softcapping=30.0, layer_types=_layer_types(arch, depth))
        return AutoConfig.for_model("gemma4", text_config=text, vision_config=None,
                                    audio_config=None, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3_5":
        text = dict(text, layer_types=_layer_types(arch, depth), linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=text["hidden_size"])
        return AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    if arch == "mimo_v2_flash":
        return AutoConfig.for_model(
            "mimo_v2_flash", **dict(text, layer_types=_layer_types(arch, depth), sliding_window=8,
                                    n_routed_experts=4, moe_intermediate_size=32,
                                    num_experts_per_tok=2))
    if arch == "deepseek_v4":
        # transformers' own class at toy size: sliding attention and routed MoE on every layer
        # (the compressed-attention layers need longer sequences than tests feed)
        return AutoConfig.for_model(
            "deepseek_v4", **dict(text, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
                                  o_groups=2, o_lora_rank=16, n_routed_experts=4,
                                  n_shared_experts=1, num_experts_per_tok=2,
                                  moe_intermediate_size=32, hc_mult=DEEPSEEK_V4_STREAMS,
                                  sliding_window=64, layer_types=["sliding_attention"] * depth,
                                  mlp_layer_types=["moe"] * depth))
    if arch in ("qwen3", "llama"):
        # Qwen3-8B has its own LM head; SmolLM2 ties it to the embedding.
        return AutoConfig.for_model(arch, **text, tie_word_embeddings=arch == "llama")
    raise ValueError(f"no tiny builder for architecture {arch!r}; known: {sorted(BUILDERS)}")


def _model(arch: str, config) -> Any:
    """The class the published checkpoint is saved from (multimodal for Gemma-4 and Qwen3.5)."""
    import transformers

    name = {"gemma4": "Gemma4ForConditionalGeneration",
            "qwen3_5": "Qwen3_5ForConditionalGeneration",
            "mimo_v2_flash": "MiMoV2FlashForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM"}[arch]
    return getattr(transformers, name)(config)


def _copy_tokenizer(arch: str, tokenizer_dir: Path, out: Path) -> None:
    """The tiny target's tokenizer files; Gemma-4's also declares its mask token."""
    for name in _TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    if arch == "gemma4":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        tok.add_special_tokens({"mask_token": GEMMA_MASK_TOKEN})
        tok.save_pretrained(str(out))
        declared = json.loads((out / "tokenizer_config.json").read_text()).get("mask_token")
        assert declared == GEMMA_MASK_TOKEN, declared


def build_tiny_arch_target(arch: str, out_dir: str | Path, tokenizer_dir: str | Path,
                           seed: int = 0, *, vocab_size: int = _VOCAB,
                           num_hidden_layers: int = 4, hidden_size: int = 64,
                           dtype: torch.dtype = torch.float32) -> Path:
    """Write a tiny random ``arch`` target to ``out_dir`` (config, safetensors, tokenizer).

    ``tokenizer_dir``: the built-in tiny target's directory (its tokenizer is reused; ids past
    its ~620 tokens are embedding rows no text encodes to). ``vocab_size`` / ``num_hidden_layers``:
    the embedding/LM-head rows and the decoder depth (hybrid layer patterns repeat);
    ``hidden_size``: the width (heads of 16 channels; 32 halves every full-vocab projection);
    ``dtype``:
    the saved weights' (published checkpoints are bfloat16). Matrices are drawn with std 0.2 so
    greedy continuations vary instead of repeating one token.
    """
    out = Path(out_dir)
    torch.manual_seed(seed)
    model = _model(arch, _config(arch, vocab_size, num_hidden_layers, hidden_size))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.to(dtype).save_pretrained(out)
    _copy_tokenizer(arch, Path(tokenizer_dir), out)
    return out


#: SmolLM2's special tokens, ids 0..16 (16 = ``<empty_output>``, the smollm2 recipe's MASK id).
SMOLLM2_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
    "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
    "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>",
    "<jupyter_script>", "<empty_output>")


def build_smollm2_style_tokenizer(out_dir: str | Path, texts: list[str]) -> Path:
    """A byte-level BPE (vocab <= 768) trained on ``texts`` with SmolLM2's special tokens at
    its ids 0..16 and a ChatML template, saved to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dflash_lab.targets.tiny import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_VOCAB, special_tokens=list(SMOLLM2_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|im_end|>", bos_token="<|im_start|>",
                                 unk_token="<|endoftext|>",
                                 additional_special_tokens=list(SMOLLM2_SPECIAL_TOKENS[3:]))
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    return Path(out_dir)
