"""Every backend against an independent eager reference (plain matmul + softmax + sink column)."""

import pytest
import torch

from dflash_lab.attention import flash as flash_module
from dflash_lab.attention.base import get_backend
from dflash_lab.attention.mask import BlockLayout, dense_mask
from dflash_lab.model.config import LayerSpec
from dflash_lab.testing import emulated_flash_attn_func

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


@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA2", "MQA"])
def test_sdpa_matches_eager_outputs_and_gradients(spec, use_sink, heads):
    q, k, v, sink = _inputs(TRAIN_LAYOUT, hq=heads[0], hkv=heads[1])
    sink_h = sink if use_sink else None
    backend = get_backend("sdpa")
    out = backend.attend(q, k, v, backend.prepare(TRAIN_LAYOUT, spec), scale=0.3, sink_h=sink_h)
    ref = eager_attention(q, k, v, dense_mask(TRAIN_LAYOUT, spec), 0.3, sink_h)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    leaves = [q, k, v] + ([sink] if use_sink else [])
    got = torch.autograd.grad(out, leaves, grad_out)
    want = torch.autograd.grad(ref, leaves, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_flex_matches_sdpa_forward_on_cpu(spec, use_sink):
    q, k, v, sink = (t.float() for t in _inputs(TRAIN_LAYOUT, requires_grad=False))
    sink_h = sink if use_sink else None
    outs = {}
    for name in ("sdpa", "flex"):
        backend = get_backend(name)
        with torch.no_grad():
            outs[name] = backend.attend(q, k, v, backend.prepare(TRAIN_LAYOUT, spec), scale=0.3,
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
        backend = get_backend(name)
        outs[name] = backend.attend(q, k, v, backend.prepare(layout, spec), scale=0.3,
                                    sink_h=sink_h)
    torch.testing.assert_close(outs["flash"], outs["sdpa"], atol=1e-5, rtol=1e-5)


def test_flash_refuses_the_packed_training_layout():
    with pytest.raises(ValueError, match="inference layout only"):
        get_backend("flash").prepare(TRAIN_LAYOUT, LayerSpec(None, False))


def test_missing_flash_attn_names_the_gpu_extra(monkeypatch):
    if flash_module.flash_attn_available():
        pytest.skip("flash-attn is installed here")
    monkeypatch.setattr(flash_module, "_flash_attn_func", None)
    layout = BlockLayout(torch.tensor([[3]]), 3, 2)
    q, k, v, _ = (t.float() for t in _inputs(layout, requires_grad=False))
    backend = get_backend("flash")
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
def test_flex_backward_on_gpu_matches_sdpa(spec, use_sink):
    layout = BlockLayout(TRAIN_LAYOUT.anchors_bn.cuda(), 14, 4)
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
        backend = get_backend(name, "cuda")
        outs[name] = backend.attend(q, k, v, backend.prepare(layout, spec), scale=0.3,
                                    sink_h=sink.float())
    torch.testing.assert_close(outs["flash"].float(), outs["sdpa"].float(), atol=2e-2, rtol=2e-2)
