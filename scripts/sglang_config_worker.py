"""Run SGLang's own config-level DFlash code on exported config.json files; print JSON.

Runs inside the SGLang venv (``make sglang-venv``: sglang 0.5.23, torch 2.14.1), started by
scripts/check_sglang_config.py, which does the comparison. Nothing here imports dflash_lab or
export: what is printed is what SGLang's code computes, so the check compares two independent
readings.

Input: argv[1] is a JSON file ``[{"name": ..., "dir": ..., "target_architecture": ...}]``; each
``dir`` holds a ``config.json``. Output (stdout, one JSON object keyed by name), per export:

- ``layers``: ``[[window_left, attention_type], ...]`` from ``sglang.srt.models.dflash.
  _get_dflash_layer_attention_params(config, i)`` for every draft layer, the config loaded with
  ``AutoConfig.from_pretrained`` as SGLang's model loader does;
- ``draft``: ``parse_dflash_draft_config(draft_hf_config=config)`` (speculative/dflash_utils.py)
  as a dict (block size, mask id, target layer ids, sinks flag, scales, DFlash 2 conv/selector);
- ``model_class``: whether ``architectures[0]`` is one of models/dflash.py's ``EntryClass``;
- ``sinks_built``: DFlashAttention's source builds the ``attention_sink_bias`` parameter from
  ``draft_cfg.attention_sink_bias`` and passes it as ``sinks`` (a static reading of the code);
- ``merges_mask``: ``DFlashWorkerV2._maybe_merge_trained_mask_embedding`` exists (the only DFlash
  worker of 0.5.23 merges ``mask_embedding.pt`` into the target's embedding table);
- ``target``: the target class's DFlash hooks and the scale its embedding module applies
  (``embed_tokens = *ScaledWordEmbedding(..., embed_scale=...hidden_size**0.5)`` in the source
  of the class's module or of the SGLang model modules it imports from), or an error.

Any exception of SGLang's own code is reported as ``error`` for that part, never raised.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

_SCALED_EMBEDDING = re.compile(r"embed_tokens\s*=\s*\w*ScaledWordEmbedding\((?P<args>[^)]*)\)")


def _guard(fn, *args) -> dict[str, Any]:
    """``{"value": fn(*args)}``, or ``{"error": "Type: message"}`` when SGLang's code raises."""
    try:
        return {"value": fn(*args)}
    except Exception as e:  # noqa: BLE001 - an engine refusal is a result here
        return {"error": f"{type(e).__name__}: {e}"}


def _layers(config) -> list[list[Any]]:
    from sglang.srt.models.dflash import _get_dflash_layer_attention_params

    out = []
    for i in range(int(config.num_hidden_layers)):
        window_left, attn_type = _get_dflash_layer_attention_params(config, i)
        out.append([int(window_left), attn_type.name])
    return out


def _draft(config) -> dict[str, Any]:
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    return dataclasses.asdict(parse_dflash_draft_config(draft_hf_config=config))


def _lilicorr(config) -> dict[str, Any] | None:
    """``_parse_lilicorr_config`` (speculative/lilicorr_utils.py) of the dflash_config, as
    ``lilicorr_*`` keys; None when it builds no LiLiCorr head."""
    from sglang.srt.speculative.lilicorr_utils import _parse_lilicorr_config

    parsed = _parse_lilicorr_config(dict(getattr(config, "dflash_config", None) or {}))
    keys = ("candidate_topk", "hidden_size", "num_layers", "num_heads", "mlp_ratio",
            "factor_dim", "vector_eps", "logit_scale")
    return None if parsed is None else {f"lilicorr_{k}": getattr(parsed, k) for k in keys}


def _model_class(config) -> dict[str, Any]:
    from sglang.srt.models import dflash, lilicorr

    names = [c.__name__ for module in (dflash, lilicorr) for c in (
        module.EntryClass if isinstance(module.EntryClass, list) else [module.EntryClass])]
    arch = (config.architectures or [None])[0]
    return {"architecture": arch, "known": arch in names, "entry_classes": names}


def _sinks_built() -> bool:
    from sglang.srt.models.dflash import DFlashAttention

    src = inspect.getsource(DFlashAttention)
    return "draft_cfg.attention_sink_bias" in src and "sinks=self.attention_sink_bias" in src


def _merges_mask() -> bool:
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    return hasattr(DFlashWorkerV2, "_maybe_merge_trained_mask_embedding")


def _target_class(arch: str):
    """The SGLang model class named ``arch``: the models/ module defining it, imported alone
    (the registry would import every model)."""
    import sglang.srt.models as models

    for path in sorted(Path(list(models.__path__)[0]).glob("*.py")):
        if re.search(rf"^class {re.escape(arch)}\(", path.read_text(), re.M):
            module = importlib.import_module(f"sglang.srt.models.{path.stem}")
            return getattr(module, arch)
    raise LookupError(f"no class {arch} in sglang.srt.models")


def _embedding_scale(cls, hidden_size: int) -> float | None:
    """The factor the target's embedding module multiplies rows by (1.0 for a plain
    VocabParallelEmbedding); None when a scaled module is built with a scale we cannot read."""
    module = sys.modules[cls.__module__]
    names = {module.__name__} | {getattr(v, "__module__", "") for v in vars(module).values()}
    sources = [inspect.getsource(sys.modules[n]) for n in sorted(names)
               if n.startswith("sglang.srt.models.") and n in sys.modules]
    for src in sources:
        match = _SCALED_EMBEDDING.search(src)
        if match:
            return math.sqrt(hidden_size) if "hidden_size**0.5" in match["args"] else None
    return 1.0


def _target(arch: str | None, hidden_size: int) -> dict[str, Any]:
    if arch is None:
        return {"error": "no target architecture given"}
    cls = _target_class(arch)
    return {"capture_hook": hasattr(cls, "set_dflash_layers_to_capture"),
            "noise_scale_hook": hasattr(cls, "get_dflash_noise_embedding_scale"),
            "embedding_scale": _embedding_scale(cls, hidden_size)}


def read_one(directory: str, target_architecture: str | None) -> dict[str, Any]:
    """Everything SGLang's code reads from one export directory's config.json."""
    from transformers import AutoConfig

    loaded = _guard(AutoConfig.from_pretrained, directory)
    if "error" in loaded:
        return {"load": loaded}
    config = loaded["value"]
    return {"layers": _guard(_layers, config), "draft": _guard(_draft, config),
            "lilicorr": _guard(_lilicorr, config),
            "model_class": _guard(_model_class, config), "sinks_built": _guard(_sinks_built),
            "merges_mask": _guard(_merges_mask),
            "target": _guard(_target, target_architecture, int(config.hidden_size))}


def main() -> None:
    import sglang

    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = {"sglang_version": sglang.__version__,
           "exports": {j["name"]: read_one(j["dir"], j.get("target_architecture"))
                       for j in jobs}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
