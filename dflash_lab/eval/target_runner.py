"""The target side of speculative decoding: incremental forwards over one KV cache.

Every forward returns the target's logits at the fed positions and (optionally) the drafter's
context features there: the hidden states at ``target_layer_ids`` concatenated in that order,
indexed with :func:`dflash_lab.target.features.hf_hidden_state_indices` (the one definition of
the layer-id convention, shared with capture and training).

Shape legend: n fed positions, F = nL*H concatenated features, V vocab. Batch size is 1.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import Tensor

from dflash_lab.target.features import check_target_layer_ids, hf_hidden_state_indices


class StepOutput(NamedTuple):
    """``logits_nv`` [n, V] float32 (rows asked for), ``features_nf`` [1, n, F] or None, both on
    the runner's device."""

    logits_nv: Tensor
    features_nf: Tensor | None


class TargetRunner:
    """An HF causal LM with a cache that grows by forwards and shrinks by :meth:`crop`.

    ``target_layer_ids`` (z-lab convention) selects the features; None disables them (baseline).
    """

    def __init__(self, model, target_layer_ids: list[int] | None = None):
        if target_layer_ids is not None:
            check_target_layer_ids(target_layer_ids, int(model.config.num_hidden_layers))
        self.model = model
        self.hidden_indices = (None if target_layer_ids is None
                               else hf_hidden_state_indices(target_layer_ids))
        self.device = model.get_input_embeddings().weight.device
        # transformers 5.x renamed the forward argument ``past_key_values`` to ``cache``.
        params = inspect.signature(model.base_model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.cache = None

    @property
    def length(self) -> int:
        """Number of positions held in the KV cache."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()  # sliding-window layers must stay croppable

    @torch.no_grad()
    def forward(self, ids_n: Tensor, last_only: bool = False) -> StepOutput:
        """Feed ``ids_n`` [n] at positions length..length+n-1 and append them to the cache.

        ``last_only`` projects only the last position to logits (prefill, plain decoding).
        """
        if self.cache is None:
            self.reset()
        want_features = self.hidden_indices is not None
        out = self.model.base_model(input_ids=ids_n.view(1, -1).to(self.device), use_cache=True,
                                    output_hidden_states=want_features,
                                    **{self._cache_kwarg: self.cache})
        last = out.last_hidden_state[0]
        if last_only:
            last = last[-1:]
        # Everything is returned on the embedding's device: a target spread over GPUs with
        # device_map ends its forward (LM head, deep layers) on another one.
        head = self.model.get_output_embeddings()
        logits = head(last.to(head.weight.device)).float().to(self.device)
        features = None
        if want_features:
            features = torch.cat([out.hidden_states[i].to(self.device)
                                  for i in self.hidden_indices], dim=-1)
        return StepOutput(logits, features)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (drop rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a target cache of length {self.length} to {length}")
        remove = self.length - length
        if remove:  # crop(-n) drops the last n positions (old and new transformers alike)
            self.cache.crop(-remove)
