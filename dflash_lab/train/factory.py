"""Build a drafter for a given target: shape defaults come from the target's config.json.

It lives in train/ (which may read target directories) so that model/ imports only torch.

This is the Hydra ``_target_`` of the ``drafter`` config group. Any DrafterConfig field may be
given; fields left out (or null) that the target defines (hidden size, vocab, heads, head_dim,
intermediate size, norm eps, RoPE, max positions) are copied from the target, because the drafter
shares the target's embedding and LM head and z-lab drafters mirror the target's layer shape.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.target.tiny import MARKER_FILE  # the tiny target records its MASK id there

log = logging.getLogger(__name__)

#: DrafterConfig field <- target config.json key.
_FROM_TARGET = {
    "hidden_size": "hidden_size", "vocab_size": "vocab_size",
    "num_target_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads", "head_dim": "head_dim",
    "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta", "max_position_embeddings": "max_position_embeddings",
}


def read_target_config(target_path: str | Path) -> dict[str, Any]:
    """The target's config.json as a dict (text_config of multimodal configs is unwrapped)."""
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"target config not found: {path}; set target.path to an HF model "
                         "directory (or materialise the tiny target)")
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests rope_theta here
    if cfg.get("rope_theta") is None and "rope_theta" in rope:
        cfg = dict(cfg, rope_theta=rope["rope_theta"])
    return cfg


def default_mask_token_id(target_path: str | Path) -> int | None:
    """A MASK id the target directory declares: our tiny target's marker or a tokenizer mask."""
    root = Path(target_path)
    marker = root / MARKER_FILE
    if marker.is_file():
        return int(json.loads(marker.read_text())["mask_token_id"])
    tok_cfg = root / "tokenizer_config.json"
    if tok_cfg.is_file():
        tok = json.loads(tok_cfg.read_text())
        mask, added = tok.get("mask_token"), tok.get("added_tokens_decoder", {})
        for tid, entry in added.items():
            if mask is not None and entry.get("content") == mask:
                return int(tid)
    return None


def drafter_config_for_target(target_path: str | Path, **fields: Any) -> DrafterConfig:
    """DrafterConfig with unset shape fields copied from the target at ``target_path``."""
    target = read_target_config(target_path)
    fields = {k: v for k, v in fields.items() if v is not None}
    for ours, theirs in _FROM_TARGET.items():
        if ours not in fields and target.get(theirs) is not None:
            fields[ours] = target[theirs]
    if "mask_token_id" not in fields:
        mask_id = default_mask_token_id(target_path)
        if mask_id is None:
            raise ValueError(
                f"drafter.mask_token_id is not set and {target_path} declares no mask token; "
                "set it (Qwen3: 151669, Qwen3.5/3.6: 248070) in the recipe or on the command line")
        fields["mask_token_id"] = mask_id
    return DrafterConfig.create(source=f"drafter config for target {target_path}", **fields)


def build_drafter(target_path: str | Path, backend: str = "auto", **fields: Any) -> DFlashDrafter:
    """A freshly initialised drafter for the target (Hydra entry of conf/drafter/*.yaml)."""
    config = drafter_config_for_target(target_path, **fields)
    log.info("drafter layers: %s", config.layer_specs())
    return DFlashDrafter(config, backend=backend)
