"""The speculators format (vllm-project/speculators 0.9.0, ``DFlashDraftModel.save_pretrained``,
safetensors only): its layer ids are ours + 1, its block-anchored window ``W`` our per-query
``W + 1`` (:func:`speculators_window_difference`); our DSpark export: formats/dspark.py
(docs/warm_start.md, "What PATH may be").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash_lab.export.engines.variant import DFLASH2_KEYS
from dflash_lab.export.formats.base import Format
from dflash_lab.export.weights import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Source,
    load_weights,
    own_head,
    validate_state_dict,
)
from dflash_lab.model.config import (
    DFLASH1,
    DFLASH2,
    DSPARK,
    DSPARK_DEFAULTS,
    FULL,
    SLIDING,
    DrafterConfig,
)
from dflash_lab.model.rope import is_nested

SPECULATORS_KEYS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                    "verifier_norm.weight", "t2d", "d2t")  #: verifier-owned, never the drafter's
#: with a reduced draft vocabulary these belong to the drafter (docs/draft_vocab.md)
DRAFT_VOCAB_KEYS = ("lm_head.weight", "t2d", "d2t")
_QWEN3_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps",
                "max_position_embeddings", "attention_bias")
#: speculators 0.9.0's XPress refiner (``refiner_head.*``) -> vLLM's names (``xpress_head.*``;
#: docs/design/new_heads.md XPress (b)); the mixer stays raw (vLLM folds it after loading)
XPRESS_NAMES = {"token_embed.weight": "w1.weight", "readout.weight": "w2.weight",
                "mlp_gate.weight": "mlp.gate_proj.weight", "mlp_up.weight": "mlp.up_proj.weight",
                "mlp_down.weight": "mlp.down_proj.weight", "mix_l": "mix.L"}


# ---------------------------------------------------------------------------- speculators
def is_speculators_dir(path: Path) -> bool:
    file = path / CONFIG_FILE
    if not (path.is_dir() and file.is_file()):
        return False
    try:
        return "speculators_model_type" in json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return False


def trainer_layout(tl: dict[str, Any], sliding_causal: bool) -> dict[str, Any]:
    """The layout speculators' and SpecForge's masks build from a Qwen3 config: the file's
    ``layer_types`` (absent: all full), full layers bidirectional, sliding ones causal when
    ``sliding_causal``, and the file's window."""
    types = list(tl.get("layer_types") or [FULL] * int(tl["num_hidden_layers"]))
    causal = [t == SLIDING and sliding_causal for t in types]
    return {"layer_types": types, "is_causal": causal[0] if len(set(causal)) == 1 else causal,
            "sliding_window": tl.get("sliding_window") if SLIDING in types else None}


def speculators_window_difference(window: int, block_size: int, causal: bool) -> str:
    """What our window ``W + 1`` hides that speculators 0.9.0's block-anchored sliding window
    ``W`` shows (``create_anchor_block_mask_mod``): per block whose anchor has at least ``W``
    context positions (docs/warm_start.md, "What PATH may be")."""
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


def speculators_config(d: dict[str, Any], file: Path) -> tuple[DrafterConfig, list[str]]:
    """Our DrafterConfig of a speculators config.json dict, and notes on what was assumed."""
    kind = d.get("speculators_model_type")
    if kind not in ("dflash", "dflash2", "dspark", "xpress"):
        raise ValueError(f"{file}: speculators_model_type={kind!r} is not a DFlash drafter "
                         "(dflash, dflash2, dspark or xpress)")
    tl = dict(d.get("transformer_layer_config") or {})
    if d.get("mask_token_id") is None:
        raise ValueError(f"{file}: mask_token_id is null; set it in config.json to the MASK id "
                         "the drafter was trained with")
    aux = d.get("aux_hidden_state_layer_ids")
    if not aux or min(aux) < 1:
        raise ValueError(f"{file}: aux_hidden_state_layer_ids={aux}: need ids >= 1 (speculators "
                         "counts HF hidden_states, 0 = the embeddings, which no z-lab layer id "
                         "names)")
    ids = [int(i) - 1 for i in aux]  # speculators i+1 -> z-lab i (output of decoder layer i)
    fields: dict[str, Any] = {k: tl[k] for k in _QWEN3_SHAPE if tl.get(k) is not None}
    # sliding layers are causal unless sliding_window_non_causal (default true for dflash2 only);
    # the block-anchored window W is read as our W + 1 (speculators_window_difference)
    layout = trainer_layout(tl, not d.get("sliding_window_non_causal", kind == "dflash2"))
    if layout["sliding_window"] is not None:
        layout["sliding_window"] = int(layout["sliding_window"]) + 1
    fields.update(_rope(tl), **layout)
    fields.update(mask_token_id=int(d["mask_token_id"]), block_size=int(d["block_size"]),
                  target_layer_ids=ids, num_target_layers=max(ids) + 1,
                  variant={"dflash2": DFLASH2, "dspark": DSPARK, "xpress": "xpress"}.get(
                      kind, DFLASH1),
                  # speculators 0.9.0 models/dflash/config.py: absent = false (every slot of
                  # the block predicts when true: slot k -> the token at anchor + k + 1);
                  # models/dspark/config.py: absent = true
                  sample_from_anchor=bool(d.get("sample_from_anchor", kind == "dspark")))
    if kind == "dspark":  # speculators' DSparkSpeculatorConfig defaults for absent keys
        fields.update({k: d.get(k, v) for k, v in DSPARK_DEFAULTS.items()})
    if kind == "dflash2":
        fields.update({k: int(d[k]) for k in DFLASH2_KEYS})
    if kind == "xpress":  # XPressSpeculatorConfig (models/xpress/config.py); no top-C stored
        rank = int(d.get("xpress_rank", 256))
        fields.update(xpress_rank=rank,
                      xpress_mlp_hidden=rank * int(d.get("xpress_mlp_ratio", 2)),
                      xpress_num_passes=int(d.get("num_jacobi_passes", 6)),
                      xpress_topc=min(512, int(tl["vocab_size"])))
        d = {**d, "draft_vocab_size": None} if d.get("draft_vocab_size") == tl["vocab_size"] else d
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


def drafter_tensors(state: dict[str, torch.Tensor], config: DrafterConfig
                    ) -> dict[str, torch.Tensor]:
    """The drafter's tensors of a speculators ``model.safetensors``: the verifier-owned ones
    left out, except the head and id maps of a reduced draft vocabulary (the drafter's)."""
    own = DRAFT_VOCAB_KEYS if own_head(config) else ()
    prefix = "refiner_head."
    return {(f"xpress_head.{XPRESS_NAMES.get(k[len(prefix):], k[len(prefix):])}"
             if k.startswith(prefix) else k): v
            for k, v in state.items() if k not in SPECULATORS_KEYS or k in own}


class Speculators(Format):
    """A speculators DFlash / DFlash 2 / XPress directory (DSpark: export/formats/dspark.py)."""

    name = "speculators"
    kind = "speculators directory"

    def detect(self, raw: dict[str, Any]) -> bool:
        return "speculators_model_type" in raw

    def detect_path(self, path: Path) -> bool:
        return is_speculators_dir(path)

    def load(self, path: Path, verify: bool, assume: str | None = None) -> Source:
        """The directory as a Source (``verify`` unused: speculators writes no checksums)."""
        file = path / CONFIG_FILE
        config, notes = speculators_config(json.loads(file.read_text()), file)
        state = drafter_tensors(load_weights(path), config)
        validate_state_dict(state, config, str(path / WEIGHTS_FILE))
        return Source(config, state, "serving", f"speculators directory {path}", notes,
                      reads=[path], depth_recorded=False,
                      mask_differences=[n for n in notes if n.startswith("speculators' sliding")])


SPECULATORS = Speculators()
