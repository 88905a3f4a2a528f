"""Benchmark: one training step on one long row, peak memory and step time vs row length.

One step = drafter forward over the row's blocks -> labels at the anchored slots -> chunked
weighted CE -> backward (the DFlashModule's ``blocks_loss`` and ``objective``; no optimizer
step, whose state does not depend on the row length). The drafter is a benchmark shape
(``--size cpu``: a SmolLM2-135M drafter, V = 49152, B = 8, 3 layers; ``toy``: H = 64, V = 512,
B = 4, 2 layers) with every layer either full bidirectional attention or sliding causal
attention of window ``--window``; anchors keep one per :data:`ANCHOR_STRIDE` tokens (the ``cpu``
shape's 32 per 512, a packed row's density), so a row of L tokens drafts Q = L * B / 16 queries
over K = L + Q keys and the attention pairs grow as L^2.

Each (length, layers) point runs in a fresh child process (``--point``) under the pinned
allocator, so its peak is the step's own resident-set high-water mark above the level before
the step (the batch and the drafter are built before). The parent prints the table with the
ratio of each point to the one at half its length, measured side by side in one run. At long
rows the sdpa backend streams mask tiles (attention/sdpa.py, ``STREAM_PAIRS``); ``--dense``
lifts the threshold to show what the dense mask costs where it still fits.

    python -m benchmarks.long_rows [--size cpu|toy] [--lengths 2048,4096,...]
        [--layers full,sliding] [--window 2048] [--dense] [--checkpointing]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (
    SHAPES,
    base_parser,
    drafter_config,
    peak_memory,
    report,
    resolve,
    sync,
    table,
    target_head,
    training_batch,
)
from dflash_lab.attention import sdpa as sdpa_module
from dflash_lab.model.config import FULL, SLIDING
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import step_generator
from dflash_lab.train.module import DFlashModule

LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)
#: Full attention is quadratic: its longest default point (the step takes minutes beyond).
FULL_MAX_LENGTH = 32768
ANCHOR_STRIDE = 16  # one anchor per this many tokens (the cpu shape: 32 anchors per 512)
WINDOW = 2048
#: The CE's chunk budget here (the product default is 512 MiB, train/loss.py): the loss holds
#: one chunk of [rows, V] logits whatever the row length, a constant that would hide the
#: attention path's growth at these sizes (benchmarks/loss_memory.py measures the loss itself).
CE_CHUNK_MIB = 64


def drafter_fields(size: str, layers: str, window: int) -> dict:
    """DrafterConfig overrides for ``layers``: full (bidirectional) or sliding (causal, W)."""
    n = SHAPES[size]["config"]["num_hidden_layers"]
    if layers == "full":
        return {"layer_types": [FULL] * n}
    if layers == "sliding":
        return {"layer_types": [SLIDING] * n, "sliding_window": window, "is_causal": True}
    raise SystemExit(f"--layers {layers!r}: use full | sliding")


def build(size: str, length: int, layers: str, window: int, device: torch.device,
          checkpointing: bool = False):
    """(module, batch) for one point: the ``size`` drafter and one random row of ``length``;
    ``checkpointing``: recompute each draft layer in backward (module.activation_checkpointing)."""
    cfg = drafter_config(size, **drafter_fields(size, layers, window))
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, backend="sdpa").to(device)
    head = target_head(cfg, device, torch.float32)
    module = DFlashModule(drafter, head, None, gamma=4.0,
                          num_anchors=max(1, length // ANCHOR_STRIDE),
                          ce_chunk_bytes=CE_CHUNK_MIB * 2**20,
                          activation_checkpointing=checkpointing).to(device)
    batch = training_batch(cfg, size, device, torch.float32, batch=1, seq_len=length)
    return module, batch


def train_step(module: DFlashModule, batch: dict) -> float:
    """Forward + backward of one step; returns the loss."""
    out = module.blocks_loss(batch, *module.sample_anchors(batch, step_generator(0, 0)))
    loss = module.objective(out, 0)
    loss.backward()
    return loss.item()


def measure_point(size: str, length: int, layers: str, window: int, device: torch.device,
                  checkpointing: bool = False) -> dict:
    """The child's measurement: one step's peak above the level before it, and its seconds."""
    module, batch = build(size, length, layers, window, device, checkpointing)
    sync(device)
    t0 = time.perf_counter()
    with peak_memory(device) as pk:
        loss = train_step(module, batch)
    sync(device)
    sec = time.perf_counter() - t0
    queries = max(1, length // ANCHOR_STRIDE) * module.drafter.config.block_size
    return {"tokens": length, "layers": layers, "queries": queries,
            "peak_MiB": pk.mib, "step_s": sec, "loss": loss, "method": pk.method}


def run_child(size: str, length: int, layers: str, args: argparse.Namespace,
              keep_run_masks: bool = False) -> dict:
    """One point in a fresh pinned process (its peak is not hidden by an earlier point's);
    ``keep_run_masks`` rows are labelled ``LAYERS+kept``."""
    argv = [sys.executable, "-m", "benchmarks.long_rows", "--point", f"{length}:{layers}",
            "--size", size, "--window", str(args.window), "--device", args.device,
            "--allocator", "pinned"]
    argv += ["--dense"] if args.dense else []
    argv += ["--checkpointing"] if args.checkpointing else []
    argv += ["--keep-run-masks"] if keep_run_masks else []
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, check=False)
    label = layers + ("+kept" if keep_run_masks else "")
    if proc.returncode != 0:
        return {"tokens": length, "layers": label, "error": proc.stderr.strip()[-300:]}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "layers": label}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Add each row's peak and time ratio to the same layers' row at half its length."""
    by = {(r["layers"], r["tokens"]): r for r in rows}
    for r in rows:
        half = by.get((r["layers"], r["tokens"] // 2))
        if half and "peak_MiB" in r and "peak_MiB" in half:
            r["peak_x"] = r["peak_MiB"] / max(half["peak_MiB"], 1e-9)
            r["time_x"] = r["step_s"] / max(half["step_s"], 1e-9)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                   help="row lengths in tokens, comma-separated")
    p.add_argument("--layers", default="full,sliding", help="full | sliding | full,sliding")
    p.add_argument("--window", type=int, default=WINDOW, help="sliding window W (tokens)")
    p.add_argument("--full-max", type=int, default=FULL_MAX_LENGTH,
                   help="longest row measured with full layers (quadratic)")
    p.add_argument("--dense", action="store_true",
                   help="never stream: the dense [Q, K] mask at every length")
    p.add_argument("--keep-run-masks", action="store_true",
                   help="streamed runs without their own checkpointing (sdpa STREAM_CHECKPOINT "
                        "off: each run's mask, K/V gather and scores kept for backward)")
    p.add_argument("--side-by-side", action="store_true",
                   help="every point twice, streamed runs checkpointed and kept (LAYERS+kept)")
    p.add_argument("--checkpointing", action="store_true",
                   help="recompute each draft layer in backward (module.activation_checkpointing)")
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # LENGTH:LAYERS child mode
    args = p.parse_args(argv)
    args.size = args.size or "cpu"  # the cpu shape on CUDA too (resolve's default is paper)
    device, size = resolve(args)
    if size == "paper":
        raise SystemExit("--size paper: this benchmark runs the cpu or toy shape")
    if args.dense:
        sdpa_module.STREAM_PAIRS = 1 << 62
    if args.keep_run_masks:
        sdpa_module.STREAM_CHECKPOINT = False
    if args.point:
        length, layers = args.point.split(":")
        print(json.dumps(measure_point(size, int(length), layers, args.window, device,
                                       args.checkpointing)))
        return {}
    rows = []
    for layers in args.layers.split(","):
        for length in map(int, args.lengths.split(",")):
            if layers == "full" and length > args.full_max:
                continue
            for keep in ([False, True] if args.side_by_side else [args.keep_run_masks]):
                rows.append(run_child(size, length, layers, args, keep))
                print(json.dumps(rows[-1]), flush=True)
    rows = with_ratios(rows)
    print(f"\n{size} shape, W = {args.window}, one anchor per {ANCHOR_STRIDE} tokens, "
          f"{'dense masks' if args.dense else 'streamed mask tiles past STREAM_PAIRS'}"
          f"{', activation checkpointing' if args.checkpointing else ''}")
    table(rows, ["layers", "tokens", "queries", "peak_MiB", "peak_x", "step_s", "time_x",
                 "error"])
    return report("long_rows", args, {"rows": rows, "size": size, "window": args.window,
                                      "anchor_stride": ANCHOR_STRIDE, "dense": args.dense,
                                      "checkpointing": args.checkpointing})


if __name__ == "__main__":
    main()
