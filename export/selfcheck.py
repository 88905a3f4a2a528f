"""After writing, reload the directory as an engine would (``Qwen3Config``, each current rule
set's reading, the weights by name) and compare draft logits with the source's on one random
probe block: the ``config`` diff (same exported weights, fp32) and the ``total`` diff (plus the
export dtype's rounding), relative to max |reference logit| (docs/export.md, "Self-check").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dflash_lab.export.engines import RuleSet
from dflash_lab.export.engines.common import Artifacts
from dflash_lab.export.formats import format_of
from dflash_lab.export.formats.base import config_from_reading
from dflash_lab.export.weights import MASK_KEY, load_mask_file, load_weights
from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.rope import is_nested, rope_type_of

CONFIG_TOL = 1e-4
DTYPE_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
_SAME_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "mask_token_id", "target_layer_ids",
                "block_size", "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias",
                "learned_mask_embedding", "attention_sink_bias", "variant", "conv_kernel_size",
                "conv_group_size", "selector_rank", "selector_top_k", "input_embedding_scale",
                "output_multiplier", "final_logit_softcapping", "draft_vocab_size",
                "sample_from_anchor")


@dataclass
class SelfCheckResult:
    """One engine view of the exported directory compared with the source drafter."""

    rule_sets: list[str]
    config_diff: float
    total_diff: float
    total_tol: float
    faithful: bool  #: the engine reads the same drafter as trained (no lossy refusal allowed)

    @property
    def ok(self) -> bool:
        return not self.faithful or (self.config_diff <= CONFIG_TOL
                                     and self.total_diff <= self.total_tol)

    def line(self) -> str:
        status = "ok" if self.faithful and self.ok else (
            "MISMATCH" if self.faithful else "lossy (allowed): engine runs a different drafter")
        return (f"- {', '.join(self.rule_sets)}: config diff {self.config_diff:.2e} "
                f"(tol {CONFIG_TOL:.0e}), total diff {self.total_diff:.2e} "
                f"(tol {self.total_tol:.0e}) -> {status}")


def qwen3_config_view(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """config.json as the engines see it after transformers' Qwen3Config parsed it."""
    try:
        from transformers import Qwen3Config
    except ImportError:
        return dict(config), "transformers not installed: Qwen3Config rewrites emulated"
    q = Qwen3Config.from_dict(dict(config))
    out = dict(config)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "rms_norm_eps", "max_position_embeddings",
                "attention_bias", "vocab_size", "layer_types", "sliding_window",
                "use_sliding_window"):
        out[key] = getattr(q, key)
    theta, out["rope_scaling"] = _rope_from(q)
    out.pop("rope_parameters", None)  # folded into rope_theta / rope_scaling above
    if theta is not None:
        out["rope_theta"] = theta
    out["is_causal"] = getattr(q, "is_causal", None)
    out["dflash_config"] = getattr(q, "dflash_config", None)
    if out["is_causal"] is None:
        out.pop("is_causal")
    return out, "config.json parsed by transformers Qwen3Config"


def _rope_from(q: Any) -> tuple[float | None, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5 ``rope_parameters`` (every key it holds: the engines
    read them all) or 4.x ``rope_theta`` / ``rope_scaling``; a per-layer-type dict is returned
    whole (no engine loads it, and DrafterConfig refuses it by name)."""
    params = getattr(q, "rope_parameters", None)
    if params is None:
        return q.rope_theta, q.rope_scaling
    if is_nested(params):
        return None, dict(params)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return params["rope_theta"], scaling if rope_type_of(scaling) != "default" else None


def same_drafter(a: DrafterConfig, b: DrafterConfig) -> bool:
    """Same computation: shapes, numerics, features and resolved per-layer specs."""
    return a.layer_specs() == b.layer_specs() and all(
        getattr(a, f) == getattr(b, f) for f in _SAME_FIELDS)


class _ProbeEmbedding(nn.Module):
    """Random rows for just the token ids the probe uses (a full vocab table can be GBs)."""

    def __init__(self, ids: list[int], hidden: int, gen: torch.Generator):
        super().__init__()
        self.register_buffer("ids", torch.tensor(sorted(set(ids))))
        self.register_buffer("table", torch.randn(len(self.ids), hidden, generator=gen))

    def forward(self, ids: Tensor) -> Tensor:
        return self.table[(ids[..., None] == self.ids).long().argmax(-1)]


def _probe(config: DrafterConfig) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    window = config.sliding_window if config.any_sliding else 0
    num_ctx = min(max(32, window + 8), 520)  # long enough for the window to bite when small
    h = config.hidden_size
    anchor = torch.randint(0, config.vocab_size, (1,), generator=gen)
    return {
        "feats": torch.randn(1, num_ctx, config.num_features, generator=gen),
        "anchor": anchor,
        "embed": _ProbeEmbedding([int(anchor), config.mask_token_id], h, gen),
        "head": torch.randn(max(min(config.vocab_size, 256), config.selector_top_k or 0), h,
                            generator=gen) / math.sqrt(h),
    }


@torch.no_grad()
def _logits(config: DrafterConfig, state: dict[str, Tensor],
            probe: dict[str, Any]) -> list[Tensor]:
    """[unary logits [1, B, V'], then the head's own outputs on the probe (``probe_outputs``:
    DFlash 2's selector walk scores [1, B-1, C], DSpark's Markov bias and confidence)]."""
    from dflash_lab.model.drafter import DFlashDrafter

    drafter = DFlashDrafter(config, backend="sdpa").float().eval()
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v
                             for k, v in state.items()}, strict=True)
    cache = drafter.new_cache()
    drafter.extend_context(cache, probe["feats"])
    hidden = drafter.draft(cache, probe["anchor"], probe["embed"]).float()
    unary = drafter.unary_logits(hidden, lambda h: h @ probe["head"].T)
    return [unary, *config.head.probe_outputs(drafter, hidden, unary, probe["anchor"])]


def _rel(a: list[Tensor], b: list[Tensor]) -> float:
    """Worst relative max difference over the compared outputs. Equal entries differ by 0
    (the -inf a draft vocabulary gives every other token); the scale is the finite max."""
    def one(x: Tensor, y: Tensor) -> float:
        diff = torch.where(x == y, torch.zeros_like(x), (x - y).abs())
        scale = y[y.isfinite()].abs().max() if bool(y.isfinite().any()) else y.new_ones(())
        return float(diff.max() / scale.clamp(min=1e-12))

    return max(one(x, y) for x, y in zip(a, b, strict=True))


def _exported(out_dir: Path, config: DrafterConfig, raw: dict[str, Any]) -> dict[str, Tensor]:
    """Every exported tensor under our names (safetensors + the mask file ``config`` reads), the
    format known from ``raw``, the directory's config.json."""
    state = format_of(raw).our_names(load_weights(out_dir), raw)
    if config.learned_mask_embedding:
        state[MASK_KEY] = load_mask_file(out_dir, config.mask_token_id)
    return state


_Group = tuple[DrafterConfig, dict[str, Tensor], list[str]]


def _engine_groups(out_dir: Path, view: dict[str, Any], rule_sets: list[RuleSet],
                   artifacts: Artifacts) -> list[_Group]:
    """Distinct drafters the rule sets that load the directory would build (several often build
    the same), read through its format's hooks (the engine's view, the importer's fields, our
    names)."""
    fmt = format_of(view)
    groups: list[_Group] = []
    for rule_set in rule_sets:
        reading = fmt.reading(rule_set, view, artifacts)
        if not reading.loads:
            continue
        flat = fmt.engine_config(view)  # the engine's draft config (DSpark: vLLM's flat one)
        base = format_of(flat).base_config(flat, f"{out_dir} as {rule_set.name}")  # not our spec
        config = dataclasses.replace(config_from_reading(base, reading, rule_set, artifacts),
                                     **reading.overrides)
        state = _exported(out_dir, config, view)
        if not config.attention_sink_bias:
            state = {k: v for k, v in state.items() if "attention_sink_bias" not in k}
        match = next((g for g in groups if same_drafter(g[0], config)), None)
        if match:
            match[2].append(rule_set.name)
        else:
            groups.append((config, state, [rule_set.name]))
    return groups


def run_self_check(out_dir: Path, raw_config: dict[str, Any], source_config: DrafterConfig,
                   source_state: dict[str, Tensor], rule_sets: list[RuleSet],
                   artifacts: Artifacts, dtype: torch.dtype) -> tuple[list[SelfCheckResult], str]:
    """Compare the source drafter with every distinct engine view of ``out_dir``, read through
    its format's own view where it has one (``self_check_how``), else through Qwen3Config."""
    how = format_of(raw_config).self_check_how  # its own view; else through Qwen3Config
    view, how = (raw_config, how) if how else qwen3_config_view(raw_config)
    probe = _probe(source_config)
    reference = _logits(source_config, source_state, probe)
    same_weights = _logits(source_config, _exported(out_dir, source_config, raw_config), probe)
    results = []
    for config, state, names in _engine_groups(out_dir, view, rule_sets, artifacts):
        got = _logits(config, state, probe)
        results.append(SelfCheckResult(names, _rel(got, same_weights), _rel(got, reference),
                                       DTYPE_TOL[dtype], same_drafter(config, source_config)))
    return results, how
