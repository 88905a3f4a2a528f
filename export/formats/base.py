"""The Format interface, its default serving-directory reader and the registry
(docs/architecture.md, "Add a format", "Loading a drafter for eval"): what depends on a file's
format is a :class:`Format` method callers reach through the registry (filled in match order by
formats/__init__.py), never a branch on a format or variant; :func:`lost_fields` finds what a
writable format cannot carry (write, detect, read back, name every changed field).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dflash_lab.export.engines import ENGINES, RuleSet, anchor, get_rule_set, rule_sets_for
from dflash_lab.export.engines.common import Artifacts, EngineReading, layouts_agree
from dflash_lab.export.weights import (
    CONFIG_FILE,
    MASK_FILE,
    MASK_KEY,
    SINK_SUFFIX,
    SUFFIXED_CODEBOOKS,
    WEIGHTS_FILE,
    Source,
    checked,
    has_weights,
    load_mask_file,
    load_weights,
    serving_names,
    validate_state_dict,
    weight_shapes,
)
from dflash_lab.model.config import (
    DSPARK,
    FULL,
    SLIDING,
    TARGET_IDENTITY_KEY,
    DrafterConfig,
)

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
    integrity: str = ""  #: what its SHA256SUMS check found (weights.py ``checked``)
    vocab_recorded: bool = True  #: False: ``config.vocab_size`` is a placeholder (Muse Glimmer)
    format_notes: tuple[str, ...] = ()  #: what the import assumed the format does not record


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
    names = weight_shapes(path)
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


def config_from_reading(base: DrafterConfig, reading: EngineReading, rule_set: RuleSet,
                        artifacts: Artifacts) -> DrafterConfig:
    """``base`` with its layer layout and features replaced by what one engine would run (a
    shipped mask embedding and sinks: vLLM runs them, SGLang where ``reading`` serves them)."""
    is_vllm = rule_set.engine == "vllm"
    layers = reading.layers or []
    windows = {r.window for r in layers if r.window is not None}
    flags = [r.causal for r in layers]
    return dataclasses.replace(
        base,
        layer_types=[FULL if r.window is None else SLIDING for r in layers],
        sliding_window=windows.pop() if windows else None,
        is_causal=flags[0] if len(set(flags)) == 1 else flags,
        learned_mask_embedding=artifacts.mask_embedding_file and (
            is_vllm or reading.serves_learned_mask),
        attention_sink_bias=base.attention_sink_bias and (is_vllm or reading.serves_sinks),
        _source=f"{base._source} (causality resolved by {reading.rule_set})",
    )


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
    disagree = [f"{name}: {'refuses to load' if r.layers is None else 'reads it differently'}"
                for name, r in readings.items() if name != rule_set.name
                and not layouts_agree(r.layers, reading.layers, base.block_size)]
    return config_from_reading(base, reading, rule_set, artifacts), disagree


def import_serving_dir(path: Path, fmt: Format, assume: str | None = None,
                       verify: bool = True) -> ImportedDrafter:
    """Read a serving directory of format ``fmt`` into our config + weights (``SHA256SUMS``
    checked first when ``verify``). Ours is read exactly unless ``assume`` is given; a third
    party's implicit causality is resolved by ``assume`` (default ``vllm-main-v2``), recorded in
    ``assumed_rules``, differing readings in ``disagreements`` (docs/export.md, "Importing
    third-party directories")."""
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
        print(f"dflash-export: warning: {path}: read with {assumed}; " + "; ".join(disagree),
              file=sys.stderr)
    return ImportedDrafter(config, state, mask, assumed, disagree, integrity,
                           vocab_recorded="vocab_size" in d,
                           format_notes=tuple(fmt.format_notes(d)))


def serving_source(path: Path, fmt: Format, verify: bool, assume: str | None) -> Source:
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


# ---------------------------------------------------------------------------- the interface
Tensors = dict[str, Any]  #: tensors, or shapes (``--inspect`` renames shapes the same way)


class Format:
    """One checkpoint format. Subclasses override what differs from our serving layout."""

    name = ""  #: registry key; the ``--format`` value of a writable format
    kind = "serving directory"  #: how a Source read from it is described
    writable = False  #: ``dflash-export --format NAME`` writes it
    option = True  #: a writable format is a ``--format`` value (DSpark: the default's writer)
    fallback = False  #: reads every serving directory no other claims (z-lab): matched last
    #: what to do instead when the format cannot carry a drafter
    fix = "export it in dflash-lab's own format instead (omit --format)"
    #: how the self-check reads the written config.json (None: through transformers' Qwen3Config)
    self_check_how: str | None = None

    # ------------------------------------------------------------------ detect
    def detect(self, raw: dict[str, Any]) -> bool:
        """``raw`` (a config.json dict) is in this format."""
        return False

    def detect_path(self, path: Path) -> bool:
        """``path`` holds this format: by default a serving directory (config.json + weights)
        whose config.json :meth:`detect` claims (ValueError: config.json is no drafter's)."""
        return ((path / CONFIG_FILE).is_file() and has_weights(path)
                and self.detect(read_config_json(path)))

    # ------------------------------------------------------------------ read
    def load(self, path: Path, verify: bool, assume: str | None = None) -> Source:
        """The drafter at ``path`` (config, our tensor names) as an export Source; by default a
        serving directory read by :func:`serving_source` with this format's hooks below
        (``assume``: the rule set resolving its layout; other formats ignore it)."""
        return serving_source(path, self, verify, assume)

    def base_config(self, raw: dict[str, Any], source: str) -> DrafterConfig:
        """Every field of a third-party config.json on a placeholder layout (the layout is then
        one engine rule set's reading: :func:`resolve_third_party`)."""
        raise ValueError(f"{source}: the {self.name} format has no config.json reader")

    def our_names(self, state: Tensors, raw: dict[str, Any]) -> Tensors:
        """The format's tensor names -> ours."""
        return state

    def format_notes(self, raw: dict[str, Any]) -> list[str]:
        """What the import assumed because the format does not record it."""
        return []

    def mask_differences(self, raw: dict[str, Any]) -> list[str]:
        """Where our mask runs the weights otherwise than the format's owner does."""
        return []

    def exact_reading(self, raw: dict[str, Any]) -> str | None:
        """What ``--inspect`` names the reading of a config.json read exactly, without a rule set
        resolving its layout (ours: the training spec); None: the layout is resolved."""
        return None

    def read_exact(self, raw: dict[str, Any], file: Path) -> tuple[DrafterConfig, list[str]]:
        """The config of a config.json :meth:`exact_reading` names, and notes on it."""
        raise NotImplementedError(f"{self.name} is not read exactly")

    def read_back(self, raw: dict[str, Any], artifacts: Artifacts) -> DrafterConfig:
        """The config the import reads from a config.json this format wrote (the round trip)."""
        if self.exact_reading(raw):
            return self.read_exact(raw, Path("<round trip>"))[0]
        return resolve_third_party(raw, Path("<round trip>"), artifacts, None, self)[0]

    # ------------------------------------------------------------------ write
    def writer_for(self, config: DrafterConfig) -> Format:
        """The format that writes ``config`` when this one is asked for (ValueError: none).
        A DSpark drafter has one serving layout, vLLM's speculators DSpark one."""
        if config.variant == DSPARK:
            raise ValueError(f"{config._source}: a DSpark drafter exports only in vLLM's "
                             "speculators DSpark layout (export/formats/dspark.py), not "
                             f"--format {self.name}")
        return self

    def write_config(self, config: DrafterConfig, dtype: str,
                     target_identity: dict[str, Any] | None, vocab_known: bool
                     ) -> dict[str, Any]:
        """The config.json of ``config`` in this format (:func:`write_config` adds
        ``target_identity``; a writer reads it only for its own keys)."""
        raise ValueError(f"{config._source}: the {self.name} format is read, not written")

    def engine_problems(self, config: DrafterConfig) -> list[str]:
        """What an engine or the format's owner would run differently, each with its reason
        (named beside the round trip's lost fields; empty: nothing to add)."""
        return []

    def serving_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our tensor names -> the format's (what ``model.safetensors`` holds)."""
        return state

    # ------------------------------------------------------------------ engines
    def reading(self, rule_set: RuleSet, raw: dict[str, Any], artifacts: Artifacts
                ) -> EngineReading:
        """How one engine rule set runs a config.json of this format."""
        return anchor.apply(rule_set.read(raw, artifacts), raw)

    def read_all(self, raw: dict[str, Any], artifacts: Artifacts,
                 engines: tuple[str, ...] | list[str] = ENGINES) -> dict[str, EngineReading]:
        """Every selected rule set's reading, keyed by rule-set name."""
        return {r.name: self.reading(r, raw, artifacts) for r in rule_sets_for(engines)}

    def engine_config(self, view: dict[str, Any]) -> dict[str, Any]:
        """The config.json an engine's drafter is built from (the self-check's reader)."""
        return view

    # ------------------------------------------------------------------ text
    def inspect_lines(self, raw: dict[str, Any]) -> list[str]:
        """``--inspect`` lines of a directory in this format."""
        return []

    def report_header(self, raw: dict[str, Any]) -> dict[str, str]:
        """EXPORT_REPORT.md header lines of an export in this format."""
        return {"format": self.name}

    def drafter_lines(self, config: DrafterConfig) -> list[str]:
        """The variant lines of the report's Drafter section, for a drafter it writes."""
        return []


class ReleasedFormat(Format):
    """A released third-party layout (Laguna, Muse Glimmer), detected by ``model_type`` or
    ``architectures``, read through each engine's own config class for it (:meth:`engine_view`)."""

    model_type = ""
    architectures: tuple[str, ...] = ()  #: the first is the one written
    engine_notes: dict[str, str] = {}  #: engine -> how it reads the format
    title = ""  #: the ``--inspect`` notes heading

    def detect(self, raw: dict[str, Any]) -> bool:
        """Its ``model_type``, or one of its ``architectures`` (a file may carry either: vLLM's
        EAGLE config rewrites the architecture name)."""
        archs = raw.get("architectures") or []
        return raw.get("model_type") == self.model_type or any(a in self.architectures
                                                               for a in archs)

    def engine_view(self, raw: dict[str, Any], engine: str) -> dict[str, Any]:
        """config.json as ``engine``'s config class for the format holds it."""
        return raw

    def reading(self, rule_set: RuleSet, raw: dict[str, Any], artifacts: Artifacts
                ) -> EngineReading:
        reading = rule_set.read(self.engine_view(raw, rule_set.engine), artifacts)
        reading.notes.append(self.engine_notes[rule_set.engine]
                             + ("" if rule_set.current else "; assumed for this older release"))
        return reading

    def inspect_lines(self, raw: dict[str, Any]) -> list[str]:
        """:meth:`format_notes`: what the files leave out, and where the format's owner runs it
        otherwise than the engines (notes, not problems: the engines serve it)."""
        notes = self.format_notes(raw)
        return ["", f"{self.title} format notes:"] + [f"- {n}" for n in notes] if notes else []

    def report_header(self, raw: dict[str, Any]) -> dict[str, str]:
        notes = self.format_notes(raw)
        return {"format": f"{self.name} ({self.architectures[0]})",
                **({"format notes": "; ".join(notes)} if notes else {})}


#: the fields that spell the per-layer layout: equal specs (``layer_specs``) are the same
#: layout however they are spelled (an import writes the resolved causality explicitly)
LAYOUT_FIELDS = ("layer_types", "sliding_window", "is_causal")
#: a field without a default, missing from what the import built
_ABSENT = object()


def lost_fields(fmt: Format, config: DrafterConfig) -> list[str]:
    """The dataclass fields of ``config`` (its own class's, so a subclass's extra field counts)
    that do not survive ``fmt``'s write -> :func:`format_of` -> read; a file detected as another
    format loses all that format reads otherwise, one nothing reads loses every field."""
    raw = fmt.write_config(config, "float32", None, vocab_known=True)
    artifacts = Artifacts(mask_embedding_file=config.learned_mask_embedding,
                          sink_weights=config.attention_sink_bias)
    fields = {f.name: _default(f) for f in dataclasses.fields(config)
              if f.compare and f.name != "head_options"}
    fields.update(dict.fromkeys(config.head_options))  # a head's fields, each by name
    try:
        back = format_of(raw).read_back(raw, artifacts)
    except ValueError:
        return list(fields)
    same_layout = back.layer_specs() == config.layer_specs()
    return [name for name, default in fields.items()
            if not (same_layout and name in LAYOUT_FIELDS)
            and getattr(back, name, default) != getattr(config, name)]


def _default(f: dataclasses.Field) -> Any:
    """What a reader without field ``f`` (a subclass's) runs: its default, when it has one."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else _ABSENT


# ---------------------------------------------------------------------------- the registry
#: Every format in match order (filled by export/formats/__init__.py; :func:`register` adds one).
REGISTRY: list[Format] = []


def register(fmt: Format) -> Format:
    """Add ``fmt``, matched before the catch-all z-lab reader (ValueError: its name is taken)."""
    if any(f.name == fmt.name for f in REGISTRY):
        raise ValueError(f"format {fmt.name!r} is registered already")
    REGISTRY.insert(next(i for i, f in enumerate(REGISTRY) if f.fallback), fmt)
    return fmt


def unregister(fmt: Format) -> None:
    """Remove a format :func:`register` added (a test's)."""
    REGISTRY.remove(fmt)


def options() -> tuple[str, ...]:
    """The ``--format`` values: every writable format chosen by name."""
    return tuple(f.name for f in REGISTRY if f.writable and f.option)


def get(name: str) -> Format:
    """The format named ``name`` (ValueError naming the ``--format`` values)."""
    for fmt in REGISTRY:
        if fmt.name == name:
            return fmt
    raise ValueError(f"format '{name}' is not one of {list(options())}")


def format_of(raw: dict[str, Any]) -> Format:
    """The format of a config.json dict (z-lab's when no other claims it)."""
    return next(f for f in REGISTRY if f.detect(raw))


def format_at(path: str | Path) -> Format:
    """The format of what ``path`` holds (ValueError: none of them)."""
    for fmt in REGISTRY:
        if fmt.detect_path(Path(path)):
            return fmt
    raise ValueError(f"{path}: not a .ckpt file, a serving directory (config.json + "
                     f"{WEIGHTS_FILE}), a training run directory (checkpoints/), a speculators "
                     "directory or a SpecForge checkpoint (training_state.pt)")


# ---------------------------------------------------------------------------- read
def load_source(path: str | Path, verify: bool = True, assume: str | None = None) -> Source:
    """The drafter at ``path`` in whatever format it is (:func:`format_at`). ``verify``: a
    serving directory is checked against its ``SHA256SUMS``; ``assume``: the rule set resolving
    a serving directory's layout (default: ours exactly, a third-party one vllm-main-v2)."""
    return format_at(path).load(Path(path), verify, assume)


def import_drafter(path: str | Path, assume: str | None = None,
                   verify: bool = True) -> ImportedDrafter:
    """A serving directory read by :func:`import_serving_dir` (``assume``), its format's hooks."""
    path = Path(path)
    return import_serving_dir(path, format_of(read_config_json(path)), assume, verify)


def load_serving_dir(path: str | Path, assume: str | None = None, verify: bool = True
                     ) -> tuple[DrafterConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """``(config, state_dict, mask_embedding or None)`` of a serving directory."""
    imported = import_drafter(path, assume, verify)
    return imported.config, imported.state_dict, imported.mask_embedding


# ---------------------------------------------------------------------------- engines
def read_all(raw: dict[str, Any], artifacts: Artifacts,
             engines: tuple[str, ...] | list[str] = ENGINES) -> dict[str, EngineReading]:
    """Every selected rule set's reading of one config.json by name (:meth:`Format.read_all`)."""
    return format_of(raw).read_all(raw, artifacts, engines)


# ---------------------------------------------------------------------------- write
def check_writable(fmt: Format, config: DrafterConfig) -> None:
    """ValueError naming every field of ``config`` lost in ``fmt``'s round trip
    (:func:`lost_fields`), what the engines or the format's owner would run otherwise, the fix."""
    problems = fmt.engine_problems(config)
    lost = lost_fields(fmt, config)
    if lost:
        problems.append(f"the fields {lost} (they do not survive its write -> read round trip)")
    if problems:
        raise ValueError(f"{config._source}: cannot be exported --format {fmt.name}: the format "
                         f"cannot carry " + "; ".join(problems) + f". Fix: {fmt.fix}")


def write_config(name: str, config: DrafterConfig, dtype: str,
                 target_identity: dict[str, Any] | None, vocab_known: bool) -> dict[str, Any]:
    """``--format name``'s config.json of ``config`` + ``target_identity``; ValueError if it
    cannot (check_writable)."""
    fmt = get(name).writer_for(config)
    check_writable(fmt, config)
    out = fmt.write_config(config, dtype, target_identity, vocab_known)
    if target_identity is not None:
        out[TARGET_IDENTITY_KEY] = target_identity
    return out
