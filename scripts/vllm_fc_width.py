"""The width vLLM's own DFlash code gives a drafter's ``fc`` input, for serving directories (and
what its speculators converter keeps of ``target_hidden_size``). vLLM side (.venv-vllm); imports
nothing of dflash_lab. Prints one JSON line: {path: value} for every argument.

    .venv-vllm/bin/python -m scripts.vllm_fc_width PATH...

A directory: ``qwen3_dflash._get_dflash_fc_input_size`` on its config as vLLM parses it
(transformers ``AutoConfig``). A ``.json`` file (a speculators config.json): the
``target_hidden_size`` that ``update_dflash`` copies from it (null when it copies none).
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
    print(json.dumps({path: speculators_width(path) if path.endswith(".json")
                      else fc_input_size(path) for path in argv}))


if __name__ == "__main__":
    main(sys.argv[1:])
