"""Offline speculative evaluation of DFlash drafters (``dflash-eval``, docs/eval.md, "Python
API"). The public names are imported on first use (module ``__getattr__``), so importing one
light module (``eval.sampling``: a head's draft walk) does not import Hydra with the command.
"""

import importlib
from typing import Any

_HOME = {
    "evaluate_prompts": "evaluate", "run_features": "evaluate", "run_generate": "evaluate",
    "LoadedDrafter": "loading", "load_drafter": "loading", "DecodeSettings": "loop",
    "Generation": "loop", "baseline_generate": "loop", "speculative_generate": "loop",
    "feature_eval": "offline_tau", "DFlashProposer": "proposer", "Proposer": "proposer",
    "generation_report": "report", "write_report": "report", "TargetRunner": "target_runner",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
