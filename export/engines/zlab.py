"""z-lab's reference loader (``dflash`` 0.1.0 ``model.py`` ``_draft_value``), emulated: how it
reads a third-party config.json's non-layout fields, ``dflash_config`` first, then the top level.
The one reader of a raw config.json's ``block_size``; the layout is left to the rule sets, and a
key no reader knows is a ValueError (docs/export.md, "Importing third-party directories").
"""

from __future__ import annotations

import logging
from typing import Any

from dflash_lab.model import heads
from dflash_lab.model.config import (
    CORE_DFLASH_KEYS,
    HF_BOOKKEEPING_KEYS,
    OUR_TOP_KEYS,
    TRAINING_SPEC_KEY,
    DrafterConfig,
    build_target_layer_ids,
    reject_unknown_keys,
    require_keys,
    shape_fields,
    variant_keys,
    variant_of,
)

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  #: z-lab's ``_draft_value(config, "block_size", 16)``
#: Besides ours: the flat z-lab layout (variant keys at the top level), and the dflash_config keys
#: vLLM's rule set reads (``use_swa``) or z-lab-style exporters write (``learned_mask_embedding``).
#: (every head's keys join both: :func:`variant_keys`, read when a config is, so a head
#: registered later counts)
EXTRA_DFLASH_KEYS = frozenset({"use_swa", "learned_mask_embedding"})


def draft_value(config: dict[str, Any], key: str, default: Any = None) -> Any:
    """z-lab's ``_draft_value``: ``dflash_config[key]`` if present (even null), else top level."""
    dfc = config.get("dflash_config") or {}
    return dfc[key] if key in dfc else config.get(key, default)


def block_size(config: dict[str, Any]) -> int:
    """The drafter's block size B as z-lab reads it (a null or non-integer value is an error)."""
    value = draft_value(config, "block_size", DEFAULT_BLOCK_SIZE)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"block_size={value!r} is not an integer; z-lab's loader reads "
                         "dflash_config.block_size, then the top-level block_size (default 16)")
    return value


def _variant_fields(d: dict[str, Any], dfc: dict[str, Any], source: str) -> dict[str, Any]:
    fields: dict[str, Any] = {"variant": variant_of(d, dfc, source)}
    for key in variant_keys():
        value = draft_value(d, key)
        if value is not None:
            fields[key] = value
    heads.get(fields["variant"]).check_read(fields, source)  # the keys its owners need
    cap = fields.get("final_logit_softcapping")
    if isinstance(cap, int | float) and not isinstance(cap, bool) and cap <= 0:
        fields["final_logit_softcapping"] = None
    return fields


def _target_layer_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    ids = draft_value(d, "target_layer_ids")
    num = d.get("num_target_layers")
    if num is None:
        if ids is None:
            raise ValueError(f"{source}: needs num_target_layers or dflash_config.target_layer_ids")
        num = max(ids) + 1
        log.warning("%s: num_target_layers missing; assuming %d (max target id + 1)", source, num)
    if ids is None:
        ids = build_target_layer_ids(num, int(d["num_hidden_layers"]))
    return {"num_target_layers": num, "target_layer_ids": ids}


def base_config(d: dict[str, Any], source: str) -> DrafterConfig:
    """The drafter fields of a third-party config.json on a placeholder layout (all layers full,
    legacy causality, no learned mask embedding: they depend on the engine, so callers replace
    them with a rule set's reading before use). A recorded training spec is ignored (the caller
    chose to resolve the layout with a rule set)."""
    d = {k: v for k, v in d.items() if k != TRAINING_SPEC_KEY}
    dfc = dict(d.get("dflash_config") or {})
    require_keys(d, dfc, source)
    heads_keys = frozenset(variant_keys())
    reject_unknown_keys(set(d), OUR_TOP_KEYS | heads_keys | HF_BOOKKEEPING_KEYS, "", source)
    reject_unknown_keys(set(dfc), CORE_DFLASH_KEYS | EXTRA_DFLASH_KEYS | heads_keys,
                        "dflash_config.", source)
    fields = shape_fields(d, source)
    fields.update(_variant_fields(d, dfc, source))
    fields.update(_target_layer_fields(d, source))
    try:
        fields["block_size"] = block_size(d)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from err
    fields["mask_token_id"] = dfc["mask_token_id"]
    fields["attention_sink_bias"] = bool(dfc.get("attention_sink_bias", False))
    # vLLM's key (absent = false; its speculators converter copies speculators' value here)
    fields["sample_from_anchor"] = bool(dfc.get("sample_from_anchor", False))
    if d.get("draft_vocab_size") is not None:  # vLLM sizes the draft head and d2t from it
        fields["draft_vocab_size"] = d["draft_vocab_size"]
    if d.get("target_hidden_size"):  # vLLM sizes fc from it (engines/streams.py)
        fields["target_hidden_size"] = d["target_hidden_size"]
    return DrafterConfig.create(source=source, **fields)
