"""A test-only checkpoint format, registered the documented way (docs/architecture.md, "Add a
format"): it writes, detects, reads and inspects through the Format interface alone.

The toy layout is a flat config.json (``model_type: "toy_dflash"``) holding only the fields of
:data:`CARRIED`, read back exactly (no rule set resolves its layout), and ``fc`` saved as
``toy_fc``. Engines read it as they read our own layout of the same drafter. What it cannot
carry (sinks, a learned mask, scales, DFlash 2, ...) is refused by the registry's round trip,
with no line written here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_lab.export import formats
from dflash_lab.export.engines import RuleSet
from dflash_lab.export.engines.common import Artifacts, EngineReading
from dflash_lab.model.config import DrafterConfig

MODEL_TYPE = "toy_dflash"
CARRIED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "head_dim", "intermediate_size", "vocab_size", "mask_token_id", "num_target_layers",
           "target_layer_ids", "block_size", "rms_norm_eps", "rope_theta",
           "max_position_embeddings", "layer_types", "sliding_window", "is_causal")
RENAMES = {"fc.weight": "toy_fc.weight"}


def config_of(raw: dict[str, Any], source: str) -> DrafterConfig:
    return DrafterConfig.create(source=source, **{k: raw[k] for k in CARRIED})


class Toy(formats.Format):
    name = "toy"
    kind = "toy directory"
    writable = True
    self_check_how = "toy config.json read as our layout of the same drafter"

    def detect(self, raw: dict[str, Any]) -> bool:
        return raw.get("model_type") == MODEL_TYPE

    def exact_reading(self, raw: dict[str, Any]) -> str | None:
        return "toy: every carried field recorded"

    def read_exact(self, raw: dict[str, Any], file: Path) -> tuple[DrafterConfig, list[str]]:
        return config_of(raw, str(file)), []

    def our_names(self, state: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
        back = {v: k for k, v in RENAMES.items()}
        return {back.get(k, k): v for k, v in state.items()}

    def serving_names(self, state: dict[str, Any]) -> dict[str, Any]:
        return {RENAMES.get(k, k): v for k, v in state.items()}

    def write_config(self, config: DrafterConfig, dtype: str,
                     target_identity: dict[str, Any] | None, vocab_known: bool
                     ) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, **{k: getattr(config, k) for k in CARRIED}}

    def engine_config(self, view: dict[str, Any]) -> dict[str, Any]:
        return config_of(view, "toy view").to_dict()

    def reading(self, rule_set: RuleSet, raw: dict[str, Any], artifacts: Artifacts
                ) -> EngineReading:
        return formats.get(formats.OURS).reading(rule_set, self.engine_config(raw), artifacts)

    def inspect_lines(self, raw: dict[str, Any]) -> list[str]:
        return ["", "Toy format notes:", f"- carries {len(CARRIED)} fields"]

    def report_header(self, raw: dict[str, Any]) -> dict[str, str]:
        return {"format": "toy (tests/export/toy_format.py)"}


TOY = Toy()
