"""Reading a serving directory (config.json + model.safetensors), shared by the formats that
are one: ours, z-lab's, Muse Glimmer's and Laguna's (export/formats/). Which format a directory
is, and what differs per format, is the registry's (export/formats/__init__.py); a third-party
directory's implicit causality is resolved by an engine rule set that is recorded.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dflash_lab.export.engines import Artifacts, EngineReading, get_rule_set
from dflash_lab.export.engines.common import layouts_agree
from dflash_lab.export.integrity import checked
from dflash_lab.export.weights import (
    CONFIG_FILE,
    MASK_FILE,
    MASK_KEY,
    SINK_SUFFIX,
    SUFFIXED_CODEBOOKS,
    Source,
    has_weights,
    load_mask_file,
    load_weights,
    serving_names,
    validate_state_dict,
    weight_names,
)
from dflash_lab.model.config import FULL, SLIDING, TARGET_IDENTITY_KEY, DrafterConfig

#: an export/formats Format: the formats call these readers with themselves (sources.py sits
#: below them, so it names no Format class)
Format = Any
#: Rule set assumed for a third-party directory: the reader that honours every feature.
DEFAULT_ASSUMED_RULES = "vllm-main-v2"
OUR_SPEC = "dflash_lab training spec"


class ImportedDrafter(NamedTuple):
    """A serving directory read back: what was assumed to resolve it, and who disagrees."""

    config: DrafterConfig
    state_dict: dict[str, torch.Tensor]  #: includes ``mask_embedding`` when one was shipped
    mask_embedding: torch.Tensor | None
    assumed_rules: str  #: OUR_SPEC, or the engine rule set that resolved implicit causality
    disagreements: list[str]  #: rule sets reading a layer differently from the assumption
    integrity: str = ""  #: what its SHA256SUMS check found (export/integrity.py)
    vocab_recorded: bool = True  #: False: ``config.vocab_size`` is a placeholder (Muse Glimmer)
    format_notes: tuple[str, ...] = ()  #: what the import assumed the format does not record


def _warn(msg: str) -> None:
    print(f"dflash-export: warning: {msg}", file=sys.stderr)


def mask_file_form(file: Path) -> str:
    """How ``mask_embedding.pt`` is stored: "dict" (``{embedding, mask_token_id}``, what we write),
    "per_position" (that dict with ``per_position`` true), "no_token_id" or "tensor" (a bare
    tensor, which vLLM also accepts); "absent" when there is no file."""
    if not file.exists():
        return "absent"
    data = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        return "tensor"
    if data.get("per_position"):
        return "per_position"
    return "dict" if "mask_token_id" in data else "no_token_id"


def artifacts_of(path: Path) -> Artifacts:
    names = weight_names(path)
    return Artifacts(mask_embedding_file=(path / MASK_FILE).exists(),
                     mask_file_form=mask_file_form(path / MASK_FILE),
                     sink_weights=any(n.endswith(SINK_SUFFIX) for n in names),
                     suffixed_codebooks=any(n in SUFFIXED_CODEBOOKS for n in names))


def read_config_json(path: Path) -> dict[str, Any]:
    """DIR/config.json as a dict, refused in one line when it is no drafter config: a JSON
    object with at least ``num_hidden_layers`` (every engine's reader starts from it), at the
    top or, in the speculators layout (DSpark), in ``transformer_layer_config``."""
    file = path / CONFIG_FILE
    try:
        d = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: cannot read the drafter config ({err})") from err
    layers = d.get("transformer_layer_config", d) if isinstance(d, dict) else None
    if not isinstance(layers, dict) or "num_hidden_layers" not in layers:
        got = (f"a JSON object without num_hidden_layers (keys: {sorted(d)[:8]})"
               if isinstance(d, dict) else f"a JSON {type(d).__name__}, not an object")
        raise ValueError(f"{file} is not a drafter config: it holds {got}; a drafter config "
                         "is the config.json of a serving directory (dflash-export OUT_DIR), "
                         "a JSON object with hidden_size, num_hidden_layers, "
                         "num_attention_heads, vocab_size and dflash_config")
    return d


def config_from_reading(base: DrafterConfig, reading: EngineReading,
                        keeps_mask: bool, keeps_sinks: bool) -> DrafterConfig:
    """``base`` with its layer layout and features replaced by what one engine would run."""
    layers = reading.layers or []
    windows = {r.window for r in layers if r.window is not None}
    flags = [r.causal for r in layers]
    return dataclasses.replace(
        base,
        layer_types=[FULL if r.window is None else SLIDING for r in layers],
        sliding_window=windows.pop() if windows else None,
        is_causal=flags[0] if len(set(flags)) == 1 else flags,
        learned_mask_embedding=keeps_mask,
        attention_sink_bias=keeps_sinks,
        _source=f"{base._source} (causality resolved by {reading.rule_set})",
    )


def _disagreements(readings: dict[str, EngineReading], chosen: str,
                   block_size: int) -> list[str]:
    ref = readings[chosen].layers
    return [f"{name}: {'refuses to load' if r.layers is None else 'reads it differently'}"
            for name, r in readings.items()
            if name != chosen and not layouts_agree(r.layers, ref, block_size)]


def with_target_vocab(config: DrafterConfig, vocab_size: int | None,
                      recorded: bool) -> DrafterConfig:
    """``config`` with the target's vocabulary when its format records none (Muse Glimmer);
    unchanged when it records one or no target is known."""
    if recorded or vocab_size is None or vocab_size == config.vocab_size:
        return config
    return dataclasses.replace(config, vocab_size=int(vocab_size))


def resolve_third_party(d: dict[str, Any], path: Path, artifacts: Artifacts,
                        assume: str | None, fmt: Format) -> tuple[DrafterConfig, list[str]]:
    """A third-party config.json of format ``fmt`` as rule set ``assume`` (default
    :data:`DEFAULT_ASSUMED_RULES`) runs it (the format's reading for every other field), and the
    rule sets that read it differently; ``--inspect`` resolves it the same way."""
    rule_set = get_rule_set(assume or DEFAULT_ASSUMED_RULES)
    # the import renames z-lab's '.weight' codebooks, so no rule set should refuse over them;
    # the layout does not depend on fc's width (target_hidden_size: engines/streams.py refuses
    # the flattened streams at export and --inspect, not at import)
    layout_only = {k: v for k, v in d.items() if k != "target_hidden_size"}
    readings = fmt.read_all(layout_only, dataclasses.replace(artifacts, suffixed_codebooks=False))
    reading = readings[rule_set.name]
    if not reading.loads:
        raise ValueError(f"{path}: {rule_set.name} {reading.refusal}; pass another assumed "
                         "rule set (assume=...)")
    base = fmt.base_config(d, str(path / CONFIG_FILE))
    is_vllm = rule_set.engine == "vllm"
    config = config_from_reading(
        base, reading,
        keeps_mask=artifacts.mask_embedding_file and (is_vllm or reading.serves_learned_mask),
        keeps_sinks=base.attention_sink_bias and (is_vllm or reading.serves_sinks))
    return config, _disagreements(readings, rule_set.name, base.block_size)


def import_serving_dir(path: Path, fmt: Format, assume: str | None = None,
                       verify: bool = True) -> ImportedDrafter:
    """Read a serving directory of format ``fmt`` into our config + weights, checked against its
    ``SHA256SUMS`` first when ``verify``. Ours is read exactly unless ``assume`` is given; a
    third-party directory's implicit causality is resolved by ``assume`` (default
    ``vllm-main-v2``), recorded in ``assumed_rules``, and readings that differ go to
    ``disagreements`` (docs/export.md, "Importing third-party directories").
    """
    integrity = checked(path, verify).note
    d = read_config_json(path)
    artifacts = artifacts_of(path)
    if fmt.exact_reading(d) and assume is None:  # ours: the recorded training spec
        config, _ = fmt.read_exact(d, path / CONFIG_FILE)
        assumed, disagree = fmt.exact_reading(d), []
    else:
        assumed = assume or DEFAULT_ASSUMED_RULES
        config, disagree = resolve_third_party(d, path, artifacts, assumed, fmt)
    state, renamed = serving_names(load_weights(path))
    state = fmt.our_names(state, d)
    if renamed:
        disagree = disagree + [f"tensors {renamed} renamed without '.weight' (vLLM refuses "
                               "those names, SGLang skips them)"]
    if not config.attention_sink_bias:
        state = {k: v for k, v in state.items() if not k.endswith(SINK_SUFFIX)}
    mask = load_mask_file(path, config.mask_token_id) if config.learned_mask_embedding else None
    if mask is not None:
        state[MASK_KEY] = mask
    validate_state_dict({k: v for k, v in state.items() if k != MASK_KEY}, config, str(path))
    if disagree:
        _warn(f"{path}: read with {assumed}; " + "; ".join(disagree))
    return ImportedDrafter(config, state, mask, assumed, disagree, integrity,
                           vocab_recorded="vocab_size" in d,
                           format_notes=tuple(fmt.format_notes(d)))


def is_serving_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and has_weights(path)


def serving_source(path: Path, fmt: Format, verify: bool = True,
                   assume: str | None = None) -> Source:
    """A serving directory of format ``fmt`` as an export Source (:func:`import_serving_dir`;
    ``assume``: the rule set resolving its layout, default ours exactly, else vllm-main-v2)."""
    imported = import_serving_dir(path, fmt, assume, verify)
    notes = ([f"causality resolved by {imported.assumed_rules}"] + imported.disagreements
             + list(imported.format_notes) + [imported.integrity])
    d = read_config_json(path)
    identity = d.get(TARGET_IDENTITY_KEY)  # our exports record the training target
    return Source(imported.config, imported.state_dict, "serving", f"{fmt.kind} {path}", notes,
                  reads=[path], target_identity=identity if isinstance(identity, dict) else None,
                  depth_recorded="num_target_layers" in d,
                  mask_differences=fmt.mask_differences(d),
                  vocab_recorded=imported.vocab_recorded)
