"""Offline speculative evaluation of DFlash drafters (``dflash-eval``, docs/eval.md).

Public API: :func:`speculative_generate` / :func:`baseline_generate` (one prompt),
:func:`evaluate_prompts` (many prompts, any :class:`Proposer`), :class:`DFlashProposer`,
:func:`load_drafter`, :func:`feature_eval` (captured shards), :func:`write_report`.
"""

from dflash_lab.eval.evaluate import evaluate_prompts, run_features, run_generate
from dflash_lab.eval.loading import LoadedDrafter, load_drafter
from dflash_lab.eval.loop import DecodeSettings, Generation, baseline_generate, speculative_generate
from dflash_lab.eval.offline_tau import feature_eval
from dflash_lab.eval.proposer import DFlashProposer, Proposer
from dflash_lab.eval.report import generation_report, write_report
from dflash_lab.eval.target_runner import TargetRunner

__all__ = [
    "DFlashProposer", "DecodeSettings", "Generation", "LoadedDrafter", "Proposer", "TargetRunner",
    "baseline_generate", "evaluate_prompts", "feature_eval", "generation_report", "load_drafter",
    "run_features", "run_generate", "speculative_generate", "write_report",
]
