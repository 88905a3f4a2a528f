"""Build a drafter for a LOADED target (the ``drafter`` group's Hydra ``_target_``, a partial
called with ``target=``): fields left out or null that the target defines (shape, RoPE, max
positions) are copied from its (text) config, the MASK id taken from the target too; nothing
here reads files by path. It lives in train/ so that model/ imports only torch (docs/training.md,
"Config groups and targets").
"""

from __future__ import annotations

import logging
from typing import Any

from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.targets.features import check_feature_width, check_layer_ids_for_streams
from dflash_lab.targets.mask_token import resolve_mask_token_id
from dflash_lab.targets.shape import target_shape
from dflash_lab.train.warm_start import warm_started_drafter

log = logging.getLogger(__name__)

def drafter_config_for_target(target, **fields: Any) -> DrafterConfig:
    """DrafterConfig with unset shape fields copied from a loaded ``target`` (``model.config``,
    ``tokenizer``, ``name_or_path``). ``mask_token_id`` null: the tokenizer's mask token; an
    explicit one is checked against the tokenizer (:func:`resolve_mask_token_id`)."""
    fields = {k: v for k, v in fields.items() if v is not None}
    for key, value in target_shape(target.model.config).items():
        fields.setdefault(key, value)
    fields["mask_token_id"] = resolve_mask_token_id(
        target.tokenizer, fields.get("mask_token_id"), vocab_size=int(fields["vocab_size"]),
        where=str(target.name_or_path))
    # a multi-stream target gives two widths per layer (stream mean = H, flattened = n*H)
    fields["target_hidden_size"] = check_feature_width(
        target.model.config, fields.get("target_hidden_size"), "drafter.target_hidden_size")
    config = DrafterConfig.create(source=f"drafter config for target {target.name_or_path}",
                                  **fields)
    check_layer_ids_for_streams(target.model.config, config.target_layer_ids)
    return config


def build_drafter(target, backend: str = "auto", init_from: str | None = None,
                  verify_checksums: bool = True, **fields: Any) -> DFlashDrafter:
    """A freshly initialised drafter for a loaded target (Hydra entry of conf/drafter/*.yaml),
    or, with ``init_from``, one holding a trained drafter's weights (train/warm_start.py;
    ``verify_checksums``: an export's SHA256SUMS is checked first)."""
    if init_from is not None:
        return warm_started_drafter(target, str(init_from), backend, fields,
                                    bool(verify_checksums))
    config = drafter_config_for_target(target, **fields)
    log.info("drafter layers: %s", config.layer_specs())
    return DFlashDrafter(config, backend=backend)


#: the ``drafter.*`` keys its ``**fields`` take, checked at start-up (entry.check_group_keys)
build_drafter.keyword_fields = DrafterConfig.field_names
