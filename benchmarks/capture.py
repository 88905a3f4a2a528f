"""Benchmark 5: capture throughput (tokens/s) and bytes per token on disk.

``run_capture`` on the built-in tiny target over demo conversations (chat template, target
forward with hidden states at 5 layers, argmax labels, shard writing), in variants side by side:
feature storage bfloat16 vs float32, and batched vs one sequence per forward. Bytes per token
are measured on disk (every file the capture wrote) and compared with the manifest's formula
(hidden + input id + argmax id + loss-mask byte).

    python -m benchmarks.capture [--device cpu|cuda] [--size toy|cpu|paper]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import base_parser, report, resolve, sync, table

VARIANTS = [("bfloat16", 8), ("float32", 8), ("bfloat16", 1)]
ROWS = {"toy": 4, "cpu": 96, "paper": 512}


def run_variant(target, rows: list[dict], hidden_dtype: str, batch_size: int,
                layer_ids: list[int], device: torch.device) -> dict:
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture

    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        settings = CaptureSettings(out_dir=tmp, target_layer_ids=layer_ids, max_length=512,
                                   hidden_dtype=hidden_dtype, shard_size=32,
                                   batch_size=batch_size)
        sync(device)
        t0 = time.perf_counter()
        manifest = run_capture(target, rows, settings, {"path": "demo_conversations"},
                               progress=False)
        sync(device)
        sec = time.perf_counter() - t0
        disk = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
        tokens = manifest["num_tokens"]
        formula = json.loads((Path(tmp) / "manifest.json").read_text())
    per_token = formula.get("bytes_per_token") or formula.get("plan", {}).get("bytes_per_token")
    return {"hidden_dtype": hidden_dtype, "batch_size": batch_size, "tokens": tokens,
            "seconds": sec, "tokens/s": tokens / sec, "disk_bytes/token": disk / tokens,
            "formula_bytes/token": per_token}


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.splitlines()[0], allocator="default")  # times only
    p.add_argument("--tiny-target", default="outputs/tiny_target")
    args = p.parse_args(argv)
    device, size = resolve(args)
    from dflash_lab.model.config import build_target_layer_ids
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.targets.loader import load_target
    from dflash_lab.targets.tiny import materialize_tiny_target

    root = materialize_tiny_target(args.tiny_target)
    target = load_target(str(root), dtype="float32", device=str(device))
    layer_ids = build_target_layer_ids(target.num_hidden_layers, 5)
    rows = [{"messages": c} for c in demo_conversations(ROWS[size], seed=11)]
    run_variant(target, rows[:4], "bfloat16", 4, layer_ids, device)  # warm-up
    results = [run_variant(target, rows, dt, bs, layer_ids, device) for dt, bs in VARIANTS]
    print(f"capture on the tiny target ({target.num_hidden_layers} layers, "
          f"H={target.hidden_size}, features of layers {layer_ids}) on {device}: "
          f"{len(rows)} demo conversations, max_length 512")
    table(results, ["hidden_dtype", "batch_size", "tokens", "seconds", "tokens/s",
                    "disk_bytes/token", "formula_bytes/token"])
    base, fp32, single = results
    ratios = {
        "disk bytes/token float32 / bfloat16": fp32["disk_bytes/token"] / base["disk_bytes/token"],
        "disk / formula bytes per token (bfloat16)":
            base["disk_bytes/token"] / base["formula_bytes/token"],
        "tokens/s batch 8 / batch 1": base["tokens/s"] / single["tokens/s"],
    }
    for key, val in ratios.items():
        print(f"ratio {key}: {val:.3g}")
    return report("capture", args, {"device": str(device), "size": size, "rows": results,
                                    "ratios": ratios})


if __name__ == "__main__":
    main()
