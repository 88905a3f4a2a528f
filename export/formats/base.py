"""The Format interface: what one checkpoint format is (docs/architecture.md, "Add a format").
Everything that depends on a file's format is a method here and callers ask the registry, never
branching on a format or a variant; what a writable format cannot carry is found by
:func:`lost_fields` (write, detect, read back, name every changed field).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from dflash_lab.export.engines import ENGINES, RuleSet, anchor, rule_sets_for
from dflash_lab.export.engines.common import Artifacts, EngineReading
from dflash_lab.export.sources import (
    is_serving_dir,
    read_config_json,
    resolve_third_party,
    serving_source,
)
from dflash_lab.export.weights import Source
from dflash_lab.model.config import DSPARK, DrafterConfig

Tensors = dict[str, Any]  #: tensors, or shapes (``--inspect`` renames shapes the same way)


class Format:
    """One checkpoint format. Subclasses override what differs from our serving layout."""

    name = ""  #: registry key; the ``--format`` value of a writable format
    kind = "serving directory"  #: how a Source read from it is described
    writable = False  #: ``dflash-export --format NAME`` writes it
    option = True  #: a writable format is a ``--format`` value (DSpark: the default's writer)
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
        return is_serving_dir(path) and self.detect(read_config_json(path))

    # ------------------------------------------------------------------ read
    def load(self, path: Path, verify: bool, assume: str | None = None) -> Source:
        """The drafter at ``path`` (config, our tensor names) as an export Source; by default a
        serving directory read by sources.py with this format's hooks below (``assume``: the
        rule set resolving its layout; formats that are no serving directory ignore it)."""
        return serving_source(path, self, verify, assume)

    def base_config(self, raw: dict[str, Any], source: str) -> DrafterConfig:
        """Every field of a third-party config.json on a placeholder layout (the layout is then
        one engine rule set's reading: sources.resolve_third_party)."""
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
        config, _ = resolve_third_party(raw, Path("<round trip>"), artifacts, None, self)
        return config

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
        """The config.json of ``config`` in this format."""
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


#: the fields that spell the per-layer layout: equal specs (``layer_specs``) are the same
#: layout however they are spelled (an import writes the resolved causality explicitly)
LAYOUT_FIELDS = ("layer_types", "sliding_window", "is_causal")
#: a field without a default, missing from what the import built
_ABSENT = object()


def lost_fields(fmt: Format, config: DrafterConfig, artifacts: Artifacts,
                detect: Any) -> list[str]:
    """The dataclass fields of ``config`` (its own class's, so a subclass's extra field counts)
    that do not survive ``fmt``'s write -> ``detect`` -> read; ``detect(raw)`` is the registry's
    :func:`~dflash_lab.export.formats.format_of`. A written file detected as another format
    loses everything that format reads otherwise; one nothing reads loses every field."""
    raw = fmt.write_config(config, "float32", None, vocab_known=True)
    found = detect(raw)
    fields = {f.name: _default(f) for f in dataclasses.fields(config)
              if f.compare and f.name != "head_options"}
    fields.update(dict.fromkeys(config.head_options))  # a head's fields, each by name
    try:
        back = found.read_back(raw, artifacts)
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
