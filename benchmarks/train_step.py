"""Benchmark 2: training step throughput and model FLOP utilisation (MFU).

One optimizer step = sorted anchor sampling -> drafter forward over the packed blocks -> labels
at anchored slots -> chunked weighted CE -> backward -> AdamW step (the DFlashModule's step
without Lightning's logging). Reported: tokens/s (context positions), anchored blocks/s and
block slots/s, and MFU = executed FLOPs per step (counted by torch's FlopCounterMode: matmuls,
attention, the chunked-CE recompute) / step time / the machine's dense matmul throughput
measured in the same run. ``--compile`` adds the same step with the layer stack compiled.

    python -m benchmarks.train_step [--device cpu|cuda] [--size toy|cpu|paper] [--compile]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import (
    SHAPES,
    base_parser,
    drafter_config,
    matmul_peak_flops,
    peak_memory,
    pinned_child,
    product_optimizer,
    report,
    resolve,
    table,
    target_head,
    time_it,
    training_batch,
)
from dflash_lab.data.anchors import step_generator
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.loss import global_weighted_loss
from dflash_lab.train.module import DFlashModule


def build(size: str, device: torch.device, backend: str, compile_layers: bool = False,
          batch: int | None = None):
    """(module, optimizer, batch) for one size on one device."""
    shape = SHAPES[size]
    cfg = drafter_config(size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, backend=backend).to(device)
    head = target_head(cfg, device, shape["dtype"])
    module = DFlashModule(drafter, head, product_optimizer,
                          gamma=4.0, num_anchors=shape["num_anchors"], compile=compile_layers)
    module = module.to(device)
    if shape["dtype"] != torch.float32:
        drafter.to(shape["dtype"])
    opt = product_optimizer([p for p in drafter.parameters() if p.requires_grad])
    data = training_batch(cfg, size, device, shape["dtype"], batch=batch)
    return module, opt, data


def make_step(module: DFlashModule, opt, batch: dict):
    """One full optimizer step (the step counter drives fresh anchors each call)."""
    counter = [0]

    def step():
        g = step_generator(0, counter[0])
        counter[0] += 1
        out = module.blocks_loss(batch, *module.sample_anchors(batch, g))
        loss = global_weighted_loss(out.weighted_sum, out.weight_sum)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def count_flops(step) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def step_peak_mib(step, device: torch.device) -> float:
    """Peak memory of one (already warmed-up) step, above the level before it."""
    with peak_memory(device) as pk:
        step()
    return pk.mib


def child_peak_mib(size: str, device: torch.device, backend: str, compile_layers: bool) -> float:
    """The pinned child's measurement: its own module, one warm-up step, one measured step."""
    module, opt, batch = build(size, device, backend, compile_layers)
    step = make_step(module, opt, batch)
    step()
    return step_peak_mib(step, device)


def run_variant(name: str, size: str, device: torch.device, backend: str, repeats: int,
                peak_flops: float, compile_layers: bool = False, allocator: str = "default",
                ) -> dict:
    module, opt, batch = build(size, device, backend, compile_layers)
    step = make_step(module, opt, batch)
    step()  # warm-up: allocator, optimizer state, compilation
    flops = count_flops(step) if not compile_layers else None
    sec = time_it(step, device, repeats, warmup=1)
    if device.type == "cpu" and allocator != "pinned":  # steps timed as training runs them
        argv = ["--peak-of", backend, "--size", size, "--device", "cpu"]
        peak_mib = pinned_child("benchmarks.train_step",
                                argv + (["--compile"] if compile_layers else []))["peak_MiB"]
    else:  # the same module: a second one would double GPU memory and compile again
        peak_mib = step_peak_mib(step, device)
    bt, s = batch["input_ids"].shape
    n, b = SHAPES[size]["num_anchors"], module.drafter.config.block_size
    row = {"variant": name, "backend": backend, "step_ms": sec * 1e3,
           "tokens/s": bt * s / sec, "anchors/s": bt * n / sec, "slots/s": bt * n * b / sec,
           "peak_MiB": peak_mib}
    if flops is not None:
        row["GFLOP/step"] = flops / 1e9
        row["MFU"] = flops / sec / peak_flops
    return row


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.splitlines()[0], allocator="default")
    p.add_argument("--compile", action="store_true", help="also time the compiled layer stack")
    p.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)  # BACKEND: child mode
    args = p.parse_args(argv)
    device, size = resolve(args)
    if args.peak_of:  # a pinned child of run_variant: one step's peak, as JSON
        print(json.dumps({"peak_MiB": child_peak_mib(size, device, args.peak_of, args.compile)}))
        return {}
    repeats = args.repeats or (2 if size == "toy" else 5)
    dtype = SHAPES[size]["dtype"]
    peak_flops, what = matmul_peak_flops(device, dtype if device.type == "cuda" else None,
                                         n=256 if size == "toy" else None)
    print(f"measured matmul peak: {peak_flops / 1e9:.1f} GFLOP/s ({what})")
    backends = ["sdpa"] + (["flex"] if device.type == "cuda" else [])
    rows = [run_variant(f"eager/{b}", size, device, b, repeats, peak_flops,
                        allocator=args.allocator) for b in backends]
    if args.compile:
        rows += [run_variant(f"compiled/{b}", size, device, b, repeats, peak_flops, True,
                             args.allocator) for b in backends]
    # The matmul peak again after the steps: how much the machine's speed moved during the run.
    peak_after, _ = matmul_peak_flops(device, dtype if device.type == "cuda" else None,
                                      n=256 if size == "toy" else None)
    shape = SHAPES[size]
    print(f"size {size}: S={shape['seq_len']} N={shape['num_anchors']} "
          f"B={shape['config']['block_size']} Bt={shape['batch']} "
          f"H={shape['config']['hidden_size']} layers={shape['config']['num_hidden_layers']} "
          f"V={shape['config']['vocab_size']} {str(dtype).removeprefix('torch.')} on {device}; "
          f"median of {repeats}; steps timed with the {args.allocator} allocator")
    table(rows, ["variant", "step_ms", "tokens/s", "anchors/s", "slots/s", "GFLOP/step", "MFU",
                 "peak_MiB"])
    ratios = {"matmul peak after / before (machine drift)": peak_after / peak_flops}
    by = {r["variant"]: r for r in rows}
    if "eager/flex" in by:
        ratios["flex step / sdpa step"] = by["eager/flex"]["step_ms"] / by["eager/sdpa"]["step_ms"]
    for b in backends:
        if f"compiled/{b}" in by:
            ratios[f"compiled / eager step ({b})"] = (
                by[f"compiled/{b}"]["step_ms"] / by[f"eager/{b}"]["step_ms"])
    for key, val in ratios.items():
        print(f"ratio {key}: {val:.3g}")
    return report("train_step", args, {"device": str(device), "size": size,
                                       "allocator": args.allocator,
                                       "matmul_peak_flops": peak_flops, "matmul": what,
                                       "rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
