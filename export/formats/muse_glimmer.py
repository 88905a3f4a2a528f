"""The Muse Glimmer assistant format (:class:`MuseGlimmer`: read, ``--format muse-glimmer``
write). As for z-lab, its layer layout is a named rule set's reading (``resolve_third_party``)
of the engine views built here from each config class's defaults (docs/export.md, "Muse
Glimmer assistant directories"; the keys read, required and refused: docs/warm_start.md).
"""

from __future__ import annotations

from typing import Any

from dflash_lab.export.formats.base import Format, ReleasedFormat
from dflash_lab.export.formats.ours import Ours
from dflash_lab.model.config import (
    DFLASH2,
    FULL,
    HF_BOOKKEEPING_KEYS,
    SLIDING,
    TARGET_IDENTITY_KEY,
    DrafterConfig,
    reject_unknown_keys,
    shape_fields,
)

ARCHITECTURE = "MuseGlimmerAssistantModel"
#: vLLM's registry also knows the "DFlash"-prefixed name EAGLEConfig rewrites it to
ARCHITECTURES = (ARCHITECTURE, f"DFlash{ARCHITECTURE}")
MODEL_TYPE = "muse_glimmer_assistant"
#: Muse Glimmer tensor-name prefix -> ours (vLLM's hf_to_vllm_mapper does the same)
RENAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
#: vLLM's MuseGlimmerAssistantConfig default: the Muse Glimmer target's vocabulary
VLLM_DEFAULT_VOCAB = 202048

ENGINE_NOTES = {
    "vllm": "Muse Glimmer format read through vLLM 0.32's MuseGlimmerAssistantConfig "
            "(dflash_config.causal False unless the file sets is_causal)",
    "sglang": "Muse Glimmer format read through SGLang's MuseGlimmerAssistantConfig (sgl-project "
              "main 7560bb9: class default is_causal False)",
}


def _renamed(tensors: dict[str, Any], prefixes: dict[str, str]) -> dict[str, Any]:
    out = {}
    for name, value in tensors.items():
        for old, new in prefixes.items():
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = value
    return out


def owners_window_note(config: dict[str, Any]) -> str | None:
    """How transformers' class runs a sliding layer, vs the engines' window (None: none slides)."""
    types = config.get("layer_types") or [SLIDING] * int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if SLIDING not in types or window is None:
        return None
    return (f"transformers' MuseGlimmerAssistantModel (the format's owner) keeps keys with "
            f"|q - k| <= {window} in its sliding layers (window {window + 1} counting the "
            f"query); vLLM and SGLang run window {window}, which is how it is read here: the "
            f"context position {window} before a query is seen by the owners' model only")


#: Keys the owners' class and vLLM's class default differently (rms_norm_eps 1e-5 vs 1e-6,
#: every layer sliding vs every layer full, rope theta 500000 vs Qwen3's): a file must say them.
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
            "layer_types", "block_size", "mask_token_id", "target_layer_ids")
#: The target layers vLLM's runner captures (our id + 1); without it vLLM 0.32 captures the
#: target's EAGLE-3 default layers (docs/export.md, "Writing the Muse Glimmer layout").
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
READ = frozenset(REQUIRED) | {"max_position_embeddings", "sliding_window", "is_causal",
                              "use_sliding_window", "vocab_size", "num_target_layers",
                              TARGET_IDENTITY_KEY, AUX_KEY}
#: key -> (the only value the drafter implements, why)
FIXED = {"hidden_act": ("silu", "the drafter's MLP is SwiGLU (SGLang accepts only silu)"),
         "attention_bias": (False, "MuseGlimmerAssistantAttention has no q/k/v/o bias")}
OWNERS_MAX_POSITIONS = 131072  #: MuseGlimmerAssistantConfig.max_position_embeddings


def _check_keys(d: dict[str, Any], source: str) -> None:
    if "dflash_config" in d:
        raise ValueError(f"{source}: key 'dflash_config' is not part of the Muse Glimmer format "
                         "(transformers' MuseGlimmerAssistantConfig has no such field): vLLM "
                         "merges it over its causal=False default, SGLang ignores it, so the "
                         "engines would read this directory differently; remove it, or save the "
                         "drafter as a z-lab DFlashDraftModel directory (dflash-export DIR OUT)")
    reject_unknown_keys(set(d), READ | HF_BOOKKEEPING_KEYS | set(FIXED), "", source)
    for key, (want, why) in FIXED.items():
        if key in d and d[key] != want:
            raise ValueError(f"{source}: {key}={d[key]!r} is not supported ({why}); only "
                             f"{key}={want!r} is read")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"{source}: missing {missing}: MuseGlimmerAssistantConfig."
                         "save_pretrained writes them, and without them the owners' class and "
                         "vLLM's Qwen3Config-based class fall back to different defaults; write "
                         "them into config.json")


def _int(d: dict[str, Any], key: str, source: str) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: {key}={value!r} is not an integer")
    return value


def vllm_aux_note(d: dict[str, Any]) -> str | None:
    """Where vLLM 0.32 would feed the drafter other target layers (no :data:`AUX_KEY`)."""
    if AUX_KEY in d:
        return None
    ids = [i + 1 for i in d["target_layer_ids"]]
    depth = d.get("num_target_layers")
    default = [2, depth // 2, depth - 3] if depth else None
    if default == ids:
        return None
    got = (f"the target's EAGLE-3 default layers {default} (num_target_layers={depth})"
           if default else "the target's EAGLE-3 default layers (2, L // 2, L - 3)")
    return (f"no {AUX_KEY}: vLLM 0.32 captures {got} instead of the trained target_layer_ids + 1 "
            f"= {ids} (its MuseGlimmerAssistantConfig sets dflash_config without "
            "target_layer_ids); re-export with dflash-export --format muse-glimmer, which "
            f"writes {AUX_KEY}")


# ---------------------------------------------------------------------------- export
FORMAT = "muse-glimmer"  #: ``dflash-export --format`` value
#: The DFlash 2 form of the Muse Glimmer assistant in released code: z-lab's DFlash2DraftModel
#: layout, which is ours (docs/export.md, "Writing the Muse Glimmer layout").
DFLASH2_RELEASE = "z-lab/Muse-Glimmer-30B-DFlash2"


class MuseGlimmer(ReleasedFormat):
    """The Muse Glimmer assistant layout (DFlash 1); a DFlash 2 drafter is written in the
    layout of its released DFlash 2 form (:class:`MuseDFlash2`)."""

    name = FORMAT
    kind = "Muse Glimmer directory"
    writable = True
    model_type = MODEL_TYPE
    architectures = ARCHITECTURES
    engine_notes = ENGINE_NOTES
    title = "Muse Glimmer"
    fix = ("export it in dflash-lab's own format instead (omit --format muse-glimmer; vLLM and "
           "SGLang serve that format)")
    self_check_how = ("Muse Glimmer config.json read through each engine's config class for it "
                      "(export/formats/muse_glimmer.py) and dflash-lab's importer; tensors "
                      "renamed to ours")

    def engine_view(self, raw: dict[str, Any], engine: str) -> dict[str, Any]:
        """config.json as vLLM's ``MuseGlimmerAssistantConfig(Qwen3Config)`` holds it, or
        SGLang's ``MuseGlimmerAssistantConfig(PretrainedConfig)``: the file's window and layer
        types untouched (no layer_types = every layer full), is_causal False unless declared."""
        if engine == "vllm":
            return {**raw, "use_sliding_window": raw.get("use_sliding_window", True),
                    "vocab_size": raw.get("vocab_size", VLLM_DEFAULT_VOCAB),
                    "dflash_config": {"causal": False} | (raw.get("dflash_config") or {})}
        return {**raw, "use_sliding_window": True, "sliding_window": raw.get("sliding_window"),
                "layer_types": raw.get("layer_types") or [FULL] * int(raw["num_hidden_layers"]),
                "is_causal": raw.get("is_causal", False)}

    def base_config(self, d: dict[str, Any], source: str) -> DrafterConfig:
        """Every DrafterConfig field of a Muse Glimmer config.json on a placeholder layout (all
        layers full): the caller replaces the layout with a rule set's reading, as for z-lab."""
        _check_keys(d, source)
        if "rope_theta" not in (d.get("rope_parameters") or {}):
            raise ValueError(f"{source}: rope_parameters has no rope_theta; write the theta the "
                             "drafter was trained with (the owners' default is 500000)")
        fields = shape_fields(d, source)
        ids = d["target_layer_ids"]
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"{source}: target_layer_ids={ids!r}: need a non-empty list of target "
                             "layer ids (z-lab convention: the output of target layer i)")
        if AUX_KEY in d and d[AUX_KEY] != [i + 1 for i in ids]:
            raise ValueError(f"{source}: {AUX_KEY}={d[AUX_KEY]!r} (the layers vLLM captures) "
                             f"is not target_layer_ids + 1 = {[i + 1 for i in ids]}: vLLM would "
                             "feed the drafter other target layers; fix one of the two keys")
        fields.update(block_size=_int(d, "block_size", source),
                      mask_token_id=_int(d, "mask_token_id", source), target_layer_ids=ids)
        fields.setdefault("vocab_size", VLLM_DEFAULT_VOCAB)
        fields.setdefault("num_target_layers", max(ids) + 1)
        fields.setdefault("max_position_embeddings", OWNERS_MAX_POSITIONS)
        return DrafterConfig.create(source=source, **fields)

    def format_notes(self, d: dict[str, Any]) -> list[str]:
        notes = []
        if "vocab_size" not in d:
            notes.append(f"Muse Glimmer format: no vocab_size (the head is the target's); "
                         f"{VLLM_DEFAULT_VOCAB} assumed as vLLM does until a target is given: "
                         "dflash-train and dflash-eval take the loaded target's, dflash-export the "
                         "--target's")
        if "num_target_layers" not in d:
            notes.append("num_target_layers not recorded; assumed "
                         f"{max(d['target_layer_ids']) + 1} (training and eval use the loaded "
                         "target's depth)")
        return notes + [n for n in (vllm_aux_note(d), owners_window_note(d)) if n]

    def engine_problems(self, config: DrafterConfig) -> list[str]:
        """Why the format's owner would run the drafter otherwise, beside the fields the round
        trip loses (export/formats/base.py ``lost_fields``: a draft vocabulary, sinks, bias,
        scales and the Laguna features are lost fields): ``MuseGlimmerAssistantModel`` embeds
        MASK with the target's row and runs every layer bidirectional."""
        out = []
        if config.learned_mask_embedding:
            out.append("a learned mask embedding: the owners' class embeds MASK slots with the "
                       "target's embedding row and reads no mask_embedding.pt")
        causal = [i for i, spec in enumerate(config.layer_specs()) if spec.causal]
        if causal and len(causal) < config.num_hidden_layers:
            out.append(f"per-layer causality (layers {causal} causal, the others bidirectional): "
                       "the format has no per-layer key (vLLM 0.32 reads bool(is_causal), SGLang "
                       "one is_causal for every layer) and the owners' class runs every layer "
                       "bidirectional")
        elif causal:
            out.append(f"causal layers {causal}: MuseGlimmerAssistantAttention runs every layer "
                       "bidirectional (is_causal = False in its code; a config.json is_causal "
                       "reaches vLLM and SGLang only), so the format's owner would run another "
                       "drafter")
        return out

    def our_names(self, state: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
        """Muse Glimmer tensor names (``encoder.fc.weight``...) -> ours (``fc.weight``...)."""
        return _renamed(state, RENAMES)

    def serving_names(self, state: dict[str, Any]) -> dict[str, Any]:
        """Our tensor names -> the Muse Glimmer format's (what its ``save_pretrained`` writes)."""
        return _renamed(state, {ours: theirs for theirs, ours in RENAMES.items()})

    def mask_differences(self, raw: dict[str, Any]) -> list[str]:
        window = owners_window_note(raw)
        return [window] if window else []

    def writer_for(self, config: DrafterConfig) -> Format:
        super().writer_for(config)
        return MUSE_DFLASH2 if config.variant == DFLASH2 else self

    def write_config(self, config: DrafterConfig, dtype: str,
                     target_identity: dict[str, Any] | None, vocab_known: bool
                     ) -> dict[str, Any]:
        """config.json in the Muse Glimmer layout for a drafter :meth:`engine_problems` accepts:
        the :data:`REQUIRED` keys ``save_pretrained`` writes plus what makes engines read it as
        trained (docs/export.md, "Writing the Muse Glimmer layout")."""
        rope = {"rope_theta": config.rope_theta, "rope_type": "default",
                **(config.rope_scaling or {})}  # every key the drafter's RoPE reads (model/rope.py)
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0,
            "rms_norm_eps": config.rms_norm_eps, "rope_parameters": rope,
            "max_position_embeddings": config.max_position_embeddings,
            "layer_types": [SLIDING if s.window is not None else FULL
                            for s in config.layer_specs()],
            "use_sliding_window": config.any_sliding, "is_causal": False,
            "block_size": config.block_size, "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            AUX_KEY: [i + 1 for i in config.target_layer_ids],  # what vLLM's runner captures
            "num_target_layers": config.num_target_layers,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "dtype": dtype,
        }
        if config.any_sliding:
            out["sliding_window"] = config.sliding_window
        if vocab_known:
            out["vocab_size"] = config.vocab_size
        return out


class MuseDFlash2(Ours):
    """``--format muse-glimmer``, DFlash 2: :data:`DFLASH2_RELEASE`'s layout, z-lab's (ours)."""

    def report_header(self, raw: dict[str, Any]) -> dict[str, str]:
        return {"format": f"{FORMAT} DFlash 2 (DFlash2DraftModel, the layout of "
                          f"{DFLASH2_RELEASE}: z-lab's DFlash 2 layout, which is dflash-lab's "
                          "own)"}


MUSE_GLIMMER, MUSE_DFLASH2 = MuseGlimmer(), MuseDFlash2()
