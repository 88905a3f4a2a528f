"""Target adapter: load a frozen HF target, render conversations, extract features.

Public API: :func:`load_target`, :class:`Target`, :class:`TargetPieces`,
:func:`extract_features`, :func:`tokenize_conversation`, :func:`normalize_conversation`,
and the built-in tiny target in :mod:`dflash_lab.targets.tiny`.
"""

from dflash_lab.targets.chat import (
    TokenizedConversation,
    normalize_conversation,
    tokenize_conversation,
)
from dflash_lab.targets.features import TargetFeatures, extract_features, hf_hidden_state_indices
from dflash_lab.targets.loader import load_target
from dflash_lab.targets.target import Target, TargetPieces

__all__ = [
    "Target", "TargetFeatures", "TargetPieces", "TokenizedConversation", "extract_features",
    "hf_hidden_state_indices", "load_target", "normalize_conversation", "tokenize_conversation",
]
