"""Load what the exporter reads: a Lightning checkpoint, a training run directory, or a serving
directory (ours, or a third-party z-lab style one, whose implicit causality is resolved by an
engine rule set that is recorded).

Checkpoints are opened with ``torch.load(weights_only=True)`` only: an export must never execute
code hidden in a pickle.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dflash_lab.export.engines import Artifacts, EngineReading, get_rule_set, read_all
from dflash_lab.export.engines.common import layouts_agree
from dflash_lab.export.engines.laguna import is_laguna
from dflash_lab.export.engines.laguna import our_names as laguna_our_names
from dflash_lab.export.engines.muse import is_muse, our_names, owners_window_note
from dflash_lab.export.engines.zlab import base_config
from dflash_lab.export.integrity import checked
from dflash_lab.export.laguna import base_config as laguna_base_config
from dflash_lab.export.laguna import format_notes as laguna_format_notes
from dflash_lab.export.muse_glimmer import base_config as muse_base_config
from dflash_lab.export.muse_glimmer import format_notes as muse_format_notes
from dflash_lab.export.peers import (
    is_speculators_dir,
    load_specforge_checkpoint,
    load_speculators_dir,
    specforge_state_file,
)
from dflash_lab.export.weights import (
    CONFIG_FILE,
    MASK_FILE,
    MASK_KEY,
    SINK_SUFFIX,
    SUFFIXED_CODEBOOKS,
    WEIGHTS_FILE,
    Source,
    has_weights,
    load_mask_file,
    load_weights,
    plain_key,
    serving_names,
    validate_state_dict,
    weight_names,
)
from dflash_lab.model.config import (
    FULL,
    SLIDING,
    TARGET_IDENTITY_KEY,
    TRAINING_SPEC_KEY,
    DrafterConfig,
)

DRAFTER_PREFIX = "drafter."
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


# ---------------------------------------------------------------------------- checkpoints
def load_checkpoint(path: Path) -> Source:
    """A Lightning ``.ckpt``: ``state_dict`` keys prefixed ``drafter.`` and
    ``hyper_parameters["drafter_config"]`` = ``DrafterConfig.to_dict()``. A checkpoint whose
    ``.sha256`` sidecar (written by training) does not match is refused."""
    from dflash_lab.checksums import checksum_problem

    if problem := checksum_problem(Path(path)):
        raise ValueError(f"{path}: {problem}; export another checkpoint of the run")
    if not zipfile.is_zipfile(path):  # what torch.save writes (a config.yaml, a log, ...)
        run = Path(path).parent
        hint = (f"the run directory {run} (its best checkpoint)" if (run / "checkpoints").is_dir()
                else "a training run directory (it holds checkpoints/)")
        raise ValueError(f"{path} is a file but not a checkpoint (torch.save writes a zip "
                         f"archive): pass a .ckpt file, {hint}, or a serving directory")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{path}: cannot be loaded with torch.load(weights_only=True): {err}. The checkpoint "
            "holds Python objects besides tensors and plain containers; save "
            "hyper_parameters['drafter_config'] as DrafterConfig.to_dict() (a plain dict). "
            "The exporter never unpickles arbitrary objects.") from err
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path}: not a Lightning checkpoint (no 'state_dict')")
    cfg = (ckpt.get("hyper_parameters") or {}).get("drafter_config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: hyper_parameters['drafter_config'] is missing or not a dict; "
                         "the training module must save DrafterConfig.to_dict() there")
    config = DrafterConfig.from_dict(cfg, source=f"{path}:hyper_parameters.drafter_config")
    state = {plain_key(k[len(DRAFTER_PREFIX):]): v for k, v in ckpt["state_dict"].items()
             if k.startswith(DRAFTER_PREFIX)}
    if not state:
        raise ValueError(f"{path}: no '{DRAFTER_PREFIX}*' tensors in state_dict")
    identity = ckpt.get("dflash_target")
    return Source(config, state, "checkpoint", f"checkpoint {path}", reads=[path],
                  target_identity=identity if isinstance(identity, dict) else None)


def resolve_run_dir(run: Path) -> tuple[Path, str]:
    """The run's best checkpoint (``checkpoints/best.json``), else ``last.ckpt`` with a warning."""
    ckdir = run / "checkpoints"
    best = ckdir / "best.json"
    if best.exists():
        data = json.loads(best.read_text())
        path = Path(data["path"])
        path = path if path.is_absolute() else run / path
        if not path.exists():
            raise ValueError(f"{best}: points to {path}, which does not exist")
        return path, f"best checkpoint (val/tau={data.get('val/tau')})"
    last = ckdir / "last.ckpt"
    if not last.exists():
        found = sorted(p.name for p in ckdir.glob("*.ckpt"))
        raise ValueError(f"{run}: no checkpoints/best.json and no checkpoints/last.ckpt "
                         f"(found {found}); pass the .ckpt file itself")
    _warn(f"{best} is missing; exporting {last} instead of the best checkpoint")
    return last, "last checkpoint (no best.json)"


# ---------------------------------------------------------------------------- serving dirs
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


def third_party_base(d: dict[str, Any], source: str) -> DrafterConfig:
    """The fields of a third-party config.json on a placeholder layout: z-lab's reading, or
    the Muse Glimmer format's (export/muse_glimmer.py), or the Laguna format's
    (export/laguna.py)."""
    if is_laguna(d):
        return laguna_base_config(d, source)
    return muse_base_config(d, source) if is_muse(d) else base_config(d, source)


def with_target_vocab(config: DrafterConfig, vocab_size: int | None,
                      recorded: bool) -> DrafterConfig:
    """``config`` with the target's vocabulary when its format records none (Muse Glimmer);
    unchanged when it records one or no target is known."""
    if recorded or vocab_size is None or vocab_size == config.vocab_size:
        return config
    return dataclasses.replace(config, vocab_size=int(vocab_size))


def resolve_third_party(d: dict[str, Any], path: Path, artifacts: Artifacts,
                        assume: str) -> tuple[DrafterConfig, list[str]]:
    """A third-party config.json as rule set ``assume`` runs it (z-lab's reading for every other
    field), and the rule sets that read it differently; ``--inspect`` resolves it the same way."""
    rule_set = get_rule_set(assume)
    # the import renames z-lab's '.weight' codebooks, so no rule set should refuse over them;
    # the layout does not depend on fc's width (target_hidden_size: engines/streams.py refuses
    # the flattened streams at export and --inspect, not at import)
    layout_only = {k: v for k, v in d.items() if k != "target_hidden_size"}
    readings = read_all(layout_only, dataclasses.replace(artifacts, suffixed_codebooks=False))
    reading = readings[rule_set.name]
    if not reading.loads:
        raise ValueError(f"{path}: {rule_set.name} {reading.refusal}; pass another assumed "
                         "rule set (assume=...)")
    base = third_party_base(d, str(path / CONFIG_FILE))
    is_vllm = rule_set.engine == "vllm"
    config = config_from_reading(
        base, reading,
        keeps_mask=artifacts.mask_embedding_file and (is_vllm or reading.serves_learned_mask),
        keeps_sinks=base.attention_sink_bias and (is_vllm or reading.serves_sinks))
    return config, _disagreements(readings, rule_set.name, base.block_size)


def import_drafter(path: str | Path, assume: str | None = None,
                   verify: bool = True) -> ImportedDrafter:
    """Read a serving directory into our config + weights.

    ``verify``: check the files against the export's ``SHA256SUMS`` first (ValueError naming a
    file that differs; a directory without the record is read and says so in ``integrity``).

    Our own exports carry the exact training spec and use it. Third-party (z-lab style)
    directories leave causality implicit: it is resolved by ``assume`` (default
    ``vllm-main-v2``), the name is recorded in ``assumed_rules`` and in ``config._source``, and
    rule sets that would read the directory differently are listed in ``disagreements``.
    A Muse Glimmer directory (export/muse_glimmer.py) is read the same way, its tensors renamed
    to ours and what its format does not record listed in ``format_notes``. Everything else
    (variant, conv, selector, the three scales) is read as z-lab's loader reads it; DFlash 2
    codebooks saved as ``...codebook.weight`` (z-lab ``save_pretrained``) are renamed to the
    serving names (listed in ``disagreements``: engines would not load them).
    """
    path = Path(path)
    integrity = checked(path, verify).note
    d = read_config_json(path)
    artifacts = artifacts_of(path)
    if TRAINING_SPEC_KEY in d and assume is None:
        config = DrafterConfig.from_dict(d, source=str(path / CONFIG_FILE))
        assumed, disagree = OUR_SPEC, []
    else:
        assumed = assume or DEFAULT_ASSUMED_RULES
        config, disagree = resolve_third_party(d, path, artifacts, assumed)
    state, renamed = serving_names(load_weights(path))
    muse = is_muse(d) and TRAINING_SPEC_KEY not in d
    laguna = is_laguna(d) and TRAINING_SPEC_KEY not in d
    if muse:  # encoder.fc / encoder.output_norm_enc -> fc / hidden_norm
        state = our_names(state)
    if laguna:  # fused qkv_proj -> q/k/v
        state = laguna_our_names(state, d)
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
    notes = tuple(muse_format_notes(d)) if muse else \
        tuple(laguna_format_notes(d)) if laguna else ()
    return ImportedDrafter(config, state, mask, assumed, disagree, integrity,
                           vocab_recorded="vocab_size" in d, format_notes=notes)


def load_serving_dir(path: str | Path, assume: str | None = None, verify: bool = True
                     ) -> tuple[DrafterConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """``(config, state_dict, mask_embedding or None)`` of a serving directory."""
    imported = import_drafter(path, assume, verify)
    return imported.config, imported.state_dict, imported.mask_embedding


def is_serving_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and has_weights(path)


def load_source(path: str | Path, verify: bool = True) -> Source:
    """Dispatch on what SOURCE is: a .ckpt file, a serving directory (ours or z-lab's), a
    training run dir, a speculators directory or a SpecForge checkpoint (export/peers.py).
    ``verify``: a serving directory is checked against its ``SHA256SUMS``
    (:func:`import_drafter`)."""
    path = Path(path)
    if (state_file := specforge_state_file(path)) is not None:
        return load_specforge_checkpoint(state_file)
    if path.is_file():
        return load_checkpoint(path)
    if is_speculators_dir(path):
        return load_speculators_dir(path, verify)
    if is_serving_dir(path):
        imported = import_drafter(path, verify=verify)
        notes = ([f"causality resolved by {imported.assumed_rules}"] + imported.disagreements
                 + list(imported.format_notes) + [imported.integrity])
        d = read_config_json(path)
        identity = d.get(TARGET_IDENTITY_KEY)  # our exports record the training target
        muse_window = owners_window_note(d) if is_muse(d) else None
        kind = "Muse Glimmer directory" if is_muse(d) else \
            "Laguna directory" if is_laguna(d) else "serving directory"
        return Source(imported.config, imported.state_dict, "serving", f"{kind} {path}", notes,
                      reads=[path],
                      target_identity=identity if isinstance(identity, dict) else None,
                      depth_recorded="num_target_layers" in d,
                      mask_differences=[muse_window] if muse_window else [],
                      vocab_recorded=imported.vocab_recorded)
    if (path / "checkpoints").is_dir():
        ckpt, why = resolve_run_dir(path)
        source = load_checkpoint(ckpt)
        source.description = f"{why} {ckpt} of run {path}"
        source.reads.append(path)
        return source
    raise ValueError(f"{path}: not a .ckpt file, a serving directory (config.json + "
                     f"{WEIGHTS_FILE}), a training run directory (checkpoints/), a speculators "
                     "directory or a SpecForge checkpoint (training_state.pt)")
