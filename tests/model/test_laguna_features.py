"""The Laguna drafter features against a hand-written reference of vLLM 0.32's formulas.

The reference below re-derives, in plain torch, what ``vllm/model_executor/models/laguna.py``
(``LagunaAttention.forward``: qkv, q/k norm, neox RoPE over ``rotary_dim``, softplus gate) and
``laguna_dflash.py`` (``combine_hidden_states``: per-slice ``aux_hidden_norms`` -> fc ->
hidden_norm; ``_project_context_kv``: every layer's ``input_layernorm`` of the context, then the
K/V rows of qkv_proj, k_norm, RoPE) compute for one drafted block, and compares the drafter's
inference path with it. Defaults leave today's drafter unchanged (no new tensors, no new keys).
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_lab.export.weights import expected_shapes
from dflash_lab.heads.laguna import laguna_features
from dflash_lab.model.config import TRAINING_SPEC_KEY, DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from tests.doubles import tiny_drafter_config

LAGUNA = {"aux_hidden_norms": True, "context_input_norm": True, "attention_gate": "per-head",
          "partial_rotary_factor": 0.5}


def _rms(x, w, eps=1e-6):
    x32 = x.double()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _vllm_rope(x_lhd, pos_l, theta, rotary_dim):
    """vLLM RotaryEmbedding.forward_native, neox style: first rotary_dim dims, halves."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = pos_l.double()[:, None] * inv  # [L, R/2]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    rot, rest = x_lhd[..., :rotary_dim], x_lhd[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _randomize(drafter, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _vllm_reference(drafter, cfg, hidden_sf, anchor_id, embed):
    """One block anchored after S context positions, non-causal full attention (B queries)."""
    sd = {k: v for k, v in drafter.state_dict().items()}
    n = len(cfg.target_layer_ids)
    slices = hidden_sf.view(hidden_sf.shape[0], n, -1)
    normed = torch.stack([_rms(slices[:, i], sd[f"aux_hidden_norms.{i}.weight"])
                          for i in range(n)], 1).reshape(hidden_sf.shape[0], -1)
    ctx = _rms(normed @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    s, b, hq, hkv, d = ctx.shape[0], cfg.block_size, cfg.num_attention_heads, \
        cfg.num_key_value_heads, cfg.head_dim
    ctx_pos, blk_pos = torch.arange(s), torch.arange(s, s + b)
    ids = torch.full((b,), cfg.mask_token_id)
    ids[0] = anchor_id
    x = embed(ids)
    residual = x
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        w = {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
        ctx_n = _rms(ctx, w["input_layernorm.weight"])
        ck = _rms((ctx_n @ w["self_attn.k_proj.weight"].T).view(s, hkv, d),
                  w["self_attn.k_norm.weight"])
        ck = _vllm_rope(ck, ctx_pos, cfg.rope_theta, cfg.rotary_dim)
        cv = (ctx_n @ w["self_attn.v_proj.weight"].T).view(s, hkv, d)
        h = _rms(residual, w["input_layernorm.weight"])
        q = _rms((h @ w["self_attn.q_proj.weight"].T).view(b, hq, d), w["self_attn.q_norm.weight"])
        k = _rms((h @ w["self_attn.k_proj.weight"].T).view(b, hkv, d), w["self_attn.k_norm.weight"])
        v = (h @ w["self_attn.v_proj.weight"].T).view(b, hkv, d)
        q, k = _vllm_rope(q, blk_pos, cfg.rope_theta, cfg.rotary_dim), \
            _vllm_rope(k, blk_pos, cfg.rope_theta, cfg.rotary_dim)
        keys = torch.cat([ck, k]).repeat_interleave(hq // hkv, 1)  # [S+B, Hq, D]
        vals = torch.cat([cv, v]).repeat_interleave(hq // hkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, keys) * d ** -0.5, -1)
        out = torch.einsum("hqk,khd->qhd", att, vals)  # [B, Hq, D]
        gate = F.softplus((h @ w["self_attn.g_proj.weight"].T).float()).to(out.dtype)
        out = (out * gate[..., None]).reshape(b, hq * d)
        residual = residual + out @ w["self_attn.o_proj.weight"].T
        h = _rms(residual, w["post_attention_layernorm.weight"])
        mlp = (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T))
        residual = residual + mlp @ w["mlp.down_proj.weight"].T
    return _rms(residual, sd["norm.weight"])


def test_drafter_block_equals_the_vllm_laguna_reference():
    torch.manual_seed(0)
    cfg = tiny_drafter_config(**LAGUNA)
    drafter = DFlashDrafter(cfg).double()
    _randomize(drafter)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).double()
    hidden = torch.randn(7, len(cfg.target_layer_ids) * cfg.hidden_size, dtype=torch.float64)
    cache = drafter.new_cache()
    drafter.extend_context(cache, hidden[None])
    got = drafter.draft(cache, torch.tensor([5]), embed)[0]
    want = _vllm_reference(drafter, cfg, hidden, 5, embed)
    # fp32 RoPE tables (as the engines build them) against a float64 reference
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_each_feature_the_reference_disagrees():
    """The reference is sensitive to every feature (the comparison above can fail)."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(97, 48).double()
    hidden = torch.randn(7, 3 * 48, dtype=torch.float64)
    for off in ({"context_input_norm": False}, {"partial_rotary_factor": 1.0}):
        cfg = tiny_drafter_config(**{**LAGUNA, **off})
        drafter = DFlashDrafter(cfg).double()
        _randomize(drafter)
        cache = drafter.new_cache()
        drafter.extend_context(cache, hidden[None])
        got = drafter.draft(cache, torch.tensor([5]), embed)[0]
        ref_cfg = tiny_drafter_config(**LAGUNA)
        assert not torch.allclose(got, _vllm_reference(drafter, ref_cfg, hidden, 5, embed))


@pytest.mark.parametrize("gate", ["per-head", "per-element"])
def test_softplus_gate_matches_vllm_formula(gate):
    torch.manual_seed(0)
    attn = DFlashDrafter(tiny_drafter_config(attention_gate=gate)).layers[0].self_attn
    out, x = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 48)
    g = F.softplus(attn.g_proj(x).float())
    want = (out.flatten(2) * g if gate == "per-element" else
            (out * g[..., None]).flatten(2))  # vLLM: view per head * gate.unsqueeze(-1)
    torch.testing.assert_close(attn._gated(out, x).flatten(2), want)
    assert attn.g_proj.weight.shape == (4 * (16 if gate == "per-element" else 1), 48)


def test_aux_hidden_norms_norm_each_slice_before_fc():
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config(aux_hidden_norms=True)).double()
    _randomize(drafter)
    h = torch.randn(2, 3, 3 * 48, dtype=torch.float64)
    normed = torch.cat([_rms(h[..., i * 48:(i + 1) * 48], drafter.aux_hidden_norms[i].weight)
                        for i in range(3)], -1)
    want = _rms(normed @ drafter.fc.weight.T, drafter.hidden_norm.weight)
    torch.testing.assert_close(drafter.fuse(h), want, rtol=1e-5, atol=1e-5)  # fp32 norms


def test_defaults_leave_the_drafter_and_its_config_unchanged():
    cfg = tiny_drafter_config()
    assert laguna_features(cfg) == {}
    assert "laguna" not in cfg.to_dict()[TRAINING_SPEC_KEY]
    names = set(DFlashDrafter(cfg).state_dict())
    assert not any("aux_hidden_norms" in n or "g_proj" in n for n in names)
    assert names == set(expected_shapes(cfg))


def test_laguna_features_round_trip_through_our_config_json():
    cfg = tiny_drafter_config(**LAGUNA)
    back = DrafterConfig.from_dict(cfg.to_dict())
    assert back == cfg and laguna_features(back) == LAGUNA
    assert set(DFlashDrafter(cfg).state_dict()) == set(expected_shapes(cfg))


@pytest.mark.parametrize("bad", [{"attention_gate": "sigmoid"}, {"partial_rotary_factor": 0.1},
                                 {"partial_rotary_factor": 1.5}, {"aux_hidden_norms": "yes"}])
def test_bad_laguna_values_are_refused_by_name(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=key):
        tiny_drafter_config(**bad)
