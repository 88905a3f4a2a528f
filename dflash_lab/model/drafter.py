"""DFlashDrafter: fused target features -> draft layers -> norm, over the target's frozen embedding.

Two call paths share every weight and the attention code: training (:meth:`forward`: ``S``
context positions and ``N`` anchored blocks packed in one sequence, context K/V once per layer,
all blocks in one call) and inference (:meth:`extend_context`, ``ContextCache.crop``,
:meth:`draft`: per-layer context K/V cached, one block per sequence right after the context).
The target's embedding and LM head are passed in, never in ``state_dict()``, whose keys are the
serving layout (dflash.md section 4). Output: the final-normed hidden state of every slot; the
unary logits are :meth:`unary_logits` (``lm_head(hidden) * output_multiplier``, softcapped; the
loss chunks that projection). A head's modules are attached by the head (model/heads.py
``attach``, ``layer_modules``) and read by its hooks only; :meth:`propose` drafts through its
``draft``.

Shape legend: Bt batch, S context slots, N blocks, B block size, Q = N*B, H hidden, F = nL*H
concatenated target features, Hkv key/value heads, D head dim, V vocab, T = B-1 drafted
slots. Suffix letters (``x_bnph``): docs/architecture.md; ``b`` is the batch, ``p`` a position
in a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_lab.attention.base import AttentionBackend, get_backend
from dflash_lab.attention.mask import BlockLayout, document_starts
from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.layers import DraftLayer, RMSNorm, RotaryEmbedding, scale_logits


@dataclass
class ContextCache:
    """Per-layer context K/V [Bt, Hkv, C, D] of the committed positions 0..C-1, and their
    fused rows [Bt, C, H] only for a head whose ``draft`` reads the last (``reads_context``:
    ``context_h``); None otherwise."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    rows: Tensor | None = None

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (after a rejected draft)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a context cache of length {self.length} to {length}")
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]
        self.rows = None if self.rows is None else self.rows[:, :length]


class DFlashDrafter(nn.Module):
    """The drafter module. ``backend``: attention backend name (sdpa | flex | flash | auto)."""

    def __init__(self, config: DrafterConfig, backend: str = "sdpa"):
        super().__init__()
        self.config = config
        self.backend_name = backend
        self.fc = nn.Linear(config.num_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.mask_embedding = (nn.Parameter(torch.zeros(config.hidden_size))
                               if config.learned_mask_embedding else None)
        # what the head and the features add (model/heads.py ``attach``): the head's own
        # modules; Laguna's aux_hidden_norms (one RMSNorm per target-layer slice before fc), a
        # draft vocabulary's lm_head [N, H] with d2t [N] / t2d [V]
        self.aux_hidden_norms = self.lm_head = None
        #: the head's walk settings at serving time (``Head.walk_with``; eval's drafter.walk)
        self.walk_settings = dict(config.head.walk_settings)
        for part in config.parts:
            part.attach(self)
        self._specs = config.layer_specs()
        self.activation_checkpointing = False  # recompute each layer in backward (saves memory)
        self.static_shapes = False  # same attention shapes every step (set by compile_layers)
        self.warm_started = False  # weights loaded from a trained drafter (drafter.init_from)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        # apply() visits children first: a head's module re-initialises its own Linear after
        if getattr(module, "owns_init", False):
            module.reset_parameters()

    # ------------------------------------------------------------------ draft vocabulary
    @property
    def draft_vocab_set(self) -> bool:
        """Whether the draft vocabulary's tokens are chosen (``t2d`` marks N of them)."""
        return self.lm_head is not None and int(self.t2d.sum()) == self.config.draft_vocab_size

    def set_draft_vocab(self, token_ids: Tensor, target_lm_head: nn.Module) -> None:
        """Choose the draft vocabulary: ``token_ids`` [N] distinct target ids (any order; kept
        ascending, so draft id i maps to the i-th smallest). The head becomes the target head's
        rows of those tokens (frozen, as the full head is); ``d2t[i]`` = target id - i (vLLM's
        offsets: target = i + d2t[i]), ``t2d`` [V] marks the chosen ids."""
        n, vocab = self.config.draft_vocab_size, self.config.vocab_size
        ids = torch.unique(token_ids.detach().long().cpu())
        if self.lm_head is None or ids.numel() != n or ids.numel() != token_ids.numel():
            raise ValueError(f"set_draft_vocab: need {n} distinct token ids (draft_vocab_size), "
                             f"got {token_ids.numel()} ({ids.numel()} distinct)")
        if int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ValueError(f"set_draft_vocab: token ids must be in [0, {vocab})")
        with torch.no_grad():
            weight = target_lm_head.weight
            self.lm_head.weight.copy_(weight[ids.to(weight.device)].to(self.lm_head.weight))
            self.d2t.copy_(ids - torch.arange(n))
            self.t2d.zero_()
            self.t2d[ids.to(self.t2d.device)] = True

    def draft_token_ids(self) -> Tensor:
        """The target id of every draft id [N] (``i + d2t[i]``)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def head(self, target_lm_head: nn.Module) -> nn.Module:
        """The head the unary logits come from: the target's, or the drafter's own [N, H] one."""
        return target_lm_head if self.lm_head is None else self.lm_head

    def to_draft_ids(self, target_ids: Tensor) -> Tensor:
        """Target ids (any shape, negatives kept) -> draft ids; -1 where the token is outside
        the draft vocabulary (it can never be drafted). Identity without a draft vocabulary."""
        if self.lm_head is None:
            return target_ids
        table = torch.cumsum(self.t2d.long(), 0) - 1  # draft id of every in-vocab target id
        table = torch.where(self.t2d, table, torch.full_like(table, -1))
        safe = target_ids.clamp(min=0)
        return torch.where(target_ids >= 0, table[safe], target_ids)

    def init_mask_embedding(self, embed_tokens: nn.Embedding) -> None:
        """The learned mask embedding starts as the target's ``mask_token_id`` row (warm: kept)."""
        if self.mask_embedding is not None and not self.warm_started:
            with torch.no_grad():
                self.mask_embedding.copy_(embed_tokens.weight[self.config.mask_token_id])

    def compile_layers(self, **compile_kwargs: Any) -> None:
        """``torch.compile`` each draft layer in place (state_dict keys keep the serving names).
        The sdpa backend's key tiles, whose sizes follow the sampled anchors, are turned off:
        compiled layers need the same attention shapes every step (else they recompile)."""
        self.static_shapes = True
        for layer in self.layers:
            layer.compile(**compile_kwargs)

    # ------------------------------------------------------------------ shared pieces
    def backend(self, device: torch.device, packed: bool) -> AttentionBackend:
        """The attention backend for this call's layout kind: ``packed`` (many blocks per row:
        training, validation, features-mode eval) or the one-block inference layout. ``auto``
        resolves by layout (attention/base.py), so validation never reaches flash."""
        return get_backend(self.backend_name, device, packed=packed,
                           static_shapes=self.static_shapes)

    def fuse(self, target_hidden_bsf: Tensor) -> Tensor:
        """Concatenated target features [Bt, S, F] -> fused context [Bt, S, H]."""
        if target_hidden_bsf.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"target features have width {target_hidden_bsf.shape[-1]}, the drafter expects "
                f"{self.fc.in_features} = {len(self.config.target_layer_ids)} layers x "
                f"{self.config.target_hidden_size} (target_hidden_size); check target_layer_ids "
                "and the target model")
        x_bsf = target_hidden_bsf.to(self.fc.weight.dtype)
        if self.aux_hidden_norms is not None:  # vLLM's combine_hidden_states for Laguna
            slices = x_bsf.chunk(len(self.aux_hidden_norms), dim=-1)
            x_bsf = torch.cat([norm(s) for norm, s in zip(self.aux_hidden_norms, slices,
                                                           strict=True)], dim=-1)
        return self.hidden_norm(self.fc(x_bsf))

    def block_inputs(self, anchor_ids_bn: Tensor, embed_tokens: nn.Module) -> Tensor:
        """Block embeddings [Bt, N*B, H]: slot 0 = anchor token, slots 1.. = MASK."""
        bt, n = anchor_ids_bn.shape
        b = self.config.block_size
        ids = anchor_ids_bn.new_full((bt, n, b), self.config.mask_token_id)
        ids[:, :, 0] = anchor_ids_bn
        x = embed_tokens(ids).to(self.fc.weight.dtype)
        if self.mask_embedding is not None:
            # Every id equal to MASK, slot 0 included, as vLLM substitutes it (a MASK anchor is
            # never produced by a target, but the rule is the engine's, not the slot's).
            is_mask = (ids == self.config.mask_token_id)[..., None]
            x = torch.where(is_mask, self.mask_embedding.to(x.dtype), x)
        if self.config.input_embedding_scale != 1.0:
            # every slot, the learned mask row too: engines merge it into the table first
            x = x * self.config.input_embedding_scale
        return x.flatten(1, 2)

    def _run_layers(self, x_bqh: Tensor, layout: BlockLayout, ctx_kv: list[tuple[Tensor, Tensor]],
                    cos_sin: tuple[Tensor, Tensor], packed: bool) -> Tensor:
        backend = self.backend(x_bqh.device, packed)
        prepared: dict[Any, Any] = {}
        for spec in self._specs:  # one mask per distinct layer spec, shared by layers
            if spec not in prepared:
                prepared[spec] = backend.prepare(layout, spec)
        for layer, spec, (k, v) in zip(self.layers, self._specs, ctx_kv, strict=True):
            if self.activation_checkpointing and torch.is_grad_enabled():
                x_bqh = checkpoint(layer, x_bqh, k, v, cos_sin, backend, prepared[spec],
                                   use_reentrant=False)
            else:
                x_bqh = layer(x_bqh, k, v, cos_sin, backend, prepared[spec])
        return self.norm(x_bqh)

    # ------------------------------------------------------------------ training path
    def forward(self, target_hidden_bsf: Tensor, input_ids_bs: Tensor, anchors_bn: Tensor,
                embed_tokens: nn.Module, document_ids_bs: Tensor | None = None) -> Tensor:
        """Packed training forward: target_hidden_bsf [Bt, S, F], input_ids_bs [Bt, S], anchors_bn
        [Bt, N] (sorted; padded entries may repeat a valid anchor: no loss). document_ids_bs
        [Bt, S]: packed rows' document of each token (each gets RoPE positions from 0 and only its
        own context, attention/mask.py, as alone in a row); None: one per row. Returns hidden
        [Bt, N, B, H]; slot t of block j predicts the token at anchors[j] + t."""
        bt, s, _ = target_hidden_bsf.shape
        ctx = self.fuse(target_hidden_bsf)
        positions = torch.arange(s, device=ctx.device)
        starts_bn = None
        if document_ids_bs is not None:
            starts_bs = document_starts(document_ids_bs)
            positions = positions - starts_bs  # [Bt, S]: restart at each document
            starts_bn = starts_bs.gather(1, anchors_bn)
        layout = BlockLayout(anchors_bn, s, self.config.block_size, doc_starts_bn=starts_bn)
        ctx_cs = self.rotary(positions, ctx.dtype)
        ctx_kv = [layer.context_kv(ctx, ctx_cs) for layer in self.layers]
        x = self.block_inputs(input_ids_bs.gather(1, anchors_bn), embed_tokens)
        blk_cs = self.rotary(layout.positions_bq(), x.dtype)
        out = self._run_layers(x, layout, ctx_kv, blk_cs, packed=True)
        return out.view(bt, layout.num_blocks, self.config.block_size, -1)

    # ------------------------------------------------------------------ inference path
    def new_cache(self) -> ContextCache:
        return ContextCache()

    @torch.no_grad()
    def extend_context(self, cache: ContextCache, target_hidden_bnf: Tensor) -> None:
        """Append the features of the next n committed positions [Bt, n, F] to the cache."""
        start = cache.length
        ctx = self.fuse(target_hidden_bnf)
        positions = torch.arange(start, start + ctx.shape[1], device=ctx.device)
        cs = self.rotary(positions, ctx.dtype)
        new = [layer.context_kv(ctx, cs) for layer in self.layers]
        if self.config.head.reads_context:
            cache.rows = ctx if cache.rows is None else torch.cat([cache.rows, ctx], dim=1)
        if cache.keys:
            new = [(torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2))
                   for old_k, old_v, (k, v) in zip(cache.keys, cache.values, new, strict=True)]
        cache.keys, cache.values = [k for k, _ in new], [v for _, v in new]

    # ------------------------------------------------------------------ tokens from hidden states
    def unary_logits(self, hidden_xh: Tensor, lm_head: nn.Module) -> Tensor:
        """``lm_head(hidden) * output_multiplier``, tanh-softcapped if configured: [x, V] over
        the TARGET vocabulary. With a draft vocabulary the drafter's own head gives [x, N] and
        every other token gets -inf, as vLLM's ``compute_logits`` scatters them."""
        if self.lm_head is not None:  # the drafter's own head, in the drafter's dtype
            hidden_xh = hidden_xh.to(self.lm_head.weight.dtype)
        logits = scale_logits(self.head(lm_head)(hidden_xh), self.config.output_multiplier,
                              self.config.final_logit_softcapping)
        if self.lm_head is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_token_ids()] = logits
        return full

    @torch.no_grad()
    def propose(self, hidden_bph: Tensor, anchor_ids_b: Tensor, lm_head: nn.Module,
                embed_tokens: nn.Module | None = None, context_bh: Tensor | None = None) -> Tensor:
        """Greedy draft tokens [Bt, num_draft_tokens] from :meth:`draft`'s hidden [Bt, B, H]: the
        head's greedy walk from each row's anchor (``Head.draft`` at T = 0), else the unary
        argmax. ``embed_tokens`` / ``context_bh``: for a walk that reads them (``Head.draft``)."""
        head = self.config.head
        slots = hidden_bph[:, self.config.first_draft_slot:]
        # float32 logits from hidden in the head's dtype: what DFlashProposer's walk reads
        unary = self.unary_logits(slots.to(lm_head.weight.dtype), lm_head).float()
        rows = hidden_bph if head.block_rows else slots  # XPress: the block's B rows
        walked = [head.draft(self, rows[i], unary[i], int(anchor_ids_b[i]), 0.0,
                             "exact_match", None, embed_tokens,
                             None if context_bh is None else context_bh[i])
                  for i in range(unary.shape[0])]
        if any(w is None for w in walked):
            return unary.argmax(dim=-1)
        return torch.stack([tokens for tokens, _ in walked])

    @torch.no_grad()
    def draft(self, cache: ContextCache, anchor_ids_b: Tensor, embed_tokens: nn.Module) -> Tensor:
        """One block per sequence, anchored at position C = cache.length -> hidden [Bt, B, H]."""
        if cache.length == 0:
            raise ValueError("draft() needs at least one cached context position; "
                             "call extend_context() with the prompt's target features first")
        bt = anchor_ids_b.shape[0]
        anchors = torch.full((bt, 1), cache.length, dtype=torch.long, device=anchor_ids_b.device)
        layout = BlockLayout(anchors, cache.length, self.config.block_size)
        x = self.block_inputs(anchor_ids_b[:, None], embed_tokens)
        cs = self.rotary(layout.positions_bq(), x.dtype)
        return self._run_layers(x, layout, list(zip(cache.keys, cache.values)), cs, packed=False)
