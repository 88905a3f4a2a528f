"""The width vLLM's own DFlash code gives a drafter's ``fc`` input, for a serving directory (and
what its speculators converter keeps of ``target_hidden_size``). vLLM side (.venv-vllm); imports
nothing of dflash_lab. Prints one JSON line.

    .venv-vllm/bin/python -m scripts.vllm_fc_width EXPORT_DIR [SPECULATORS_CONFIG_JSON]

``fc_input_size``: ``qwen3_dflash._get_dflash_fc_input_size`` on the directory's config as vLLM
parses it (transformers ``AutoConfig``); ``speculators_target_hidden_size``: the value
``update_dflash`` copies from a speculators config.json (null when none is given).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace


def fc_input_size(export_dir: str) -> int:
    """``_get_dflash_fc_input_size`` of the draft: only ``speculative_config.draft_model_config
    .hf_config`` is read, so the rest of the VllmConfig is not built."""
    from transformers import AutoConfig
    from vllm.model_executor.models.qwen3_dflash import _get_dflash_fc_input_size

    hf_config = AutoConfig.from_pretrained(export_dir)
    draft = SimpleNamespace(hf_config=hf_config)
    return int(_get_dflash_fc_input_size(SimpleNamespace(
        speculative_config=SimpleNamespace(draft_model_config=draft))))


def speculators_width(config_json: str) -> int | None:
    """``update_dflash``'s ``target_hidden_size`` for a speculators config.json."""
    from vllm.transformers_utils.configs.speculators.algos import update_dflash

    converted: dict = {}
    update_dflash(json.loads(Path(config_json).read_text()), converted)
    return converted.get("target_hidden_size")


def main(argv: list[str]) -> None:
    out = {"fc_input_size": fc_input_size(argv[0]),
           "speculators_target_hidden_size": speculators_width(argv[1]) if len(argv) > 1
           else None}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
