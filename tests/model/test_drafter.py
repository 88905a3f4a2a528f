"""DFlashDrafter: weights layout, train/infer parity, backends through the whole model."""

import pytest
import torch

from dflash_lab.attention import flash as flash_module
from dflash_lab.attention.mask import dense_mask
from dflash_lab.model.drafter import DFlashDrafter
from tests.doubles import LAYOUTS, emulated_flash_attn_func, tiny_drafter_config

FEATURES = {
    "plain": {},
    "sinks": {"attention_sink_bias": True},
    "learned_mask": {"learned_mask_embedding": True},
    "both": {"attention_sink_bias": True, "learned_mask_embedding": True},
    # DFlash 2 convs around every sublayer (made non-identity in _setup) + scaled block inputs
    "dflash2": {"variant": "dflash2", "conv_kernel_size": 3, "conv_group_size": 12,
                "selector_rank": 8, "selector_top_k": 5, "input_embedding_scale": 1.5,
                "attention_sink_bias": True},
}


class EagerBackend:
    """Independent reference: explicit scores + explicit sink column (no SDPA)."""

    name = "eager"

    def prepare(self, layout, spec):
        return dense_mask(layout, spec)

    def attend(self, q, k, v, mask, *, scale, sink_h=None):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        if sink_h is not None:
            col = sink_h.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            return torch.softmax(torch.cat([scores, col], -1), -1)[..., :-1] @ v
        return torch.softmax(scores, -1) @ v


def _setup(layout="full_bidirectional", seed=0, dtype=torch.float64, **features):
    torch.manual_seed(seed)
    cfg = tiny_drafter_config(layout, **features)
    drafter = DFlashDrafter(cfg).to(dtype)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(dtype).requires_grad_(False)
    drafter.init_mask_embedding(embed)
    for name, p in drafter.named_parameters():  # make sinks, norms and convs non-trivial
        if "sink" in name or "norm" in name or "base_kernel" in name:
            p.data.add_(torch.randn_like(p) * 0.3)
        elif "kernel_projection" in name:
            p.data.normal_(std=0.3)
    s = 23
    hidden = torch.randn(2, s, len(cfg.target_layer_ids) * cfg.hidden_size, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size - 1, (2, s))
    anchors = torch.tensor([[0, 4, 5, 12, 19], [2, 3, 9, 15, 15]])
    return cfg, drafter, embed, hidden, ids, anchors


def test_state_dict_is_the_serving_layout_without_embed_or_lm_head():
    _, drafter, *_ = _setup(attention_sink_bias=True, learned_mask_embedding=True)
    keys = set(drafter.state_dict())
    assert "fc.weight" in keys and "hidden_norm.weight" in keys and "norm.weight" in keys
    assert "layers.1.self_attn.attention_sink_bias" in keys and "mask_embedding" in keys
    for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        assert f"layers.0.self_attn.{part}.weight" in keys
    for part in ("gate_proj", "up_proj", "down_proj"):
        assert f"layers.0.mlp.{part}.weight" in keys
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k
                   for k in keys - {"mask_embedding"})
    plain = set(_setup()[1].state_dict())
    assert not any("sink" in k or "mask_embedding" in k for k in plain)


def test_learned_mask_embedding_starts_from_the_target_mask_row():
    cfg, drafter, embed, *_ = _setup(learned_mask_embedding=True)
    torch.testing.assert_close(drafter.mask_embedding.data, embed.weight[cfg.mask_token_id])


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_train_and_inference_paths_give_the_same_block(layout, features):
    """Packed training forward == cached context + one block, for every anchor."""
    cfg, drafter, embed, hidden, ids, anchors = _setup(layout, **FEATURES[features])
    with torch.no_grad():
        packed = drafter(hidden, ids, anchors, embed)  # [2, N, B, H]
    for row in range(2):
        for j, anchor in enumerate(anchors[row].tolist()):
            if anchor == 0:
                continue  # inference always has >= 1 context position (the prompt)
            cache = drafter.new_cache()
            drafter.extend_context(cache, hidden[row:row + 1, :anchor])
            single = drafter.draft(cache, ids[row:row + 1, anchor], embed)
            torch.testing.assert_close(single[0], packed[row, j], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("layout", ["full_bidirectional", "sliding_causal", "mixed_per_layer",
                                    "sliding_bidirectional_narrow"])
def test_sdpa_drafter_matches_eager_reference_outputs_and_grads(monkeypatch, layout, features):
    cfg, drafter, embed, hidden, ids, anchors = _setup(layout, **FEATURES[features])
    # the DFlash 2 selector acts on the hidden states, after this forward
    names, params = zip(*[(n, p) for n, p in drafter.named_parameters()
                          if not n.startswith("candidate_selector.")])
    out = drafter(hidden, ids, anchors, embed)
    grads = torch.autograd.grad(out.square().sum(), params)
    monkeypatch.setattr(drafter, "backend", lambda device, packed: EagerBackend())
    ref = drafter(hidden, ids, anchors, embed)
    ref_grads = torch.autograd.grad(ref.square().sum(), params)
    torch.testing.assert_close(out, ref)
    for name, a, b in zip(names, grads, ref_grads):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")
    if features in ("sinks", "both", "dflash2"):
        assert grads[names.index("layers.0.self_attn.attention_sink_bias")].abs().sum() > 0
    if features == "dflash2":
        for conv in ("attention_conv", "mlp_conv"):
            for part in ("base_kernel", "kernel_projection.weight"):
                assert grads[names.index(f"layers.0.{conv}.{part}")].abs().sum() > 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flex_drafter_matches_sdpa_forward(layout):
    cfg, drafter, embed, hidden, ids, anchors = _setup(layout, dtype=torch.float32,
                                                       attention_sink_bias=True)
    with torch.no_grad():
        ref = drafter(hidden, ids, anchors, embed)
        drafter.backend_name = "flex"
        out = drafter(hidden, ids, anchors, embed)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flash_inference_path_matches_sdpa_with_emulated_kernel(monkeypatch, layout):
    monkeypatch.setattr(flash_module, "_flash_attn_func", emulated_flash_attn_func)
    cfg, drafter, embed, hidden, ids, _ = _setup(layout, dtype=torch.float32,
                                                 attention_sink_bias=True,
                                                 learned_mask_embedding=True)
    cache = drafter.new_cache()
    drafter.extend_context(cache, hidden[:, :11])
    ref = drafter.draft(cache, ids[:, 11], embed)
    drafter.backend_name = "flash"
    torch.testing.assert_close(drafter.draft(cache, ids[:, 11], embed), ref,
                               atol=1e-5, rtol=1e-5)


def test_cache_crop_then_extend_equals_a_fresh_cache():
    cfg, drafter, embed, hidden, ids, _ = _setup("mixed_swa")
    grown = drafter.new_cache()
    drafter.extend_context(grown, hidden[:, :6])
    drafter.extend_context(grown, hidden[:, 6:15])  # e.g. a verify pass with a long draft
    grown.crop(9)  # only 3 of those were accepted
    drafter.extend_context(grown, hidden[:, 9:12])
    fresh = drafter.new_cache()
    drafter.extend_context(fresh, hidden[:, :12])
    torch.testing.assert_close(drafter.draft(grown, ids[:, 12], embed),
                               drafter.draft(fresh, ids[:, 12], embed))


def test_clear_errors_for_wrong_feature_width_and_empty_cache():
    cfg, drafter, embed, hidden, ids, anchors = _setup()
    with pytest.raises(ValueError, match="target features have width 10"):
        drafter(hidden[..., :10], ids, anchors, embed)
    with pytest.raises(ValueError, match="extend_context"):
        drafter.draft(drafter.new_cache(), ids[:, 0], embed)
    cache = drafter.new_cache()
    drafter.extend_context(cache, hidden[:, :3])
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(5)


def test_slot_zero_is_the_anchor_token_and_masks_use_the_mask_row():
    """Changing a MASK-slot input must not be possible: only the anchor id enters the block."""
    cfg, drafter, embed, hidden, ids, anchors = _setup("full_causal")
    with torch.no_grad():
        base = drafter(hidden, ids, anchors, embed)
        ids2 = ids.clone()
        ids2[0, anchors[0, 2] + 1] = (ids2[0, anchors[0, 2] + 1] + 1) % (cfg.vocab_size - 1)
        same = drafter(hidden, ids2, anchors, embed)
        ids2[0, anchors[0, 2]] = (ids2[0, anchors[0, 2]] + 1) % (cfg.vocab_size - 1)
        moved = drafter(hidden, ids2, anchors, embed)
    torch.testing.assert_close(base, same)  # tokens after the anchor are never inputs
    assert not torch.allclose(base[0, 2], moved[0, 2])  # the anchor token is


@pytest.mark.parametrize("features", ["sinks", "dflash2"])
def test_activation_checkpointing_gives_the_same_gradients(features):
    cfg, drafter, embed, hidden, ids, anchors = _setup("mixed_swa", **FEATURES[features])
    params = [p for n, p in drafter.named_parameters() if not n.startswith("candidate_selector.")]
    want = torch.autograd.grad(drafter(hidden, ids, anchors, embed).square().sum(), params)
    drafter.activation_checkpointing = True
    got = torch.autograd.grad(drafter(hidden, ids, anchors, embed).square().sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_learned_mask_embedding_replaces_every_mask_id_slot_0_included():
    """vLLM's rule (qwen3_dflash.py): ``input_ids == mask_token_id`` anywhere in the block."""
    cfg, drafter, embed, *_ = _setup(learned_mask_embedding=True)
    with torch.no_grad():
        drafter.mask_embedding.add_(1.0)  # differ from the table row
        anchors = torch.tensor([[cfg.mask_token_id, 3]])
        x = drafter.block_inputs(anchors, embed).view(1, 2, cfg.block_size, -1)
    torch.testing.assert_close(x[0, 0], drafter.mask_embedding.expand_as(x[0, 0]))
    torch.testing.assert_close(x[0, 1, 0], embed.weight[3].to(x.dtype))
    torch.testing.assert_close(x[0, 1, 1:], drafter.mask_embedding.expand_as(x[0, 1, 1:]))
