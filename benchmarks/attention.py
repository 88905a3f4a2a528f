"""Benchmark 1: attention for the training layout, every backend side by side.

Layout: Bt rows of S context keys and N sorted anchors with blocks of B slots (Q = N*B queries,
K = S + Q keys). For each layer spec: mask construction (dense bool mask for sdpa, its key tiles,
BlockMask for flex, built with H=None; compiled builder on CUDA) time and peak memory, the dense
mask's bytes vs the BlockMask's, and attention forward(+backward) time and peak memory per
backend: sdpa as one dense call and with key tiles (what training uses), flex.
On CPU flex runs forward only (torch 2.13 has no CPU flex backward); flash-attn has no training
layout (one window per query row cannot express many blocks sharing a context), so it is listed
with the reason instead of a number.

    python -m benchmarks.attention [--device cpu|cuda] [--size toy|cpu|paper]
"""

from __future__ import annotations

import torch

from benchmarks.common import MiB, base_parser, peak_memory, report, resolve, table, time_it
from dflash_lab.attention.base import get_backend
from dflash_lab.attention.flash import flash_attn_available
from dflash_lab.attention.mask import BlockLayout, LayerSpec, dense_mask
from dflash_lab.attention.sdpa import KEY_TILES, SdpaBackend
from dflash_lab.train.anchors import sample_anchors, step_generator

#: (S, N, B, Bt, Hq, Hkv, D, dtype) per size.
LAYOUTS = {
    "toy": (64, 8, 4, 2, 4, 2, 16, torch.float32),
    "cpu": (768, 96, 16, 2, 8, 2, 64, torch.float32),
    "paper": (3072, 512, 16, 1, 32, 8, 128, torch.bfloat16),
}
SPECS = {"full_bidir": LayerSpec(None, False), "sliding_causal_W256": LayerSpec(256, True)}


def blockmask_bytes(block_mask) -> int:
    """Bytes of every tensor a BlockMask holds (its sparse tile indices)."""
    return sum(t.numel() * t.element_size() for t in block_mask.as_tuple()
               if isinstance(t, torch.Tensor))


def tiles_computed(block_mask) -> float:
    """Fraction of (query tile, key tile) pairs the kernel visits (partial + full tiles)."""
    visited = block_mask.kv_num_blocks.sum()
    if block_mask.full_kv_num_blocks is not None:
        visited = visited + block_mask.full_kv_num_blocks.sum()
    bt, _, q_tiles = block_mask.kv_num_blocks.shape
    kv_tiles = -(-block_mask.seq_lengths[1] // block_mask.BLOCK_SIZE[1])
    return float(visited) / (bt * q_tiles * kv_tiles)


def make_layout(s: int, n: int, b: int, bt: int, device: torch.device) -> BlockLayout:
    """Sorted anchors sampled as in training (every position is a candidate)."""
    anchors, _ = sample_anchors(torch.ones(bt, s, dtype=torch.long), n, step_generator(0, 0))
    return BlockLayout(anchors.to(device), s, b)


def per_row_dense_mask(layout: BlockLayout, spec: LayerSpec) -> torch.Tensor:
    """The previous dense_mask: one evaluation per batch row, then a stack (for the ratio)."""
    rows = [dense_mask(BlockLayout(a[None], layout.num_context, layout.block_size), spec)[0]
            for a in layout.anchors_bn]
    return torch.stack(rows)


def bench_spec(name: str, spec: LayerSpec, layout: BlockLayout, heads: tuple[int, int, int],
               dtype: torch.dtype, device: torch.device, repeats: int) -> list[dict]:
    hq, hkv, d = heads
    bt, q_len, k_len = layout.anchors_bn.shape[0], layout.num_queries, layout.num_keys
    rows: list[dict] = []

    def mask_row(what, build, **extra):
        build()  # warm-up (compiles the builder on CUDA)
        with peak_memory(device) as pk:
            built = build()
        sec = time_it(build, device, repeats, warmup=0)
        rows.append({"spec": name, "what": what, "ms": sec * 1e3, "peak_MiB": pk.mib, **extra})
        return built

    dense = mask_row("mask: dense_mask (vectorised)", lambda: dense_mask(layout, spec))
    dense_bytes = dense.numel() * dense.element_size()
    if bt > 1:
        mask_row("mask: dense_mask per row (old)", lambda: per_row_dense_mask(layout, spec))
    tiled = SdpaBackend(key_tiles=KEY_TILES)
    tiles = mask_row(f"mask: sdpa key tiles ({KEY_TILES}, dense mask included)",
                     lambda: tiled.prepare(layout, spec))
    if isinstance(tiles, list):
        rows[-1]["tiles_computed"] = sum((t.q1 - t.q0) * len(t.key_idx) for t in tiles) / (
            q_len * k_len)
    flex = get_backend("flex", device)
    bm = mask_row("mask: BlockMask H=None" + (" compiled" if device.type == "cuda" else ""),
                  lambda: flex.prepare(layout, spec))
    bm_bytes = blockmask_bytes(bm)
    rows[-1]["tiles_computed"] = tiles_computed(bm)
    rows[0]["mask_MiB"] = dense_bytes / MiB
    rows[-1]["mask_MiB"] = bm_bytes / MiB

    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(bt, hq, q_len, d, generator=g).to(device, dtype)
    k = torch.randn(bt, hkv, k_len, d, generator=g).to(device, dtype)
    v = torch.randn(bt, hkv, k_len, d, generator=g).to(device, dtype)
    backends = {"sdpa": (SdpaBackend(key_tiles=1), dense), "sdpa-tiles": (tiled, tiles),
                "flex": (get_backend("flex", device), bm)}
    for backend_name, (backend, mask) in backends.items():

        def fwd(backend=backend, mask=mask):
            with torch.no_grad():
                backend.attend(q, k, v, mask, scale=d ** -0.5)

        def fwd_bwd(backend=backend, mask=mask):
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out = backend.attend(qq, kk, vv, mask, scale=d ** -0.5)
            torch.autograd.grad(out.float().square().mean(), (qq, kk, vv))

        modes = [("fwd", fwd)]
        if backend_name != "flex" or device.type == "cuda":
            modes.append(("fwd+bwd", fwd_bwd))
        for mode, fn in modes:
            fn()  # warm-up (and compilation on CUDA) outside the measurement
            with peak_memory(device) as pk:
                fn()
            sec = time_it(fn, device, repeats, warmup=0)
            rows.append({"spec": name, "what": f"attn {mode}: {backend_name}", "ms": sec * 1e3,
                         "peak_MiB": pk.mib})
    reason = ("flash-attn not installed" if not flash_attn_available() else
              "no training layout in flash-attn (inference layout only)")
    rows.append({"spec": name, "what": "attn: flash", "ms": "n/a", "peak_MiB": reason})
    return rows


def _div(a: float, b: float, floor: float = 0.0) -> float | None:
    """a / b, or None when b is at or below the measurement floor."""
    return a / b if b > floor else None


def ratios(rows: list[dict]) -> dict[str, float | None]:
    """Side-by-side ratios from one spec's rows (None: below what the method resolves)."""
    by = {r["what"]: r for r in rows}
    out = {}
    dense = by["mask: dense_mask (vectorised)"]
    bm = next(r for w, r in by.items() if w.startswith("mask: BlockMask"))
    out["dense_mask_bytes / blockmask_bytes"] = dense["mask_MiB"] / bm["mask_MiB"]
    if "mask: dense_mask per row (old)" in by:
        out["dense_mask per-row time / vectorised time"] = (
            by["mask: dense_mask per row (old)"]["ms"] / dense["ms"])
    out["flex fwd time / sdpa fwd time"] = by["attn fwd: flex"]["ms"] / by["attn fwd: sdpa"]["ms"]
    out["flex fwd peak / sdpa fwd peak"] = _div(
        by["attn fwd: flex"]["peak_MiB"], by["attn fwd: sdpa"]["peak_MiB"], 0.5)
    out["sdpa key tiles fwd+bwd time / one dense sdpa call"] = (
        by["attn fwd+bwd: sdpa-tiles"]["ms"] / by["attn fwd+bwd: sdpa"]["ms"])
    if "attn fwd+bwd: flex" in by:
        out["flex fwd+bwd time / sdpa fwd+bwd time"] = (
            by["attn fwd+bwd: flex"]["ms"] / by["attn fwd+bwd: sdpa"]["ms"])
        out["flex fwd+bwd peak / sdpa fwd+bwd peak"] = _div(
            by["attn fwd+bwd: flex"]["peak_MiB"], by["attn fwd+bwd: sdpa"]["peak_MiB"], 0.5)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = base_parser(__doc__.splitlines()[0]).parse_args(argv)
    device, size = resolve(args)
    s, n, b, bt, hq, hkv, d, dtype = LAYOUTS[size]
    repeats = args.repeats or (2 if size == "toy" else 3)
    layout = make_layout(s, n, b, bt, device)
    print(f"layout: S={s} N={n} B={b} Bt={bt} -> Q={n * b} K={s + n * b}; heads {hq}/{hkv} "
          f"D={d} {str(dtype).removeprefix('torch.')} on {device}; median of {repeats}")
    all_rows, all_ratios = [], {}
    for name, spec in SPECS.items():
        if spec.window is not None and spec.window >= s:
            spec = LayerSpec(max(2, s // 4), spec.causal)
        rows = bench_spec(name, spec, layout, (hq, hkv, d), dtype, device, repeats)
        all_rows += rows
        all_ratios[name] = ratios(rows)
    table(all_rows, ["spec", "what", "ms", "peak_MiB", "mask_MiB", "tiles_computed"])
    for name, rs in all_ratios.items():
        for key, val in rs.items():
            print(f"ratio [{name}] {key}: " + ("n/a" if val is None else f"{val:.3g}"))
    return report("attention", args, {
        "device": str(device), "size": size,
        "layout": dict(S=s, N=n, B=b, Bt=bt, Hq=hq, Hkv=hkv, D=d, dtype=str(dtype)),
        "rows": all_rows, "ratios": all_ratios})


if __name__ == "__main__":
    main()
