"""Every backend against an independent eager reference (plain matmul + softmax + sink column)."""

import pytest
import torch

from dflash_lab.attention import flash as flash_module
from dflash_lab.attention import flex as flex_module
from dflash_lab.attention.base import get_backend
from dflash_lab.attention.mask import BlockLayout, LayerSpec, dense_mask
from dflash_lab.attention.sdpa import KEY_TILES, SdpaBackend
from tests.doubles import emulated_flash_attn_func

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")

SPECS = [LayerSpec(w, c) for w in (None, 3, 6) for c in (False, True)]


def eager_attention(q, k, v, mask_b1qk, scale, sink_h=None):
    """Independent reference: explicit scores, an explicit sink column, softmax, drop it."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask_b1qk, float("-inf"))
    if sink_h is not None:
        sink = sink_h.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs @ v


def _inputs(layout, hq=4, hkv=2, d=8, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    bt = layout.anchors_bn.shape[0]
    make = lambda h, n: torch.randn(bt, h, n, d, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = make(hq, layout.num_queries), make(hkv, layout.num_keys), make(hkv, layout.num_keys)
    sink = torch.randn(hq, generator=g, dtype=torch.float64)
    for t in (q, k, v, sink):
        t.requires_grad_(requires_grad)
    return q, k, v, sink


TRAIN_LAYOUT = BlockLayout(torch.tensor([[2, 5, 6, 11], [0, 3, 9, 9]]), 14, 4)
#: The same anchors in packed rows: row 0 holds documents [0, 6) and [6, 14), row 1 [0, 4) and
#: [4, 14) (doc_starts_bn: the start of each anchor's document).
PACKED_LAYOUT = BlockLayout(TRAIN_LAYOUT.anchors_bn, 14, 4,
                            doc_starts_bn=torch.tensor([[0, 0, 6, 6], [0, 0, 4, 4]]))


@pytest.mark.parametrize("key_tiles", [1, 3, 4], ids=lambda n: f"tiles{n}")
@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA2", "MQA"])
def test_sdpa_matches_eager_outputs_and_gradients(spec, use_sink, heads, key_tiles):
    """One dense call (tiles1), uneven key tiles (3 tiles over 4 blocks) and one per block."""
    q, k, v, sink = _inputs(TRAIN_LAYOUT, hq=heads[0], hkv=heads[1])
    sink_h = sink if use_sink else None
    backend = SdpaBackend(key_tiles=key_tiles, min_pairs=0)
    out = backend.attend(q, k, v, backend.prepare(TRAIN_LAYOUT, spec), scale=0.3, sink_h=sink_h)
    ref = eager_attention(q, k, v, dense_mask(TRAIN_LAYOUT, spec), 0.3, sink_h)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    leaves = [q, k, v] + ([sink] if use_sink else [])
    got = torch.autograd.grad(out, leaves, grad_out)
    want = torch.autograd.grad(ref, leaves, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_sdpa_key_tiles_partition_the_queries_and_drop_only_invisible_keys(spec):
    """Sorted anchors (training layout): each tile keeps every key its queries can see and the
    tiles together score well under the dense call's Q x K pairs."""
    g = torch.Generator().manual_seed(0)
    anchors = torch.stack([torch.randperm(120, generator=g)[:16].sort().values for _ in range(2)])
    layout = BlockLayout(anchors, 128, 4)
    mask = dense_mask(layout, spec)
    tiles = SdpaBackend(key_tiles=KEY_TILES, min_pairs=0).prepare(layout, spec)
    assert len(tiles) == KEY_TILES
    assert [t.q0 for t in tiles][1:] == [t.q1 for t in tiles][:-1]
    assert tiles[0].q0 == 0 and tiles[-1].q1 == layout.num_queries
    scored = 0
    for t in tiles:
        rows = mask[:, :, t.q0:t.q1]
        dropped = torch.ones(layout.num_keys, dtype=torch.bool)
        dropped[t.key_idx] = False
        assert not rows[..., dropped].any()  # nothing visible was cut
        assert torch.equal(t.mask, rows[..., t.key_idx])
        scored += (t.q1 - t.q0) * len(t.key_idx)
    assert scored < 0.6 * layout.num_queries * layout.num_keys
    one_dense_call = [BlockLayout(anchors[:, :1], 128, 4),  # one block (inference)
                      BlockLayout(anchors[:, :3], 8, 4)]  # too small to repay the tiles' cost
    for small in one_dense_call:
        assert isinstance(SdpaBackend().prepare(small, spec), torch.Tensor)


def test_compiled_flex_warns_once_past_the_recompile_limit(monkeypatch, caplog):
    """More distinct (batch, queries, keys) shapes than torch recompiles for: one warning that
    names the fix (data.pad_to_multiple_of). The compiled builder is replaced by the eager one
    (compiling flex needs the GPU); the shape bookkeeping is what is tested."""
    import logging

    assert flex_module._recompile_limit() >= 1  # torch's real setting is readable
    monkeypatch.setattr(flex_module, "_compiled", lambda fn: fn)
    monkeypatch.setattr(flex_module, "SEEN_SHAPES", set())
    monkeypatch.setattr(flex_module, "_recompile_limit", lambda: 3)
    backend = flex_module.FlexBackend(compile_mask=True)
    spec = LayerSpec(None, False)
    with caplog.at_level(logging.WARNING, logger=flex_module.__name__):
        for s in (8, 8, 9, 10, 11, 12, 12, 13):  # 6 distinct context lengths
            backend.prepare(BlockLayout(torch.tensor([[1, 3]]), s, 2), spec)
    warnings = [r for r in caplog.records if "pad_to_multiple_of" in r.getMessage()]
    assert len(warnings) == 1 and "4 distinct" in warnings[0].getMessage()


def test_compiled_callers_get_one_dense_sdpa_call():
    layout = BlockLayout(torch.arange(0, 512, 16)[None], 512, 8)  # Q*K = 256 * 768
    spec = LayerSpec(None, False)
    assert isinstance(get_backend("sdpa").prepare(layout, spec), list)  # tiles by default
    prepared = get_backend("sdpa", static_shapes=True).prepare(layout, spec)
    assert isinstance(prepared, torch.Tensor) and prepared.shape == (1, 1, 256, 768)


@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("layout", [TRAIN_LAYOUT, PACKED_LAYOUT], ids=["rows", "packed"])
def test_flex_matches_sdpa_forward_on_cpu(spec, use_sink, layout):
    q, k, v, sink = (t.float() for t in _inputs(layout, requires_grad=False))
    sink_h = sink if use_sink else None
    outs = {}
    for name in ("sdpa", "flex"):
        backend = get_backend(name)
        with torch.no_grad():
            outs[name] = backend.attend(q, k, v, backend.prepare(layout, spec), scale=0.3,
                                        sink_h=sink_h)
    torch.testing.assert_close(outs["flex"], outs["sdpa"], atol=2e-5, rtol=1e-4)


def test_flex_refuses_backward_on_cpu_with_a_clear_error():
    q, k, v, _ = (t.float().detach().requires_grad_() for t in _inputs(TRAIN_LAYOUT))
    backend = get_backend("flex")
    with pytest.raises(RuntimeError, match="use attention backend 'sdpa'|train on CPU"):
        backend.attend(q, k, v, backend.prepare(TRAIN_LAYOUT, LayerSpec(None, False)), scale=1.0)


@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("spec", SPECS + [LayerSpec(2, False)], ids=str)
def test_flash_wiring_matches_sdpa_with_emulated_kernel(monkeypatch, spec, use_sink):
    """flash-attn needs CUDA; on CPU we check our argument derivation and lse-sink wiring by
    substituting a pure-torch kernel that follows flash-attn's documented window semantics."""
    monkeypatch.setattr(flash_module, "_flash_attn_func", emulated_flash_attn_func)
    layout = BlockLayout(torch.tensor([[7], [7]]), 7, 4)
    q, k, v, sink = (t.float() for t in _inputs(layout, requires_grad=False))
    sink_h = sink if use_sink else None
    outs = {}
    for name in ("sdpa", "flash"):
        backend = get_backend(name, packed=False)
        outs[name] = backend.attend(q, k, v, backend.prepare(layout, spec), scale=0.3,
                                    sink_h=sink_h)
    torch.testing.assert_close(outs["flash"], outs["sdpa"], atol=1e-5, rtol=1e-5)


def test_flash_refuses_the_packed_training_layout():
    with pytest.raises(ValueError, match="inference layout only"):
        get_backend("flash")  # asked for packed blocks (the default layout kind)
    with pytest.raises(ValueError, match="inference layout only"):
        get_backend("flash", packed=False).prepare(TRAIN_LAYOUT, LayerSpec(None, False))


def test_flash_refuses_a_context_of_packed_documents():
    """One block after its context, but the context holds two documents: a flash window would
    attend across the boundary, so prepare refuses instead (the mask would hide 0..3)."""
    layout = BlockLayout(torch.tensor([[9]]), 9, 4, doc_starts_bn=torch.tensor([[4]]))
    assert not dense_mask(layout, LayerSpec(None, False))[0, 0, :, :4].any()
    with pytest.raises(ValueError, match="packed documents"):
        get_backend("flash", packed=False).prepare(layout, LayerSpec(None, False))


def test_missing_flash_attn_names_the_gpu_extra(monkeypatch):
    if flash_module.flash_attn_available():
        pytest.skip("flash-attn is installed here")
    monkeypatch.setattr(flash_module, "_flash_attn_func", None)
    layout = BlockLayout(torch.tensor([[3]]), 3, 2)
    q, k, v, _ = (t.float() for t in _inputs(layout, requires_grad=False))
    backend = get_backend("flash", packed=False)
    with pytest.raises(RuntimeError, match=r"\.\[gpu\]"):
        backend.attend(q, k, v, backend.prepare(layout, LayerSpec(None, False)), scale=1.0)


def test_unknown_backend_and_auto_on_cpu(caplog):
    with pytest.raises(ValueError, match="unknown attention backend 'flashy'"):
        get_backend("flashy")
    with caplog.at_level("INFO"):
        assert get_backend("auto", "cpu").name == "sdpa"
    assert "resolved to 'sdpa'" in caplog.text


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_flex_backward_on_gpu_matches_sdpa(spec, use_sink, packed):
    starts = PACKED_LAYOUT.doc_starts_bn.cuda() if packed else None
    layout = BlockLayout(TRAIN_LAYOUT.anchors_bn.cuda(), 14, 4, doc_starts_bn=starts)
    q, k, v, sink = (t.float().cuda().detach().requires_grad_() for t in _inputs(layout))
    sink_h = sink if use_sink else None
    results = {}
    for name in ("sdpa", "flex"):
        backend = get_backend(name, "cuda")
        out = backend.attend(q, k, v, backend.prepare(layout, spec), scale=0.3, sink_h=sink_h)
        leaves = [q, k, v] + ([sink] if use_sink else [])
        results[name] = (out, torch.autograd.grad(out.square().sum(), leaves))
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], atol=2e-3, rtol=2e-3)
    for a, b in zip(results["flex"][1], results["sdpa"][1]):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flash_module.flash_attn_available()),
                    reason="needs a CUDA GPU with flash-attn installed (pip install -e '.[gpu]')")
@pytest.mark.parametrize("spec", SPECS + [LayerSpec(2, False)], ids=str)
def test_real_flash_attn_matches_sdpa(spec):
    layout = BlockLayout(torch.tensor([[9], [9]], device="cuda"), 9, 4)
    q, k, v, sink = (t.to("cuda", torch.bfloat16) for t in _inputs(layout, requires_grad=False))
    outs = {}
    for name in ("sdpa", "flash"):
        backend = get_backend(name, "cuda", packed=False)
        outs[name] = backend.attend(q, k, v, backend.prepare(layout, spec), scale=0.3,
                                    sink_h=sink.float())
    torch.testing.assert_close(outs["flash"].float(), outs["sdpa"].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("key_tiles", [1, 3], ids=lambda n: f"tiles{n}")
@pytest.mark.parametrize("spec", [LayerSpec(None, False), LayerSpec(3, True)], ids=str)
def test_sdpa_matches_eager_on_packed_documents(spec, key_tiles):
    """The reference backend over packed rows: its key tiles are read off the packed mask."""
    q, k, v, sink = _inputs(PACKED_LAYOUT)
    backend = SdpaBackend(key_tiles=key_tiles, min_pairs=0)
    out = backend.attend(q, k, v, backend.prepare(PACKED_LAYOUT, spec), scale=0.3, sink_h=sink)
    ref = eager_attention(q, k, v, dense_mask(PACKED_LAYOUT, spec), 0.3, sink)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), [q, k, v]),
                    torch.autograd.grad(ref.sum(), [q, k, v])):
        torch.testing.assert_close(a, b)
