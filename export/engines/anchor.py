"""``sample_from_anchor``: whether slot 0 of a block (the anchor) drafts, as each engine reads it.
The forward is the same either way, so an engine running the other convention drafts every token
one position off; :func:`apply` records per rule set a refusal, or the value dropped with the
engine's value in ``reading.overrides`` (docs/export.md, "sample_from_anchor").
"""

from __future__ import annotations

from typing import Any

from dflash_lab.export.engines.common import EngineReading

KEY = "sample_from_anchor"
#: rule sets whose engine reads ``dflash_config.sample_from_anchor`` and refuses true
REFUSES_TRUE = ("vllm-main-v2", "vllm<=0.26-v2")
V2_REFUSAL = ("raises ValueError: sample_from_anchor=True is not supported for DFlash (V2 model "
              "runner, v1/worker/gpu/spec_decode/dflash/speculator.py)")


def declared(config: dict[str, Any]) -> bool | None:
    """``dflash_config.sample_from_anchor`` (where ours writes it and vLLM reads it), else a
    top-level key (speculators' spelling); None when absent."""
    dfc = config.get("dflash_config") or {}
    value = dfc.get(KEY, config.get(KEY))
    return None if value is None else bool(value)


def apply(reading: EngineReading, config: dict[str, Any]) -> EngineReading:
    """What ``reading.rule_set`` runs for the checkpoint's ``sample_from_anchor``."""
    meant = bool(declared(config))  # absent = false: DFlash, z-lab, speculators' dflash
    if not reading.loads or not meant:
        return reading  # every modelled engine runs false: nothing differs
    if reading.rule_set in REFUSES_TRUE:
        reading.refusal, reading.layers = V2_REFUSAL, None
        return reading
    reading.dropped.append(
        "dflash_config.sample_from_anchor=true (it drafts the anchor slot 0 as DFlash slots "
        "1..B-1: every draft one position off; fix: serve it with an engine that runs "
        "sample_from_anchor, or retrain with drafter.sample_from_anchor=false)")
    reading.overrides[KEY] = False
    return reading
