"""Read drafters saved by the other open DFlash trainers into our config + serving-name weights.

Two formats, each read from the trainer's own code (docs/warm_start.md lists the versions):

- speculators (vllm-project/speculators 0.9.0, ``DFlashDraftModel.save_pretrained``): a directory
  with ``config.json`` (``speculators_model_type`` "dflash" | "dflash2", the draft layers'
  Qwen3 config under ``transformer_layer_config``, ``aux_hidden_state_layer_ids``,
  ``block_size``, ``mask_token_id``, ``sliding_window_non_causal``, ``draft_vocab_size``) and
  ``model.safetensors`` with our serving names (``embed_tokens`` / ``lm_head`` /
  ``verifier_*`` are not saved for a full-vocabulary draft). Its layer ids index HF
  ``hidden_states`` (``i + 1`` = the output of decoder layer ``i``); ours are z-lab's ``i``.
  Its block-anchored sliding window ``W`` is read as our per-query ``W + 1``; what still
  differs is in ``Source.mask_differences`` (:func:`speculators_window_difference`).
- SpecForge (sgl-project/SpecForge, ``CheckpointManager``): ``{run_id}-step{N}/
  training_state.pt``, a dict whose ``draft_state_dict`` holds the ``DFlashDraftModel``
  weights (``draft_model.`` prefix already stripped) and ``strategy`` ("dflash"). The draft
  config is NOT in the checkpoint: it is the z-lab style JSON passed as
  ``--draft-model-config``; we read it as ``config.json`` beside ``training_state.pt`` or in
  the run's output directory. SpecForge's mask is the legacy rule (sliding layers causal with
  a per-query window, full layers bidirectional), which is what a config without ``is_causal``
  means to us. Its HF export (``specforge.export.to_hf``) is a z-lab directory and is read as
  one. This SpecForge (main at a6b6b02) has no DFlash 2 model: DFlash 1 only.

Everything is opened with safetensors or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from dflash_lab.export import dspark
from dflash_lab.export.integrity import checked
from dflash_lab.export.weights import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Source,
    load_weights,
    plain_key,
    validate_state_dict,
)
from dflash_lab.model.config import (
    DFLASH1,
    DFLASH2,
    DSPARK,
    DSPARK_DEFAULTS,
    FULL,
    SLIDING,
    TARGET_IDENTITY_KEY,
    TRAINING_SPEC_KEY,
    DrafterConfig,
    build_target_layer_ids,
)
from dflash_lab.model.rope import is_nested

SPECFORGE_STATE = "training_state.pt"
SPECULATORS_KEYS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                    "verifier_norm.weight", "t2d", "d2t")  #: verifier-owned, never the drafter's
#: with a reduced draft vocabulary these belong to the drafter (docs/draft_vocab.md)
DRAFT_VOCAB_KEYS = ("lm_head.weight", "t2d", "d2t")
_QWEN3_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps",
                "max_position_embeddings", "attention_bias")
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


# ---------------------------------------------------------------------------- speculators
def is_speculators_dir(path: Path) -> bool:
    file = path / CONFIG_FILE
    if not (path.is_dir() and file.is_file()):
        return False
    try:
        return "speculators_model_type" in json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return False


def _speculators_layout(d: dict[str, Any], tl: dict[str, Any], kind: str) -> dict[str, Any]:
    """Per-layer window and causality as speculators' mask builds them: sliding layers are
    causal unless ``sliding_window_non_causal`` (default False for dflash, True for dflash2),
    full layers always bidirectional. Its window ``W`` is read as our ``W + 1``
    (:func:`speculators_window_difference` says why and what still differs)."""
    n = int(tl["num_hidden_layers"])
    types = list(tl.get("layer_types") or [FULL] * n)
    sliding = [t == SLIDING for t in types]
    non_causal = bool(d.get("sliding_window_non_causal", kind == "dflash2"))
    causal = [s and not non_causal for s in sliding]
    window = tl.get("sliding_window") if any(sliding) else None
    return {"layer_types": types, "sliding_window": None if window is None else int(window) + 1,
            "is_causal": causal[0] if len(set(causal)) == 1 else causal}


def speculators_window_difference(window: int, block_size: int, causal: bool) -> str:
    """What our window ``W + 1`` hides that speculators 0.9.0's sliding window ``W`` shows.

    speculators (``models/dflash/attention.py::create_anchor_block_mask_mod``) anchors the
    window at the block: every slot of the block anchored at ``a`` sees the context positions
    ``[a - W, a)`` and its whole block (causal: slots ``u <= t``). Ours counts ``W' `` keys back
    from each query (slot ``t`` at position ``a + t`` sees context ``[a + t - W' + 1, a)`` and
    block slots ``|t - u| <= W' - 1``), so no ``W'`` equals it for ``B >= 2``: the context bound
    would have to move with ``t``. ``W' = W + 1`` is the largest window whose keys all lie
    inside speculators' for every slot: slot 0 sees exactly speculators' context, slot ``t`` misses
    the ``min(t, W)`` oldest context positions ``[a - W, a - W + t)``, and when ``W + 1 < B``
    block slots more than ``W`` apart (which speculators shows) are hidden. Counts are per block
    whose anchor has at least ``W`` context positions.
    """
    b = block_size
    ctx = sum(min(t, window) for t in range(b))
    blk = sum(1 for t in range(b) for u in range(b)
              if abs(t - u) > window and (u <= t or not causal))
    seen = b * window + sum(1 for t in range(b) for u in range(b) if u <= t or not causal)
    text = (f"speculators' sliding window {window} covers the {window} positions before the "
            f"block for every slot; ours counts back from each query: read as window "
            f"{window + 1} (slot 0's context exact), slot t of the {b}-slot block misses the "
            f"min(t, {window}) oldest of them: {ctx} of its {b * window} context (query, key) "
            "pairs")
    if blk:
        text += f" and {blk} block pairs more than {window} slots apart"
    return text + f" per block ({ctx + blk} of {seen} pairs speculators trained with)"


def _rope(tl: dict[str, Any]) -> dict[str, Any]:
    """rope_theta (+ the scaling, whole: DrafterConfig validates it, model/rope.py) from
    transformers 5 ``rope_parameters`` or the older top-level ``rope_theta`` / ``rope_scaling``."""
    params = dict(tl.get("rope_parameters") or tl.get("rope_scaling") or {})
    theta = params.pop("rope_theta", tl.get("rope_theta"))
    out: dict[str, Any] = {} if theta is None else {"rope_theta": float(theta)}
    if params.get("rope_type", params.get("type", "default")) != "default" or is_nested(params):
        out["rope_scaling"] = params
    return out


def _refuse_speculators_features(d: dict[str, Any], file: Path) -> None:
    if d.get("mask_token_id") is None:
        raise ValueError(f"{file}: mask_token_id is null; set it in config.json to the MASK id "
                         "the drafter was trained with")


def speculators_config(d: dict[str, Any], file: Path) -> tuple[DrafterConfig, list[str]]:
    """Our DrafterConfig of a speculators config.json dict, and notes on what was assumed."""
    kind = d.get("speculators_model_type")
    if kind not in ("dflash", "dflash2", "dspark"):
        raise ValueError(f"{file}: speculators_model_type={kind!r} is not a DFlash drafter "
                         "(dflash, dflash2 or dspark)")
    tl = dict(d.get("transformer_layer_config") or {})
    if kind == "dspark" and TRAINING_SPEC_KEY in tl:  # our export (export/dspark.py): exact
        return dspark.config_of(d, str(file)), ["dflash-lab DSpark export: the recorded "
                                                "drafter, checked against update_dspark"]
    _refuse_speculators_features(d, file)
    aux = d.get("aux_hidden_state_layer_ids")
    if not aux or min(aux) < 1:
        raise ValueError(f"{file}: aux_hidden_state_layer_ids={aux}: need ids >= 1 (speculators "
                         "counts HF hidden_states, 0 = the embeddings, which no z-lab layer id "
                         "names)")
    ids = [int(i) - 1 for i in aux]  # speculators i+1 -> z-lab i (output of decoder layer i)
    fields: dict[str, Any] = {k: tl[k] for k in _QWEN3_SHAPE if tl.get(k) is not None}
    fields.update(_rope(tl), **_speculators_layout(d, tl, kind))
    fields.update(mask_token_id=int(d["mask_token_id"]), block_size=int(d["block_size"]),
                  target_layer_ids=ids, num_target_layers=max(ids) + 1,
                  variant={"dflash2": DFLASH2, "dspark": DSPARK}.get(kind, DFLASH1),
                  # speculators 0.9.0 models/dflash/config.py: absent = false (every slot of
                  # the block predicts when true: slot k -> the token at anchor + k + 1);
                  # models/dspark/config.py: absent = true
                  sample_from_anchor=bool(d.get("sample_from_anchor", kind == "dspark")))
    if kind == "dspark":  # speculators' DSparkSpeculatorConfig defaults for absent keys
        fields.update({k: d.get(k, v) for k, v in DSPARK_DEFAULTS.items()})
    if kind == "dflash2":
        fields.update({k: int(d[k]) for k in _DFLASH2_FIELDS})
    if d.get("draft_vocab_size") is not None:  # a reduced one: lm_head [N, H], d2t and t2d
        fields["draft_vocab_size"] = int(d["draft_vocab_size"])
    # vLLM's update_dflash copies it beside hidden_size and sizes fc from it (qwen3_dflash.py);
    # speculators 0.9.0 declares it but builds fc from hidden_size: the weights decide
    fields["target_hidden_size"] = d.get("target_hidden_size")
    notes = [f"speculators aux_hidden_state_layer_ids {list(aux)} read as target_layer_ids "
             f"{ids} (speculators counts hidden_states: i+1)",
             f"num_target_layers not recorded; assumed {max(ids) + 1} (training and eval use "
             "the loaded target's depth)"]
    config = DrafterConfig.create(source=str(file), **fields)
    causal = {s.causal for s in config.layer_specs() if s.window is not None}
    notes += [speculators_window_difference(config.sliding_window - 1, config.block_size, c)
              for c in sorted(causal)]
    return config, notes


def load_speculators_dir(path: Path, verify: bool = True):
    """A speculators DFlash / DFlash 2 / DSpark directory as an export
    :class:`~dflash_lab.export.weights.Source`. Our own DSpark export (export/dspark.py) is
    checked against its ``SHA256SUMS`` (``verify``) and read exactly."""
    file = path / CONFIG_FILE
    d = json.loads(file.read_text())
    ours = dspark.is_dspark(d) and TRAINING_SPEC_KEY in (d.get("transformer_layer_config") or {})
    integrity = [checked(path, verify).note] if ours else []
    config, notes = speculators_config(d, file)
    own = DRAFT_VOCAB_KEYS if config.has_draft_vocab else ()  # then the drafter's, not theirs
    state = {k: v for k, v in load_weights(path).items()
             if k not in SPECULATORS_KEYS or k in own}
    validate_state_dict(state, config, str(path / WEIGHTS_FILE))
    if ours:
        identity = d.get(TARGET_IDENTITY_KEY)
        return Source(config, state, "serving", f"DSpark directory {path}", notes + integrity,
                      reads=[path], target_identity=identity if isinstance(identity, dict)
                      else None, depth_recorded=True)
    return Source(config, state, "serving", f"speculators directory {path}", notes, reads=[path],
                  depth_recorded=False,
                  mask_differences=[n for n in notes if n.startswith("speculators' sliding")])


# ---------------------------------------------------------------------------- SpecForge
def specforge_state_file(path: Path) -> Path | None:
    """``training_state.pt`` of a SpecForge checkpoint path (the file, a ``-stepN`` dir, or a
    run output dir: its ``-best``, else ``-latest`` link, else the highest step), or None."""
    if path.is_file():
        return path if path.name == SPECFORGE_STATE else None
    if (path / SPECFORGE_STATE).is_file():
        return path / SPECFORGE_STATE
    if not path.is_dir():
        return None
    for pattern in ("*-best", "*-latest"):
        links = sorted(p for p in path.glob(pattern) if (p / SPECFORGE_STATE).is_file())
        if len(links) > 1:
            raise ValueError(f"{path}: holds several SpecForge runs {[p.name for p in links]}; "
                             "pass one {run_id}-step{N} directory")
        if links:
            return links[0].resolve() / SPECFORGE_STATE
    steps = [(int(m.group(1)), p) for p in path.glob("*-step*")
             if (m := re.search(r"-step(\d+)$", p.name)) and (p / SPECFORGE_STATE).is_file()]
    return max(steps)[1] / SPECFORGE_STATE if steps else None


def _specforge_config(state_file: Path) -> Path:
    for where in (state_file.parent, state_file.parent.parent):
        if (where / CONFIG_FILE).is_file():
            return where / CONFIG_FILE
    raise ValueError(f"{state_file}: SpecForge keeps the draft config outside its checkpoint; "
                     f"copy the --draft-model-config JSON the run used (e.g. SpecForge's "
                     f"configs/qwen3-8b-dflash.json) to {state_file.parent / CONFIG_FILE}")


def _specforge_layout(d: dict[str, Any]) -> dict[str, Any]:
    """SpecForge's mask (``dflash_family_model``): sliding layers causal with a window counting
    the query, full layers bidirectional; ``layer_types`` absent means all full."""
    types = list(d.get("layer_types") or [FULL] * int(d["num_hidden_layers"]))
    sliding = [t == SLIDING for t in types]
    return {"layer_types": types, "is_causal": sliding[0] if len(set(sliding)) == 1 else sliding,
            "sliding_window": d.get("sliding_window") if any(sliding) else None}


def specforge_config(d: dict[str, Any], file: Path) -> DrafterConfig:
    """Our DrafterConfig of a SpecForge draft config (a Qwen3 config plus ``block_size``,
    ``num_target_layers`` and ``dflash_config``), read as its ``DFlashDraftModel`` reads it."""
    dfc = d.get("dflash_config") or {}
    for key, off in (("projector_type", None), ("pure_draft_prefix_len", 0),
                     ("shift_label", False)):
        if dfc.get(key, off) != off:
            raise ValueError(f"{file}: dflash_config.{key}={dfc[key]!r} is a SpecForge variant "
                             "feature the drafter here does not implement")
    if d.get("architectures", ["DFlashDraftModel"]) != ["DFlashDraftModel"]:
        raise ValueError(f"{file}: architectures={d['architectures']}; only SpecForge's "
                         "DFlashDraftModel is read")
    n = int(d["num_hidden_layers"])
    ids = dfc.get("target_layer_ids") or build_target_layer_ids(int(d["num_target_layers"]), n)
    fields = {k: d[k] for k in _QWEN3_SHAPE if d.get(k) is not None}
    fields.update(_rope(d), **_specforge_layout(d),
                  mask_token_id=int(dfc["mask_token_id"]), block_size=int(d["block_size"]),
                  target_layer_ids=list(ids),
                  num_target_layers=int(d.get("num_target_layers") or max(ids) + 1))
    return DrafterConfig.create(source=str(file), **fields)


def load_specforge_checkpoint(state_file: Path):
    """A SpecForge DFlash ``training_state.pt`` (+ its draft config) as a Source."""
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{state_file}: cannot be loaded with torch.load(weights_only=True): "
                         f"{err}") from err
    if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
        raise ValueError(f"{state_file}: no 'draft_state_dict'; not a SpecForge checkpoint")
    if state.get("strategy", "dflash") != "dflash":
        raise ValueError(f"{state_file}: written by SpecForge strategy {state['strategy']!r}; "
                         "only plain 'dflash' drafters (no extra heads) are read")
    config_file = _specforge_config(state_file)
    try:
        config = specforge_config(json.loads(config_file.read_text()), config_file)
    except (KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file}: not a SpecForge DFlash draft config ({err!r})") from err
    weights = {plain_key(k): v for k, v in state["draft_state_dict"].items() if "embed" not in k}
    validate_state_dict(weights, config, str(state_file))
    notes = [f"draft config {config_file}; SpecForge step {state.get('global_step')}; "
             "sliding layers causal, full bidirectional (SpecForge's mask)"]
    return Source(config, weights, "checkpoint", f"SpecForge checkpoint {state_file}", notes,
                  reads=[state_file, config_file],
                  depth_recorded="num_target_layers" in json.loads(config_file.read_text()))
