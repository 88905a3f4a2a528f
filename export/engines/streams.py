"""How each engine sizes ``fc`` (len(target_layer_ids) features of width T =
``target_hidden_size``) and feeds it H-wide features (a multi-stream target's stream mean), so
T = n*H is refused (docs/export.md, "Multi-stream targets: target_hidden_size").
"""

from __future__ import annotations

from typing import Any

from dflash_lab.export.engines.common import EngineReading


def declared_width(config: dict[str, Any]) -> int:
    """T as vLLM reads it: ``target_hidden_size`` when set and non-zero, else ``hidden_size``."""
    return int(config.get("target_hidden_size") or config["hidden_size"])


def _shape(config: dict[str, Any], width: int) -> str:
    n = len((config.get("dflash_config") or {}).get("target_layer_ids") or []) or "n"
    return f"[{config['hidden_size']}, {n} x {width}]"


def vllm_width(config: dict[str, Any], reading: EngineReading, legacy: bool = False) -> None:
    """vLLM sizes fc from T but feeds H per layer: T != H loads and cannot run (a refusal like
    the others, so ``--allow_lossy`` still writes the directory, loudly). ``legacy``: vLLM <=
    0.26, whose fc sizing was not read here; its targets feed H all the same."""
    width, hidden = declared_width(config), int(config["hidden_size"])
    if width == hidden or reading.refusal:
        return
    feed = (f"its targets feed {hidden} per layer (a multi-stream target: the mean of its "
            "streams, models/deepseek_v4 aux_recon.mean(dim=1)); train with "
            "target_hidden_size=hidden_size to serve")
    reading.refusal = (f"cannot run the checkpoint's fc {_shape(config, width)} "
                       f"(target_hidden_size={width}): {feed}" if legacy else
                       f"loads, then fails at the first draft step: it builds fc "
                       f"{_shape(config, width)} from target_hidden_size={width}, but {feed}")


def sglang_width(config: dict[str, Any], reading: EngineReading) -> None:
    """SGLang sizes fc from hidden_size: a checkpoint whose fc is T != H wide does not load."""
    width, hidden = declared_width(config), int(config["hidden_size"])
    if width != hidden and not reading.refusal:
        reading.refusal = (f"raises at weight loading: srt/models/dflash.py builds fc "
                           f"{_shape(config, hidden)} from hidden_size (it never reads "
                           f"target_hidden_size={width}); the checkpoint's fc is "
                           f"{_shape(config, width)}")
