"""Long rows: mask tiles from the one predicate, and sdpa's streamed path equal to the dense one.

The streamed path is forced at toy size (``stream_pairs=0``) and compared with one dense SDPA
call (``key_tiles=1``): outputs and gradients of q, k, v and the sink logits, for full and
sliding layers, causal and bidirectional, unpacked and packed rows.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_lab.attention import sdpa as sdpa_module
from dflash_lab.attention.mask import (
    BlockLayout,
    LayerSpec,
    dense_mask,
    mask_tile,
    visible_key_ranges,
)
from dflash_lab.attention.sdpa import SdpaBackend
from tests.attention.test_backends import PACKED_LAYOUT, SPECS, TRAIN_LAYOUT, _inputs

#: A longer row: 6 blocks of 4 over 40 context slots, anchors far apart (so a window cuts keys).
LONG_LAYOUT = BlockLayout(torch.tensor([[1, 7, 15, 22, 30, 38], [0, 5, 5, 19, 33, 40]]), 40, 4)
LONG_PACKED = BlockLayout(LONG_LAYOUT.anchors_bn, 40, 4,
                          doc_starts_bn=torch.tensor([[0, 0, 12, 12, 25, 25],
                                                      [0, 0, 0, 17, 17, 17]]))
LAYOUTS = {"train": TRAIN_LAYOUT, "packed": PACKED_LAYOUT, "long": LONG_LAYOUT,
           "long_packed": LONG_PACKED}


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("name", LAYOUTS)
def test_mask_tile_is_the_dense_mask_slice(name, spec):
    layout = LAYOUTS[name]
    dense = dense_mask(layout, spec)
    for q0, q1, k0, k1 in [(0, 4, 0, layout.num_keys), (4, 12, 3, 20), (8, 16, 30, 44),
                           (0, layout.num_queries, 0, layout.num_keys)]:
        q1, k1 = min(q1, layout.num_queries), min(k1, layout.num_keys)
        assert torch.equal(mask_tile(layout, spec, q0, q1, k0, k1), dense[:, :, q0:q1, k0:k1])


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("name", LAYOUTS)
def test_visible_key_ranges_hold_every_visible_key(name, spec):
    """Every key some query of a run sees lies inside the run's ranges; for a window the context
    range is no wider than W - 1 plus the run's anchor span (the bound that keeps tiles small)."""
    layout = LAYOUTS[name]
    dense, b = dense_mask(layout, spec), layout.block_size
    for n0 in range(layout.num_blocks):
        for n1 in range(n0 + 1, layout.num_blocks + 1):
            ranges = visible_key_ranges(layout, spec, n0, n1)
            inside = torch.zeros(layout.num_keys, dtype=torch.bool)
            for k0, k1 in ranges:
                inside[k0:k1] = True
            seen = dense[:, :, n0 * b:n1 * b].any(dim=2).any(dim=1).any(dim=0)
            assert not (seen & ~inside).any(), (n0, n1, ranges)
            if spec.window is not None and len(ranges) == 2:
                anchors = layout.anchors_bn[:, n0:n1]
                span = int(anchors.max() - anchors.min())
                assert ranges[0][1] - ranges[0][0] <= spec.window - 1 + span


def test_sliding_window_cuts_the_context_range():
    """Not a tautology of the bound above: the last block's window leaves the early context out.

    Block 5 is anchored at 38 (row 0) and 40 (row 1); with W = 3 slot 0 reaches back to a - 2,
    so the context range is [36, 40), and key 36 is really seen (row 0, slot 0)."""
    (k0, k1), _ = visible_key_ranges(LONG_LAYOUT, LayerSpec(3, True), 5, 6)
    assert (k0, k1) == (36, 40)
    assert bool(dense_mask(LONG_LAYOUT, LayerSpec(3, True))[0, 0, 5 * 4, 36])
    (k0, k1), _ = visible_key_ranges(LONG_LAYOUT, LayerSpec(None, True), 5, 6)
    assert (k0, k1) == (0, 40)


@pytest.mark.parametrize("per_run", [1, 2, 4], ids=lambda n: f"blocks{n}")
@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("name", LAYOUTS)
def test_streamed_equals_dense_outputs_and_gradients(name, spec, use_sink, per_run, monkeypatch):
    layout = LAYOUTS[name]
    q, k, v, sink = _inputs(layout, hq=4, hkv=2)
    sink_h = sink if use_sink else None
    dense_backend = SdpaBackend(key_tiles=1)
    want = dense_backend.attend(q, k, v, dense_backend.prepare(layout, spec), scale=0.3,
                                sink_h=sink_h)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v, sink), allow_unused=True)

    def no_dense(*args):
        raise AssertionError("the streamed path built the dense mask")

    monkeypatch.setattr(sdpa_module, "dense_mask", no_dense)
    stream = SdpaBackend(stream_pairs=0, stream_queries=per_run * layout.block_size)
    tiles = stream.prepare(layout, spec)
    assert isinstance(tiles, list) and len(tiles) == -(-layout.num_blocks // per_run)
    got = stream.attend(q, k, v, tiles, scale=0.3, sink_h=sink_h)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v, sink), allow_unused=True)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w)


def _saved_bytes_of_streamed_call(monkeypatch, checkpointed: bool) -> tuple[int, int]:
    """(bytes autograd keeps for backward of one streamed full-attention call, bytes of its
    q, k, v): the saved tensors, counted by the saved-tensors hooks."""
    monkeypatch.setattr(sdpa_module, "STREAM_CHECKPOINT", checkpointed)
    layout, spec = LONG_LAYOUT, LayerSpec(None, False)
    q, k, v, _ = _inputs(layout, hq=4, hkv=2)
    stream = SdpaBackend(stream_pairs=0, stream_queries=layout.block_size)
    tiles = stream.prepare(layout, spec)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stream.attend(q, k, v, tiles, scale=0.3)
    return sum(seen.values()), sum(t.numel() * t.element_size() for t in (q, k, v))


def test_streamed_runs_keep_only_q_k_v_for_backward(monkeypatch):
    """Checkpointed runs: backward keeps the layer's q, k, v (linear in tokens), not each
    run's mask, gathered K/V and scores (quadratic for full layers); without it, more."""
    kept, qkv = _saved_bytes_of_streamed_call(monkeypatch, checkpointed=True)
    assert kept <= qkv
    former, _ = _saved_bytes_of_streamed_call(monkeypatch, checkpointed=False)
    assert former > 2 * qkv


def test_stream_threshold_picks_the_path():
    """Below stream_pairs the dense mask (one tensor) is returned; above it, tiles."""
    spec = LayerSpec(None, False)
    pairs = LONG_LAYOUT.num_queries * LONG_LAYOUT.num_keys
    assert isinstance(SdpaBackend(key_tiles=1, stream_pairs=pairs).prepare(LONG_LAYOUT, spec),
                      torch.Tensor)
    assert isinstance(SdpaBackend(key_tiles=1, stream_pairs=pairs - 1).prepare(LONG_LAYOUT, spec),
                      list)


# ---------------------------------------------------------------------------- a 32K-token row
ROOT = Path(__file__).resolve().parents[2]
LONG_ROW = 32768
#: Peak resident-set growth allowed for one toy-shape training step on a 32K-token row with
#: sliding layers (W = 256); measured ~250 MiB on the 2-core CPU machine (docs/benchmarks.md).
PEAK_BOUND_MIB = 300


def _step_peak(length: int, layers: str) -> dict:
    """One training step (forward + chunked loss + backward) in a fresh pinned process."""
    argv = [sys.executable, "-m", "benchmarks.long_rows", "--point", f"{length}:{layers}",
            "--size", "toy", "--window", "256", "--device", "cpu", "--allocator", "pinned"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_32k_token_row_trains_in_bounded_memory_growing_linearly():
    """The bound is below what the dense [Q, K] bool mask alone would take at this row (so the
    test fails if the dense mask is built), and doubling the row at most about doubles the peak
    (sliding layers: linear in tokens; the dense mask's growth would be 4x)."""
    long_point, half_point = _step_peak(LONG_ROW, "sliding"), _step_peak(LONG_ROW // 2, "sliding")
    queries = long_point["queries"]
    dense_mask_mib = queries * (LONG_ROW + queries) / 2**20
    assert dense_mask_mib > PEAK_BOUND_MIB
    assert long_point["method"].startswith("cpu "), long_point["method"]  # a measured peak
    assert math.isfinite(long_point["loss"])
    assert long_point["peak_MiB"] < PEAK_BOUND_MIB, long_point
    assert long_point["peak_MiB"] / half_point["peak_MiB"] < 2.3, (long_point, half_point)
