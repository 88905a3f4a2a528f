"""``drafter.init_from=PATH``: start training from a trained drafter of any format we read
(``dflash_lab.export.formats.load_source``). The config comes from the source, Hydra-set drafter
fields override it (warning when the weights would compute otherwise, ValueError when shapes
change); another target depth (:func:`check_depth`) or other target weights
(:func:`other_target_weights`) are checked; only the weights are taken (docs/warm_start.md).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dflash_lab.export.formats import load_source
from dflash_lab.export.formats.base import with_target_vocab
from dflash_lab.model import heads
from dflash_lab.model.config import DrafterConfig, build_target_layer_ids
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import CONF_DIR
from dflash_lab.targets.features import check_feature_width, check_layer_ids_for_streams
from dflash_lab.targets.mask_token import resolve_mask_token_id
from dflash_lab.targets.shape import target_shape

log = logging.getLogger(__name__)

#: Backbone fields whose change changes the set or shapes of the trained tensors: never
#: overridable (nor a head's or feature's ``weight_fields``: :func:`weight_fields`).
WEIGHT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "vocab_size", "attention_bias",
                 "learned_mask_embedding", "attention_sink_bias", "variant", "target_hidden_size")


def weight_fields() -> set[str]:
    """Every field a warm start may not override: the backbone's and every head's."""
    return {*WEIGHT_FIELDS, *(f for part in (*heads.heads(), *heads.features())
                              for f in part.weight_fields)}
#: Hydra keys of conf/drafter that are no DrafterConfig field.
NOT_FIELDS = ("_target_", "backend", "init_from", "verify_checksums", "defaults")


def group_defaults(variant: str | None) -> dict[str, Any]:
    """The drafter fields as ``conf/drafter/default.yaml`` (+ the head's own option,
    ``conf/drafter/<variant>.yaml``, where it has one) set them."""
    merged = OmegaConf.load(CONF_DIR / "drafter" / "default.yaml")
    option = CONF_DIR / "drafter" / f"{variant}.yaml"
    if variant and option.is_file():
        merged = OmegaConf.merge(merged, OmegaConf.load(option))
    out = OmegaConf.to_container(merged, resolve=True)
    return {k: v for k, v in out.items() if k not in NOT_FIELDS}


def explicit_overrides(fields: dict[str, Any]) -> dict[str, Any]:
    """The drafter fields a recipe or the command line set, out of everything Hydra composed
    (``drafter.KEY`` on the Hydra command line counts even at its default value)."""
    from hydra.core.hydra_config import HydraConfig

    defaults = group_defaults(fields.get("variant"))
    given = set()
    if HydraConfig.initialized():
        keys = (o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task)
        given = {k.removeprefix("drafter.") for k in keys if k.startswith("drafter.")}
    return {k: v for k, v in fields.items()
            if k not in NOT_FIELDS and (v != defaults.get(k) or k in given)}


def contradictions(old: DrafterConfig, new: DrafterConfig) -> list[str]:
    """What ``new`` runs differently from the ``old`` config the weights were trained with."""
    out = []
    for i, (a, b) in enumerate(zip(old.layer_specs(), new.layer_specs(), strict=True)):
        if (a.window is None) != (b.window is None):
            out.append(f"layer {i}: {'sliding' if a.window else 'full'} -> "
                       f"{'sliding' if b.window else 'full'}")
        elif a.window != b.window:
            out.append(f"layer {i}: window {a.window} -> {b.window}")
        if a.causal != b.causal:
            out.append(f"layer {i}: {'causal' if a.causal else 'bidirectional'} -> "
                       f"{'causal' if b.causal else 'bidirectional'}")
    for key in ("block_size", "target_layer_ids", "mask_token_id", "rope_theta", "rope_scaling",
                "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                "selector_top_k", "rms_norm_eps", "sample_from_anchor", "context_input_norm",
                "partial_rotary_factor"):
        if getattr(old, key) != getattr(new, key):
            out.append(f"{key} {getattr(old, key)} -> {getattr(new, key)}")
    return out


def check_target(config: DrafterConfig, shape: dict[str, Any], where: str, name: str) -> None:
    """ValueError when the source was trained for another target (hidden or vocab size)."""
    bad = [f"{k}={getattr(config, k)} but the target has {k}={shape[k]}"
           for k in ("hidden_size", "vocab_size") if getattr(config, k) != shape.get(k)]
    if bad:
        raise ValueError(f"drafter.init_from={where}: the drafter was trained for another "
                         f"target ({'; '.join(bad)}; target {name}); pass the target it was "
                         "trained for, or train a fresh drafter (drafter.init_from=null)")


def check_depth(source, depth: int, overrides: dict[str, Any], where: str) -> list[str]:
    """ValueError when the source's recorded target depth differs and its layer ids are kept (they
    would name other layers than ``fc`` learned); the change, for the contradiction warning, when
    ``target_layer_ids`` is overridden. Depth-less sources (speculators) are not compared."""
    old = source.config.num_target_layers
    if not source.depth_recorded or old == depth:
        return []
    if "target_layer_ids" not in overrides:
        raise ValueError(
            f"drafter.init_from={where}: the drafter was trained for a target of {old} layers "
            f"(num_target_layers={old}) but the loaded target has {depth}: its target_layer_ids "
            f"{source.config.target_layer_ids} name other layers here (another target). Pass "
            "the target it was trained for, or choose this target's layers with "
            "drafter.target_layer_ids=[...] (or a count to spread them), reported as a "
            "contradiction")
    return [f"num_target_layers {old} -> {depth}"]


def other_target_weights(source, target, where: str) -> None:
    """Warn when the source's checkpoint recorded a target weights fingerprint other than the
    loaded target's (same shapes, other values: a fine-tune). Legitimate for a warm start, so not
    refused; step 0 then validates below the source's own tau. Ours record it; peers' do not."""
    recorded = (source.target_identity or {}).get("weights_fingerprint")
    if not recorded:
        return
    have = target.weights_fingerprint()
    if have and have != recorded:
        log.warning("drafter.init_from=%s was trained on target weights with fingerprint %s; "
                    "the loaded target %s has %s (same shapes, other values, e.g. a fine-tune): "
                    "the warm start adapts the drafter to these weights", where, recorded,
                    target.name_or_path, have)


def merged_config(source: DrafterConfig, overrides: dict[str, Any], num_target_layers: int,
                  where: str) -> DrafterConfig:
    """The source config with the overrides and the loaded target's depth applied."""
    refused = [f"{k}={v!r} (trained with {getattr(source, k)!r})" for k, v in overrides.items()
               if k in weight_fields() and v != getattr(source, k)]
    if refused:
        raise ValueError(f"drafter.init_from={where}: {', '.join(refused)} would change the "
                         "trained tensors' shapes; drop these drafter overrides")
    fields = {k: v for k, v in overrides.items() if k not in weight_fields()}
    if isinstance(fields.get("target_layer_ids"), int):
        fields["target_layer_ids"] = build_target_layer_ids(num_target_layers,
                                                            fields["target_layer_ids"])
    return dataclasses.replace(source, num_target_layers=num_target_layers, **fields,
                               _source=f"{where} (drafter.init_from)")


def warm_started_drafter(target, init_from: str, backend: str, fields: dict[str, Any],
                         verify_checksums: bool = True) -> DFlashDrafter:
    """A drafter holding the weights of ``init_from`` for the loaded ``target`` (an export is
    checked against its ``SHA256SUMS`` unless ``verify_checksums`` is off)."""

    where = str(init_from)
    if not Path(where).exists():
        raise ValueError(f"drafter.init_from={where} does not exist; pass one of our .ckpt "
                         "files, run or export directories, a z-lab, speculators or SpecForge "
                         "drafter (docs/warm_start.md)")
    source = load_source(where, verify_checksums)
    shape = target_shape(target.model.config)
    source = dataclasses.replace(source, config=with_target_vocab(  # Muse Glimmer records none
        source.config, shape["vocab_size"], source.vocab_recorded))
    check_target(source.config, shape, where, str(target.name_or_path))
    overrides, depth = explicit_overrides(fields), int(shape["num_target_layers"])
    changed = check_depth(source, depth, overrides, where)
    config = merged_config(source.config, overrides, depth, where)
    # fc's width must be one the loaded target gives (H; a multi-stream target also n*H)
    check_feature_width(target.model.config, config.target_hidden_size,
                        f"{where}: target_hidden_size")
    check_layer_ids_for_streams(target.model.config, config.target_layer_ids)
    resolve_mask_token_id(target.tokenizer, config.mask_token_id, vocab_size=config.vocab_size,
                          where=str(target.name_or_path))
    other_target_weights(source, target, where)
    changed += contradictions(source.config, config)
    if changed := changed + source.mask_differences:
        log.warning("drafter.init_from=%s: this run contradicts how the weights were trained: %s",
                    where, "; ".join(changed))
    drafter = DFlashDrafter(config, backend=backend)
    drafter.load_state_dict(source.state_dict, strict=True)
    drafter.warm_started = True  # keep the trained mask embedding (module init would reset it)
    log.info("drafter weights from %s (%s); optimizer state starts fresh", source.description,
             "; ".join(source.notes) or "no notes")
    return drafter
