"""The serving form of a drafter config: the config.json our exporter writes and reads back.
:func:`serving_dict` writes it (dflash.md section 4: the engines' keys, plus our exact training
spec under ``dflash_lab_training_spec``), :func:`parse_ours` reads it back strictly (for
``DrafterConfig.to_dict`` / ``from_dict``); the key sets and the readers' building blocks
(``shape_fields``, ``variant_of``, ``reject_unknown_keys``) serve export/formats' third-party
readers. The architecture is model/config.py's; each head's keys its module's (``serving_keys``).
"""

from __future__ import annotations

import difflib
from typing import Any

from dflash_lab.model import heads
from dflash_lab.model.rope import is_nested, normalize_scaling, rope_type_of

#: Logit and embedding scales every head honours; defaults mean "off" and are not written.
SCALE_DEFAULTS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
                  "final_logit_softcapping": None}
#: Key under which our exporter records the exact per-layer spec the drafter was trained with,
#: so ``dflash-export --inspect`` can compare it with what each engine will do.
TRAINING_SPEC_KEY = "dflash_lab_training_spec"
#: Top-level config.json key of our exports: the target the drafter was trained against (the
#: checkpoint's recorded identity: architecture, hashes, ``weights_fingerprint``, sizes; no local
#: paths), so a warm start or a re-export from the export can tell other target weights.
TARGET_IDENTITY_KEY = "dflash_lab_target"

#: Standard Hugging Face bookkeeping keys: accepted and ignored when reading a config.json.
HF_BOOKKEEPING_KEYS = frozenset(
    {
        "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
        "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
        "output_attentions", "output_hidden_states", "return_dict", "attention_dropout",
        "tie_word_embeddings", "architectures", "model_type", "hidden_act", "max_window_layers",
        "use_sliding_window", "quantization_config", "layer_idx", "name_or_path",
        # PretrainedConfig.to_dict() (not to_diff_dict) writes these generic keys as well
        "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    }
)


def _suggest(key: str, known: set[str] | frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=3)
    if len(close) > 1:
        return " (did you mean one of " + ", ".join(f"'{c}'" for c in close) + "?)"
    return f" (did you mean '{close[0]}'?)" if close else ""


def variant_keys() -> tuple[str, ...]:
    """Keys holding a head field or a scale; ours writes them in ``dflash_config``."""
    return tuple(k for head in heads.heads() for k in head.fields) + tuple(SCALE_DEFAULTS)


def serving_dict(config: Any) -> dict[str, Any]:
    """:meth:`DrafterConfig.to_dict`: the serving config.json (dflash.md sec. 4) + training spec."""
    uniform = config.uniform_causal
    dflash: dict[str, Any] = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "attention_sink_bias": config.attention_sink_bias,
        # always explicit: engines default it differently (vLLM false, llama.cpp true)
        "sample_from_anchor": config.sample_from_anchor,
    }
    own = config.head.serving_keys(config)
    if not config.head.top_level_keys:
        dflash.update(own)
    dflash.update({k: getattr(config, k) for k, off in SCALE_DEFAULTS.items()
                   if getattr(config, k) != off})
    out: dict[str, Any] = {
        "architectures": [config.head.architecture],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "layer_types": list(config.layer_types),
        "use_sliding_window": config.any_sliding,
        "sliding_window": config.sliding_window if config.any_sliding else None,
        "max_window_layers": config.num_hidden_layers,
    }
    if config.any_sliding:
        dflash["swa_window_size"] = config.sliding_window
    if config.draft_vocab_size is not None:  # vLLM sizes the draft head and d2t from it
        out["draft_vocab_size"] = config.draft_vocab_size
    if config.target_hidden_size != config.hidden_size:  # vLLM sizes fc from the top-level key
        out["target_hidden_size"] = config.target_hidden_size
    if uniform is not None:
        out["is_causal"] = uniform
        dflash["causal"] = uniform
    if config.head.top_level_keys:
        out.update(own)
    out["dflash_config"] = dflash
    out[TRAINING_SPEC_KEY] = {
        "format_version": 1,
        "layer_specs": [{"window": s.window, "causal": s.causal} for s in config.layer_specs()],
        "is_causal": config.is_causal,
        "learned_mask_embedding": config.learned_mask_embedding,
    }
    for part in config.parts:  # what no engine reads from our layout (Laguna: export/laguna.py)
        out[TRAINING_SPEC_KEY].update(part.training_spec(config))
    return out


#: Shape keys, read from the top level by every reader of the serving format.
SHAPE_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
    "max_position_embeddings", "attention_bias", "num_target_layers",
)
#: The keys our :meth:`DrafterConfig.to_dict` writes (besides HF bookkeeping); read strictly.
OUR_TOP_KEYS = frozenset(SHAPE_KEYS) | {
    "block_size", "layer_types", "sliding_window", "is_causal", "dflash_config",
    TRAINING_SPEC_KEY, TARGET_IDENTITY_KEY, "draft_vocab_size", "target_hidden_size",
    "rope_parameters",  # transformers 5 re-saves rope_theta there
}
#: The ``dflash_config`` keys ours writes besides the heads' (:func:`variant_keys`).
CORE_DFLASH_KEYS = frozenset(
    {"mask_token_id", "target_layer_ids", "block_size", "causal", "swa_window_size",
     "attention_sink_bias", "sample_from_anchor"}
)
_SPEC_KEYS = frozenset({"format_version", "layer_specs", "is_causal", "learned_mask_embedding"})
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "vocab_size")


def reject_unknown_keys(keys: set[str], known: frozenset[str], where: str, source: str) -> None:
    """ValueError naming the first unknown key (and close matches) of a serving config."""
    unknown = sorted(keys - known)
    if unknown:
        key = unknown[0]
        raise ValueError(
            f"{source}: unknown key '{where}{key}'{_suggest(key, known)}"
            + (f" (and {unknown[1:]})" if len(unknown) > 1 else "")
            + "; dflash-lab does not implement it, so the drafter would not compute what the "
            "config says: remove it or fix its spelling")


def require_keys(d: dict[str, Any], dfc: dict[str, Any], source: str,
                 extra: tuple[str, ...] = ()) -> None:
    """The keys without which a config.json is no DFlash drafter (``extra``: top-level)."""
    missing = [k for k in _REQUIRED + extra if k not in d]
    if "mask_token_id" not in dfc:
        missing.append("dflash_config.mask_token_id")
    if missing:
        raise ValueError(f"{source}: missing required keys {missing}; is this a DFlash drafter?")


def variant_of(d: dict[str, Any], dfc: dict[str, Any], source: str) -> str:
    """The head from ``architectures``, else from the presence of one head's keys (dflash1
    without any); a head's keys under another head's architecture are refused."""
    arch = d.get("architectures")
    present = {head.name: sorted(k for k in head.fields if k in dfc or k in d)
               for head in heads.heads()}
    present = {name: keys for name, keys in present.items() if keys}
    if not arch:  # the head whose keys hold every other's (a shared field: LiLiCorr's conv)
        best = max(present, key=lambda n: len(present[n]), default=heads.DEFAULT)
        mine = set(present.get(best, ()))
        return best if all(set(k) <= mine for k in present.values()) else heads.DEFAULT
    found = [h.name for h in heads.heads() if h.architecture in arch]
    if not found or len(arch) != 1:
        known = sorted({h.architecture for h in heads.heads()})
        raise ValueError(f"{source}: architectures={arch} is not a DFlash drafter; expected "
                         f"one of {[[a] for a in known]}")
    # heads sharing a class (DFlash 1, Domino) are told apart by their keys
    keyed = [name for name in found if name in present]
    found = keyed if len(keyed) == 1 else [heads.DEFAULT if heads.DEFAULT in found else found[0]]
    own = heads.get(found[0]).fields
    for name, keys in present.items():
        keys = [k for k in keys if k not in own]  # a shared field (conv) is the found head's
        if name != found[0] and keys:
            head = heads.get(name)
            raise ValueError(f"{source}: has the {head.title} keys {keys} but architectures="
                             f"{arch}; set architectures to ['{head.architecture}'] or remove "
                             "them")
    return found[0]


def shape_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """Shape and RoPE fields from the top level (``num_key_value_heads`` defaults to MHA)."""
    fields: dict[str, Any] = {k: d[k] for k in SHAPE_KEYS if d.get(k) is not None}
    fields.update(_rope_kwargs(d, source))
    fields.setdefault("num_key_value_heads", d["num_attention_heads"])
    return fields


def _rope_kwargs(d: dict[str, Any], source: str) -> dict[str, Any]:
    """rope_theta / rope_scaling from transformers 5's ``rope_parameters`` where the legacy keys
    do not say them. As transformers' Qwen3Config (which both engines parse config.json with),
    a non-null ``rope_scaling`` wins; a ``rope_parameters`` saying something else is an error.
    A per-layer-type (nested) dict is passed on whole: DrafterConfig refuses it, naming why."""
    params = d.get("rope_parameters")
    if not params:
        return {}
    params = dict(params)
    if is_nested(params):
        return {} if d.get("rope_scaling") is not None else {"rope_scaling": params}
    theta = params.pop("rope_theta", None)
    if theta is not None and d.get("rope_theta") not in (None, theta):
        raise ValueError(f"{source}: rope_theta={d['rope_theta']} disagrees with "
                         f"rope_parameters.rope_theta={theta}; keep one")
    out: dict[str, Any] = {} if theta is None else {"rope_theta": theta}
    scaling = params if rope_type_of(params) != "default" else None
    legacy = d.get("rope_scaling")
    if legacy is None:
        return {**out, "rope_scaling": scaling} if scaling else out
    if scaling is not None and _normalized(dict(legacy), d, source) != _normalized(
            scaling, d, source):
        raise ValueError(f"{source}: rope_scaling={legacy} disagrees with rope_parameters="
                         f"{d['rope_parameters']} (the engines' Qwen3Config reads rope_scaling); "
                         "keep one")
    return out


def _normalized(scaling: dict[str, Any], d: dict[str, Any], source: str) -> Any:
    theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 1.0)
    return normalize_scaling(scaling, rope_theta=theta, where=source,
                             max_position_embeddings=d.get("max_position_embeddings", 40960))


def _our_block_size(d: dict[str, Any], dfc: dict[str, Any], source: str) -> int:
    """Ours writes ``block_size`` at the top level and in ``dflash_config``: they must agree."""
    top, inner = d.get("block_size"), dfc.get("block_size")
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"{source}: block_size={top} but dflash_config.block_size={inner}; "
                         "the drafter was trained with one block size: re-export it")
    value = inner if inner is not None else top
    if value is None:
        raise ValueError(f"{source}: no block_size; re-export the drafter")
    return value


def parse_ours(cls: type, d: dict[str, Any], *, source: str) -> Any:
    """Our serving config.json ``d`` read strictly into ``cls`` (DrafterConfig.from_dict)."""
    dfc = dict(d.get("dflash_config") or {})
    require_keys(d, dfc, source, extra=("num_target_layers",))
    if TRAINING_SPEC_KEY not in d:
        raise ValueError(
            f"{source}: no '{TRAINING_SPEC_KEY}', so dflash-lab did not write it; a third-party "
            "(z-lab, vLLM-style) config.json is read by dflash_lab.export.import_drafter "
            "(dflash-export SRC OUT, dflash-export --inspect DIR), which resolves its layout "
            "with a named engine rule set")
    top = {k for h in heads.heads() if h.top_level_keys for k in h.fields}
    reject_unknown_keys(set(d), OUR_TOP_KEYS | HF_BOOKKEEPING_KEYS | top, "", source)
    reject_unknown_keys(set(dfc), CORE_DFLASH_KEYS | set(variant_keys()), "dflash_config.",
                        source)
    spec = d[TRAINING_SPEC_KEY]
    parts = heads.features()
    reject_unknown_keys(set(spec), _SPEC_KEYS | {p.spec_key for p in parts if p.spec_key},
                        f"{TRAINING_SPEC_KEY}.", source)
    if "target_layer_ids" not in dfc:
        raise ValueError(f"{source}: missing dflash_config.target_layer_ids; re-export the drafter")
    kwargs = shape_fields(d, source)
    kwargs["variant"] = variant_of(d, dfc, source)
    kwargs.update({k: dfc.get(k, d.get(k)) for k in variant_keys()
                   if dfc.get(k, d.get(k)) is not None})
    heads.get(kwargs["variant"]).check_read(kwargs, source)  # the keys its owners need
    kwargs.update(
        block_size=_our_block_size(d, dfc, source), mask_token_id=dfc["mask_token_id"],
        target_layer_ids=dfc["target_layer_ids"], layer_types=d.get("layer_types"),
        sliding_window=d.get("sliding_window"), is_causal=spec.get("is_causal"),
        learned_mask_embedding=bool(spec.get("learned_mask_embedding", False)),
        attention_sink_bias=bool(dfc.get("attention_sink_bias", False)),
        sample_from_anchor=bool(dfc.get("sample_from_anchor", False)),
        draft_vocab_size=d.get("draft_vocab_size"),
        target_hidden_size=d.get("target_hidden_size"))
    for part in parts:
        if part.spec_key:
            entry = dict(spec.get(part.spec_key) or {})
            reject_unknown_keys(set(entry), frozenset(part.fields),
                                f"{TRAINING_SPEC_KEY}.{part.spec_key}.", source)
            kwargs.update(entry)
    return cls(_source=source, **kwargs)
