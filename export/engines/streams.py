"""How each engine sizes ``fc`` and what width of target features it feeds: ``target_hidden_size``.

A drafter's ``fc`` reads len(target_layer_ids) target-layer features of width T each
(``DrafterConfig.target_hidden_size``, written to config.json only when T != hidden_size). T
differs from H for the flattened streams of a multi-stream target (``hc_mult`` = n, T = n*H;
dflash_lab/targets/features.py). Sources (the released wheels):

- vLLM 0.32 ``qwen3_dflash.py`` ``_get_dflash_fc_input_size``: fc input =
  ``(target_hidden_size or hidden_size) * len(aux layers)``; its speculators converter
  (``transformers_utils/configs/speculators/algos.py``, ``update_dflash``) copies the key. The
  target feeds its aux hidden states concatenated (``v1/worker/gpu_model_runner.py``), each H
  wide: multi-stream targets give the mean of their streams (``models/deepseek_v4/*/model.py``
  ``aux_recon.mean(dim=1)``, ``models/deepseek_v41``, ``models/glm5next`` ``hc_contract``). Only
  the MTP drafter reads the flattened [T, n*H] residual (``get_mtp_target_hidden_states``).
- SGLang 0.5.23 ``srt/models/dflash.py``: fc input = ``num_context_features * hidden_size``; it
  never reads ``target_hidden_size``. Its DeepSeek-V4 target feeds the stream mean
  (``srt/models/deepseek_v4.py``, ``mhc_stream_mean``).

So T = H is what both engines serve (a multi-stream target's stream mean); T = n*H loads in vLLM
but cannot run there, and does not load in SGLang: both are refusals here.
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
    if legacy:
        reading.refusal = (f"cannot run the checkpoint's fc {_shape(config, width)} "
                           f"(target_hidden_size={width}): {feed}")
        return
    reading.refusal = (f"loads, then fails at the first draft step: it builds fc "
                       f"{_shape(config, width)} from target_hidden_size={width}, but {feed}")


def sglang_width(config: dict[str, Any], reading: EngineReading) -> None:
    """SGLang sizes fc from hidden_size: a checkpoint whose fc is T != H wide does not load."""
    width, hidden = declared_width(config), int(config["hidden_size"])
    if width != hidden and not reading.refusal:
        reading.refusal = (f"raises at weight loading: srt/models/dflash.py builds fc "
                           f"{_shape(config, hidden)} from hidden_size (it never reads "
                           f"target_hidden_size={width}); the checkpoint's fc is "
                           f"{_shape(config, width)}")
