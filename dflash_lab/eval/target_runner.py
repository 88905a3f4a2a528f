"""The target side of speculative decoding: incremental forwards over one KV cache, each
returning the logits at the fed positions and, optionally, the drafter's context features there
(``target_layer_ids`` concatenated in order, indexed by
:func:`dflash_lab.targets.features.hf_hidden_state_indices`, as in capture and training).

Shape legend: n fed positions, F = nL*H concatenated features, V vocab. Batch size is 1."""

from __future__ import annotations

import copy
import inspect
from typing import NamedTuple

import torch
from torch import Tensor

from dflash_lab.targets.features import (
    check_feature_width,
    check_layer_ids_for_streams,
    check_target_layer_ids,
    hf_hidden_state_indices,
    layer_features,
)
from dflash_lab.targets.target import text_config


class StepOutput(NamedTuple):
    """``logits_nv`` [n, V] fp32 (rows asked for), ``features_nf`` [1, n, F] or None; on device."""

    logits_nv: Tensor
    features_nf: Tensor | None


class _Snapshot(NamedTuple):
    """What a recurrent cache held before a multi-token forward: its length, copies of the
    layers that cannot be cropped, and the ids fed since (to replay the kept ones)."""

    length: int
    layers: dict[int, object]
    fed: Tensor


def _is_recurrent(layer) -> bool:
    """A cache layer holding a running state (linear attention / SSM) rather than per-position
    keys and values: it cannot be cropped back to an earlier position."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # older transformers: no hybrid cache layers at all
        return False
    return isinstance(layer, LinearAttentionCacheLayerMixin)


class TargetRunner:
    """An HF causal LM with a cache that grows by forwards and shrinks by :meth:`crop`;
    ``target_layer_ids`` (z-lab convention) selects the features (None: none, the baseline).
    Logits come from the model's own forward (Gemma's soft-capping included). Hybrid targets'
    linear layers (Qwen3.5/3.6) are copied before a multi-token forward; :meth:`crop` restores
    them and replays the kept tokens (docs/eval.md, "Report")."""

    def __init__(self, model, target_layer_ids: list[int] | None = None,
                 target_hidden_size: int | None = None):
        if target_layer_ids is not None:
            check_target_layer_ids(target_layer_ids,
                                   int(text_config(model.config).num_hidden_layers))
            check_layer_ids_for_streams(model.config, target_layer_ids)
        #: per-layer feature width (None = H; multi-stream targets: features.layer_features)
        self.width = check_feature_width(model.config, target_hidden_size, "target_hidden_size")
        self.model = model
        self.hidden_indices = (None if target_layer_ids is None
                               else hf_hidden_state_indices(target_layer_ids))
        self.device = model.get_input_embeddings().weight.device
        # transformers 5.x renamed the forward argument ``past_key_values`` to ``cache``.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self.cache = None
        self._recurrent: list[int] = []
        self._snapshot: _Snapshot | None = None

    @property
    def length(self) -> int:
        """Number of positions held in the KV cache."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        layers = getattr(self.cache, "layers", [])
        self._recurrent = [i for i, layer in enumerate(layers) if _is_recurrent(layer)]
        self._snapshot = None
        # Sliding-window layers must keep their past to stay croppable. Recurrent layers are
        # restored from a copy instead: recording would grow their conv state with every token.
        for i, layer in enumerate(layers):
            if i not in self._recurrent and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    @torch.no_grad()
    def forward(self, ids_n: Tensor, last_only: bool = False) -> StepOutput:
        """Feed ``ids_n`` [n] at positions length..length+n-1 and append them to the cache;
        ``last_only`` projects only the last position to logits (prefill, plain decoding)."""
        if self.cache is None:
            self.reset()
        if self._recurrent and ids_n.numel() > 1 and self.length > 0:
            layers = {i: copy.deepcopy(self.cache.layers[i]) for i in self._recurrent}
            self._snapshot = _Snapshot(self.length, layers, ids_n.detach().cpu().view(-1))
        want_features = self.hidden_indices is not None
        extra = {"logits_to_keep": 1 if last_only else 0} if self._keeps_logits else {}
        out = self.model(input_ids=ids_n.view(1, -1).to(self.device), use_cache=True,
                         output_hidden_states=want_features,
                         **{self._cache_kwarg: self.cache}, **extra)
        # Everything is returned on the embedding's device: a target spread over GPUs with
        # device_map ends its forward (LM head, deep layers) on another one.
        logits = out.logits[0].float().to(self.device)
        if last_only:
            logits = logits[-1:]
        features = (torch.cat([layer_features(out.hidden_states[i], self.width).to(self.device)
                               for i in self.hidden_indices], dim=-1) if want_features else None)
        return StepOutput(logits, features)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (drop rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a target cache of length {self.length} to {length}")
        remove = self.length - length
        if not remove:
            return
        if not self._recurrent:  # crop(-n) drops the last n positions (old and new transformers)
            self.cache.crop(-remove)
            return
        snap = self._snapshot
        if snap is None or not snap.length <= length <= snap.length + snap.fed.numel():
            raise ValueError(f"cannot crop this hybrid target's cache to {length}: its linear-"
                             "attention state is only kept from before the last multi-token "
                             "forward")
        drop = self.length - snap.length
        for i, layer in enumerate(self.cache.layers):
            if i in snap.layers:  # recurrent: back to the copy taken before the forward
                self.cache.layers[i] = snap.layers[i]
            else:
                layer.crop(-drop)
        self._snapshot = None
        replay = snap.fed[:length - snap.length]
        if replay.numel():
            self.model(input_ids=replay.view(1, -1).to(self.device), use_cache=True,
                       **{self._cache_kwarg: self.cache},
                       **({"logits_to_keep": 1} if self._keeps_logits else {}))
