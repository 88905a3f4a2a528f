"""Read the Muse Glimmer assistant format's config.json into our DrafterConfig.

The format and how each engine reads it: :mod:`dflash_lab.export.engines.muse`. Like a z-lab
directory, its layer layout is left to the engine; the importer resolves it with a named rule
set (``sources.resolve_third_party``). Every key is read or refused by name:

- read: the shape keys, ``rope_parameters``, ``max_position_embeddings`` (owners' default
  131072), the flat ``block_size`` / ``mask_token_id`` / ``target_layer_ids``, and the layout
  keys the rule sets read (``layer_types``, ``sliding_window``, ``is_causal``,
  ``use_sliding_window``); ``vocab_size`` and ``num_target_layers`` when a file has them (the
  owners' class writes neither);
- required: the keys whose default differs between the owners' class and vLLM's
  Qwen3Config-based one (:data:`REQUIRED`; ``save_pretrained`` writes them all);
- refused: ``dflash_config`` (not in the format; vLLM merges it, SGLang ignores it),
  ``hidden_act`` other than silu, ``attention_bias`` true, and any key nobody here reads.

No ``vocab_size``: DFlash 1 has no vocabulary-sized tensor, so the weights cannot tell it. The
config carries vLLM's default (202048, the Muse Glimmer target's) until a target is known:
``Source.vocab_recorded`` is False and training, eval and ``dflash-export --target`` take the
target's vocabulary.
"""

from __future__ import annotations

from typing import Any

from dflash_lab.export.engines.muse import VLLM_DEFAULT_VOCAB, owners_window_note
from dflash_lab.model.config import (
    HF_BOOKKEEPING_KEYS,
    DrafterConfig,
    reject_unknown_keys,
    shape_fields,
)

#: Keys the owners' class and vLLM's class default differently (rms_norm_eps 1e-5 vs 1e-6,
#: every layer sliding vs every layer full, rope theta 500000 vs Qwen3's): a file must say them.
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
            "layer_types", "block_size", "mask_token_id", "target_layer_ids")
READ = frozenset(REQUIRED) | {"max_position_embeddings", "sliding_window", "is_causal",
                              "use_sliding_window", "vocab_size", "num_target_layers"}
#: key -> (the only value the drafter implements, why)
FIXED = {"hidden_act": ("silu", "the drafter's MLP is SwiGLU (SGLang accepts only silu)"),
         "attention_bias": (False, "MuseGlimmerAssistantAttention has no q/k/v/o bias")}
REFUSED = {"dflash_config": (
    "is not part of the Muse Glimmer format (transformers' MuseGlimmerAssistantConfig has no "
    "such field): vLLM merges it over its causal=False default, SGLang ignores it, so the "
    "engines would read this directory differently; remove it, or save the drafter as a z-lab "
    "DFlashDraftModel directory (dflash-export DIR OUT)")}
OWNERS_MAX_POSITIONS = 131072  #: MuseGlimmerAssistantConfig.max_position_embeddings


def _check_keys(d: dict[str, Any], source: str) -> None:
    for key, why in REFUSED.items():
        if key in d:
            raise ValueError(f"{source}: key '{key}' {why}")
    reject_unknown_keys(set(d), READ | HF_BOOKKEEPING_KEYS | set(FIXED), "", source)
    for key, (want, why) in FIXED.items():
        if key in d and d[key] != want:
            raise ValueError(f"{source}: {key}={d[key]!r} is not supported ({why}); only "
                             f"{key}={want!r} is read")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"{source}: missing {missing}: MuseGlimmerAssistantConfig."
                         "save_pretrained writes them, and without them the owners' class and "
                         "vLLM's Qwen3Config-based class fall back to different defaults; write "
                         "them into config.json")


def _int(d: dict[str, Any], key: str, source: str) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: {key}={value!r} is not an integer")
    return value


def base_config(d: dict[str, Any], source: str) -> DrafterConfig:
    """Every DrafterConfig field of a Muse Glimmer config.json on a placeholder layout (all
    layers full): the caller replaces the layout with a rule set's reading, as for z-lab."""
    _check_keys(d, source)
    if "rope_theta" not in (d.get("rope_parameters") or {}):
        raise ValueError(f"{source}: rope_parameters has no rope_theta; write the theta the "
                         "drafter was trained with (the owners' default is 500000)")
    fields = shape_fields(d, source)
    ids = d["target_layer_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{source}: target_layer_ids={ids!r}: need a non-empty list of target "
                         "layer ids (z-lab convention: the output of target layer i)")
    fields.update(block_size=_int(d, "block_size", source),
                  mask_token_id=_int(d, "mask_token_id", source), target_layer_ids=ids)
    fields.setdefault("vocab_size", VLLM_DEFAULT_VOCAB)
    fields.setdefault("num_target_layers", max(ids) + 1)
    fields.setdefault("max_position_embeddings", OWNERS_MAX_POSITIONS)
    return DrafterConfig.create(source=source, **fields)


def format_notes(d: dict[str, Any]) -> list[str]:
    """What the import assumed because the format does not record it."""
    notes = []
    if "vocab_size" not in d:
        notes.append(f"Muse Glimmer format: no vocab_size (the head is the target's); "
                     f"{VLLM_DEFAULT_VOCAB} assumed as vLLM does until a target is given: "
                     "dflash-train and dflash-eval take the loaded target's, dflash-export the "
                     "--target's")
    if "num_target_layers" not in d:
        notes.append(f"num_target_layers not recorded; assumed {max(d['target_layer_ids']) + 1} "
                     "(training and eval use the loaded target's depth)")
    window = owners_window_note(d)
    return notes + ([window] if window else [])
