"""The Laguna features (vLLM's ``laguna_dflash.py``; export/formats/laguna.py writes their
serving layout): one RMSNorm per target-layer slice of the features before fc, context K/V
through each layer's ``input_layernorm``, a softplus output gate on attention, partial rotary.
Any head may switch them on (off: a plain DFlash drafter); no engine reads them from our own
layout, so our training spec keeps them (``dflash_lab_training_spec.laguna``)."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from dflash_lab.model.heads import Head, register
from dflash_lab.model.layers import RMSNorm

#: The fields and their "off" values.
DEFAULTS = {"aux_hidden_norms": False, "context_input_norm": False, "attention_gate": None,
            "partial_rotary_factor": 1.0}
#: ``attention_gate`` values: softplus(g_proj(x)) per head (broadcast over head_dim) or per
#: (head, head_dim) channel, multiplying the attention output before ``o_proj``.
ATTENTION_GATES = ("per-head", "per-element")


def laguna_features(config: Any) -> dict[str, Any]:
    """The Laguna features that are on (empty for a plain DFlash drafter)."""
    return {k: getattr(config, k) for k, off in DEFAULTS.items() if getattr(config, k) != off}


class Laguna(Head):
    name = "laguna"
    title = "Laguna"
    fields = DEFAULTS
    spec_key = "laguna"
    weight_fields = ("aux_hidden_norms", "attention_gate")  # their norms / g_proj tensors

    def validate(self, config: Any) -> None:
        for key in ("aux_hidden_norms", "context_input_norm"):
            if not isinstance(getattr(config, key), bool):
                config._fail(key, getattr(config, key), "must be true or false")
        if config.attention_gate is not None and config.attention_gate not in ATTENTION_GATES:
            config._fail("attention_gate", config.attention_gate,
                         f"must be null (no gate) or one of {list(ATTENTION_GATES)}")
        factor = config.partial_rotary_factor
        if (isinstance(factor, bool) or not isinstance(factor, int | float)
                or not math.isfinite(factor) or not 0 < factor <= 1
                or int(config.head_dim * factor) % 2):
            config._fail("partial_rotary_factor", factor,
                         f"must be in (0, 1] with int(head_dim * factor) even (head_dim="
                         f"{config.head_dim}): the rotated dims are split in two halves")
        if config.target_hidden_size != config.hidden_size and config.aux_hidden_norms:
            config._fail("target_hidden_size", config.target_hidden_size,
                         f"must equal hidden_size={config.hidden_size} with aux_hidden_norms: "
                         "vLLM's laguna_dflash.py sizes fc and its norms from the target's "
                         "hidden size")

    def serving_keys(self, config: Any) -> dict[str, Any]:
        return {}

    def training_spec(self, config: Any) -> dict[str, Any]:
        on = laguna_features(config)
        return {self.spec_key: on} if on else {}

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """One norm per target-layer slice before fc; per layer the output gate's g_proj
        [Hq (x D per element), H]."""
        h = config.hidden_size
        shapes = {f"aux_hidden_norms.{i}.weight": (h,)
                  for i in range(len(config.target_layer_ids))} if config.aux_hidden_norms else {}
        if config.attention_gate is not None:
            per_dim = config.head_dim if config.attention_gate == "per-element" else 1
            for i in range(config.num_hidden_layers):
                shapes[f"layers.{i}.self_attn.g_proj.weight"] = (
                    config.num_attention_heads * per_dim, h)
        return shapes

    def attach(self, drafter: Any) -> None:
        c = drafter.config
        if c.aux_hidden_norms:
            drafter.aux_hidden_norms = nn.ModuleList(
                RMSNorm(c.hidden_size, c.rms_norm_eps) for _ in c.target_layer_ids)


FEATURE = register(Laguna(), feature=True)
