"""Qwen3-style pieces of a draft layer: RMSNorm, RoPE, attention over [context ; block], SwiGLU.

A head may wrap both sublayers in modules of its own (DFlash 2's grouped dynamic causal conv,
heads/dflash2.py, through ``Head.layer_modules``); the context K/V never pass through them
(they are not block slots). The unary logits' scaling (:func:`scale_logits`) and the blocked
top-K over a vocabulary (:func:`vocab_topk`) are here too: the loss and the heads share them.

Shape legend: Bt batch, S context slots, Q block queries (N*B), H hidden, Hq/Hkv query and
key/value heads, D head dim. Context K/V are computed once per layer per step (training) or
once per committed token (inference cache) and passed in; the block computes its own q/k/v.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.rope import rope_tables


def scale_logits(logits_xv: Tensor, output_multiplier: float,
                 softcap: float | None) -> Tensor:
    """Unary logits: ``logits * output_multiplier``, then ``c * tanh(logits / c)`` if capped. Both
    are monotone, so the argmax is unchanged; they matter for sampling and the losses."""
    if output_multiplier != 1.0:
        logits_xv = logits_xv * output_multiplier
    if softcap is not None:
        logits_xv = torch.tanh(logits_xv / softcap) * softcap
    return logits_xv


#: Vocabulary rows per block of :func:`vocab_topk` (the per-block maxima it ranks first).
TOPK_BLOCK = 64


def vocab_topk(logits: Tensor, k: int, dim: int = -1) -> tuple[Tensor, Tensor]:
    """``logits.topk(k, dim)`` (values and ids, best first) for a 2-D tensor over a large
    vocabulary, ~5-10x faster on CPU than ``torch.topk`` there (49k-152k entries; benchmark 2).
    Exact: of blocks of ``TOPK_BLOCK`` entries, every top-k entry lies in one whose maximum is
    among the k largest block maxima (any other block has k blocks above it, each holding an
    entry at least as large), so the top-k of those k blocks (plus the ragged tail) is the top-k.
    Values equal ``torch.topk``'s; ids too, except which of exactly equal logits is kept (also
    unspecified there). ``dim``: the vocabulary dim, 0 ([V, m], vocab-major chunks) or -1."""
    if logits.dim() != 2 or dim not in (0, 1, -1):
        raise ValueError(f"vocab_topk takes a 2-D tensor and dim 0 or -1, got "
                         f"{tuple(logits.shape)} and dim={dim}")
    x_vm = logits if dim == 0 else logits.t()
    num_blocks = x_vm.shape[0] // TOPK_BLOCK
    if num_blocks < 16 * k:  # small vocabularies: torch.topk is as fast
        return logits.topk(k, dim=dim)
    m = x_vm.shape[1]
    body = num_blocks * TOPK_BLOCK
    best_km = x_vm[:body].reshape(num_blocks, TOPK_BLOCK, m).amax(dim=1).topk(k, dim=0).indices
    offsets = torch.arange(TOPK_BLOCK, device=logits.device)
    rows = (best_km[:, None] * TOPK_BLOCK + offsets[None, :, None]).reshape(k * TOPK_BLOCK, m)
    if body < x_vm.shape[0]:  # the ragged tail is always a candidate
        tail = torch.arange(body, x_vm.shape[0], device=logits.device)
        rows = torch.cat([rows, tail[:, None].expand(-1, m)])
    values, pos = x_vm.gather(0, rows).topk(k, dim=0)
    ids = rows.gather(0, pos)
    return (values, ids) if dim == 0 else (values.t(), ids.t())


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as Qwen3), weight initialised to ones."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables for any absolute position (HF Qwen3 half-rotation convention; no cache, beyond
    ``max_position_embeddings`` too). inv_freq and the cos/sin scale (YaRN's attention factor,
    else 1) come from model/rope.py, which defines every rope_type as the engines compute it;
    the scale multiplies cos and sin as in transformers' ``Qwen3RotaryEmbedding``."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        # partial rotary (Laguna): the tables cover the rotated dims only, as vLLM's get_rope
        # computes inv_freq over rotary_dim = int(head_dim * partial_rotary_factor)
        inv_freq, self.attention_scaling = rope_tables(
            config.rope_theta, config.rotary_dim, config.rope_scaling,
            config.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [..., L] long -> (cos, sin) each [..., L, D] in ``dtype`` (fp32 math)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x_bhld: Tensor, cos_sin: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate x [Bt, heads, L, D] with cos/sin [L, R] or [Bt, L, R], R <= D: the first R dims
    rotate in two halves (neox style), the other D - R pass through (partial rotary)."""
    cos, sin = (t.unsqueeze(-3) for t in cos_sin)
    r = cos.shape[-1]
    x_rot, x_pass = x_bhld[..., :r], x_bhld[..., r:]
    half = r // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    return out if r == x_bhld.shape[-1] else torch.cat([out, x_pass], dim=-1)


class DraftAttention(nn.Module):
    """Queries from the block; keys/values from [fused context ; block], per-layer projections."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.attention_sink_bias = (nn.Parameter(torch.zeros(self.num_heads))
                                    if config.attention_sink_bias else None)
        self.gate_per_head = config.attention_gate == "per-head"
        self.g_proj = None if config.attention_gate is None else nn.Linear(
            h, self.num_heads * (1 if self.gate_per_head else d), bias=False)

    def _heads(self, x_blh: Tensor, heads: int) -> Tensor:
        return x_blh.view(*x_blh.shape[:2], heads, self.head_dim).transpose(1, 2)

    def kv(self, x_blh: Tensor, cos_sin: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Keys (k_norm + RoPE) and values [Bt, Hkv, L, D] of context or block inputs."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x_blh), self.num_kv_heads)), cos_sin)
        return k, self._heads(self.v_proj(x_blh), self.num_kv_heads)

    def forward(self, x_bqh: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                cos_sin: tuple[Tensor, Tensor], backend: Any, prepared: Any) -> Tensor:
        """x [Bt, Q, H] (already input-normed); ctx_k/ctx_v [Bt, Hkv, S, D] -> [Bt, Q, H]."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x_bqh), self.num_heads)), cos_sin)
        blk_k, blk_v = self.kv(x_bqh, cos_sin)
        k = torch.cat([ctx_k.to(blk_k.dtype), blk_k], dim=2)
        v = torch.cat([ctx_v.to(blk_v.dtype), blk_v], dim=2)
        out = backend.attend(q, k, v, prepared, scale=self.scale, sink_h=self.attention_sink_bias)
        return self.o_proj(self._gated(out.transpose(1, 2), x_bqh).flatten(2))

    def _gated(self, out_bqhd: Tensor, x_bqh: Tensor) -> Tensor:
        """Laguna's output gate: out [Bt, Q, Hq, D] * softplus(g_proj(x)) (fp32 softplus, as
        vLLM's ``LagunaAttention``), one gate per head or per (head, dim); no gate: out."""
        if self.g_proj is None:
            return out_bqhd
        gate = F.softplus(self.g_proj(x_bqh).float()).to(out_bqhd.dtype)
        gate = gate[..., None] if self.gate_per_head else gate.view(out_bqhd.shape)
        return out_bqhd * gate


class SwiGLU(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer. The context gets no query, no MLP and no input norm unless
    ``config.context_input_norm`` (Laguna). DFlash 2's ``attention_conv`` / ``mlp_conv`` convolve
    each sublayer's normed input (``prepare``) and output (``finish``) along the block slots."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = SwiGLU(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the head's modules of a layer (model/heads.py ``layer_modules``; DFlash 2's convs)
        self.attention_conv = self.mlp_conv = None
        for part in config.parts:
            for name, module in part.layer_modules(config).items():
                setattr(self, name, module)
        self.context_input_norm = config.context_input_norm

    def context_kv(self, ctx_bsh: Tensor, cos_sin: tuple[Tensor, Tensor]
                   ) -> tuple[Tensor, Tensor]:
        """Context keys/values [Bt, Hkv, S, D] of the fused context [Bt, S, H]: straight from
        it (DFlash), or through this layer's ``input_layernorm`` first (Laguna, whose vLLM
        ``_project_context_kv`` norms the context with every layer's input norm)."""
        if self.context_input_norm:
            ctx_bsh = self.input_layernorm(ctx_bsh)
        return self.self_attn.kv(ctx_bsh, cos_sin)

    @staticmethod
    def _sublayer(fn: Any, conv: nn.Module | None, normed_bqh: Tensor) -> Tensor:
        if conv is None:
            return fn(normed_bqh)
        conv_in, dyn = conv.prepare(normed_bqh)
        return conv.finish(fn(conv_in), dyn)

    def forward(self, x_bqh: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                cos_sin: tuple[Tensor, Tensor], backend: Any, prepared: Any) -> Tensor:
        def attend(h_bqh: Tensor) -> Tensor:
            return self.self_attn(h_bqh, ctx_k, ctx_v, cos_sin, backend, prepared)

        x_bqh = x_bqh + self._sublayer(attend, self.attention_conv, self.input_layernorm(x_bqh))
        return x_bqh + self._sublayer(self.mlp, self.mlp_conv,
                                      self.post_attention_layernorm(x_bqh))
