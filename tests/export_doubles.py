"""Shared builders for the exporter tests (no tests here): tiny DrafterConfigs per recipe-like
layout, random serving-layout weights, Lightning-style checkpoints, z-lab style directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_lab.export.weights import MASK_KEY, expected_shapes
from dflash_lab.model.config import DrafterConfig

S, F = "sliding_attention", "full_attention"
BASE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=300, mask_token_id=7, num_target_layers=6,
            target_layer_ids=[1, 2, 3], block_size=4)

LAYOUTS: dict[str, dict[str, Any]] = {
    # z-lab default: every layer full, bidirectional inside the block
    "zlab_default": dict(is_causal=False),
    # every layer sliding and causal
    "all_sliding_causal": dict(layer_types=[S, S, S], sliding_window=8, is_causal=True),
    # gemma-4 / Qwen3.6: sliding causal + full bidirectional, implicit (legacy rule)
    "gemma_mixed": dict(layer_types=[S, S, F], sliding_window=8),
    # MiMo: all sliding bidirectional, learned mask embedding, sink logits
    "mimo": dict(layer_types=[S, S, S], sliding_window=8, is_causal=False,
                 learned_mask_embedding=True, attention_sink_bias=True),
    # no engine can express: full layers with different causality
    "illegal_mixed": dict(is_causal=[True, False, True]),
}


def make_config(layout: str, **overrides: Any) -> DrafterConfig:
    return DrafterConfig(**{**BASE, **LAYOUTS[layout], **overrides})


def random_state(config: DrafterConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Serving-layout tensors (plus ``mask_embedding`` when learned) with the right shapes."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=gen) * 0.1 for k, shape in
             expected_shapes(config).items()}
    for k in state:
        if k.endswith("norm.weight"):
            state[k] = 1.0 + state[k]
    if config.learned_mask_embedding:
        state[MASK_KEY] = torch.randn(config.hidden_size, generator=gen)
    return state


def write_checkpoint(path: Path, config: DrafterConfig, state: dict[str, torch.Tensor],
                     extra_hparams: dict | None = None) -> Path:
    """A Lightning-style .ckpt: ``drafter.``-prefixed weights, config in hyper_parameters."""
    sd = {f"drafter.{k}": v for k, v in state.items()}
    sd["embed_tokens.weight"] = torch.zeros(4, 4)  # other prefixes must be ignored
    ckpt = {"state_dict": sd, "epoch": 1, "global_step": 10,
            "hyper_parameters": {"drafter_config": config.to_dict(), **(extra_hparams or {})}}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def write_zlab_dir(path: Path, config: dict[str, Any], state: dict[str, torch.Tensor],
                   mask: torch.Tensor | None = None) -> Path:
    """A third-party serving directory from a hand-written config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    if mask is not None:
        torch.save(mask, path / "mask_embedding.pt")
    return path


def zlab_config(style: str) -> dict[str, Any]:
    """Hand-written z-lab style config.json files (no is_causal, no training spec)."""
    common = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "intermediate_size": 64, "vocab_size": 300, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000, "max_position_embeddings": 4096, "hidden_act": "silu",
              "tie_word_embeddings": False, "block_size": 4, "num_target_layers": 6,
              "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 2, 3]}}
    if style == "qwen3_8b":  # all full, no layer_types, nothing about causality
        return common
    if style == "gemma4":  # mixed layer types, is_causal NOT declared
        return {**common, "layer_types": [S, S, F], "use_sliding_window": True,
                "sliding_window": 8, "max_window_layers": 3}
    if style == "mimo":  # use_swa, no layer_types, sinks, learned mask file
        dfc = {**common["dflash_config"], "use_swa": True, "swa_window_size": 8,
               "attention_sink_bias": True}
        return {**common, "dflash_config": dfc}
    raise ValueError(style)


#: A tiny Muse Glimmer assistant: the released layout (every layer sliding, bidirectional) at
#: the sizes of BASE; keywords of transformers' MuseGlimmerAssistantConfig.
MUSE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, target_layer_ids=[1, 3], mask_token_id=7,
            block_size=4, sliding_window=16, max_position_embeddings=512)


def write_muse_dir(path: Path, seed: int = 0, **overrides: Any):
    """A Muse Glimmer directory written by its owners' code: transformers'
    ``MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(...)).save_pretrained`` with seeded
    random weights (norms around 1). Returns the model (eval mode) for reference forwards."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    model = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(**{**MUSE, **overrides}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if name.endswith("norm.weight") or "norm_enc" in name else noise)
    model.save_pretrained(path)
    return model.eval()


def muse_for(target, **overrides: Any) -> dict[str, Any]:
    """MuseGlimmerAssistantConfig keywords of a drafter for the built-in tiny target (hidden 64,
    8 layers; its MASK token), the released layout (every layer sliding, W=16)."""
    return {**MUSE, "hidden_size": target.model.config.hidden_size, "head_dim": 16,
            "intermediate_size": 96, "target_layer_ids": [1, 3, 5],
            "mask_token_id": target.token_id("<|mask|>"), **overrides}


def muse_state(model) -> dict[str, torch.Tensor]:
    """The owners' model's tensors under our names (what the import must produce)."""
    renames = {"encoder.fc.weight": "fc.weight",
               "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    return {renames.get(k, k): v for k, v in model.state_dict().items()}


#: The config.json of z-lab/Muse-Glimmer-30B-DFlash2 (revision b54ffdd1, transformers 5.15.0), the
#: released DFlash 2 Muse Glimmer drafter: z-lab's ``DFlash2DraftModel`` layout (model_type qwen3;
#: z-lab's dflash 0.1.0 ``load_transformers_models`` picks that class from ``architectures``),
#: every key as published but the sizes, which :func:`muse_dflash2_config` sets (published:
#: hidden 6656, intermediate 19968, 5 layers, 32/8 heads of 128, vocab 202048, 52 target layers,
#: ids [1, 13, 25, 37, 49], MASK 201818, window 2048, block 16).
MUSE_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 200000, "is_causal": False,
    "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2,
                      "final_logit_softcapping": 20.0, "output_multiplier": 0.19611613513818404,
                      "selector_rank": 256, "selector_top_k": 16},
    "dtype": "bfloat16", "eos_token_id": 200001, "hidden_act": "silu",
    "initializer_range": 0.02, "model_type": "qwen3", "pad_token_id": 200018,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "use_cache": False, "use_sliding_window": True,
}


def muse_dflash2_config(*, hidden_size: int, vocab_size: int, mask_token_id: int,
                        target_layer_ids: list[int], num_target_layers: int,
                        num_hidden_layers: int = 2, block_size: int = 4, sliding_window: int = 16,
                        selector_rank: int = 8, selector_top_k: int = 4) -> dict[str, Any]:
    """:data:`MUSE_DFLASH2` at the given sizes (4 heads of hidden/4... see the body): the
    published keys and values otherwise, every layer sliding as published."""
    heads, kv_heads = 4, 2
    return {**MUSE_DFLASH2, "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_hidden_layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": hidden_size // heads,
            "vocab_size": vocab_size, "num_target_layers": num_target_layers,
            "max_position_embeddings": 131072, "max_window_layers": num_hidden_layers,
            "layer_types": ["sliding_attention"] * num_hidden_layers,
            "sliding_window": sliding_window,
            "dflash_config": {**MUSE_DFLASH2["dflash_config"], "block_size": block_size,
                              "mask_token_id": mask_token_id,
                              "target_layer_ids": list(target_layer_ids),
                              "selector_rank": selector_rank, "selector_top_k": selector_top_k}}
