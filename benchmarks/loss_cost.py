"""Benchmark: the cost of each training loss against CE (issue 27 item 8).

One full optimizer step (anchors -> drafter -> head pass -> backward -> AdamW) of the same
drafter shape, batch and anchors for every ``module.loss``: the label CE (the default path),
each distribution loss against a dense teacher (the target's last hidden state, projected by
the head in the pass), KL against a top-k teacher, and the accept objective; ``floor`` is the CE
step plus the dense teacher's projection alone (its slots' last hidden states through the head,
no grad, in the dense pass's chunks): what any loss with a dense teacher costs at least. The
steps of all losses run interleaved, their order rotating every round, so a load change on the
machine hits every loss alike; each ratio is the median over rounds of (loss step / CE step) in
the same round. Steps are timed under glibc's default allocator, as a training run has them;
peak memory (each warm step's rise above the level before it) is taken in a pinned child
process on CPU (``benchmarks/common.py``: the pinned allocator makes every large allocation
page-fault, which would charge the slice temporaries of the distribution pass a cost training
does not pay).
Goals (at the SmolLM2 shape, ``--size cpu``): KL / TV / NLA steps within 1.15x of CE's time,
peak memory within 1.1x.

    python -m benchmarks.loss_cost [--device cpu|cuda] [--size toy|cpu|paper] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.common import (
    SHAPES,
    base_parser,
    drafter_config,
    pinned_child,
    product_optimizer,
    report,
    resolve,
    table,
    target_head,
    teacher_batch,
    training_batch,
)
from benchmarks.train_step import interleaved_seconds, make_step, step_peak_mib
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.module import DFlashModule

#: name -> (module.loss, teacher kind)
LOSSES = {
    "ce": ("ce", "dense"), "kl": ({"kl": 1.0}, "dense"), "tv": ({"tv": 1.0}, "dense"),
    "nla": ({"nla": 1.0}, "dense"), "jsd": ({"jsd": 1.0}, "dense"),
    "rkl": ({"rkl": 1.0}, "dense"), "lk_hybrid": ({"lk_hybrid": 1.0}, "dense"),
    "ce+tv": ({"ce": 0.1, "tv": 0.9}, "dense"), "accept": ({"accept": 1.0}, "dense"),
    "kl_top64": ({"kl": 1.0}, "top64"),
    "floor": ("ce", "dense"),  # CE + the dense teacher's head projection (with_teacher_projection)
}
TOPK = 64


def build(name: str, size: str, device: torch.device, backend: str):
    loss, kind = LOSSES[name]
    cfg = drafter_config(size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, backend=backend).to(device)
    head = target_head(cfg, device, SHAPES[size]["dtype"])
    held = {"last_hidden": kind == "dense", "topk": TOPK if kind == "top64" else 0}
    module = DFlashModule(drafter, head, product_optimizer, gamma=4.0, loss=loss,
                          num_anchors=SHAPES[size]["num_anchors"], val_temperatures=[],
                          target_distribution=held).to(device)
    opt = product_optimizer([p for p in drafter.parameters() if p.requires_grad])
    batch = teacher_batch(training_batch(cfg, size, device, SHAPES[size]["dtype"]), head,
                          topk=TOPK)
    step = make_step(module, opt, batch)
    return module, (with_teacher_projection(step, head, batch, size, cfg) if name == "floor"
                    else step)


def with_teacher_projection(step, head, batch: dict, size: str, config):
    """``step`` followed by the projection a dense teacher adds: one row per valid slot
    (anchors x (block - 1)) through the head, in the chunks the dense KL pass takes."""
    from dflash_lab.train.distill import LossSpec
    from dflash_lab.train.distill_head import distill_buffers, distill_rows
    from dflash_lab.train.loss import CE_CHUNK_BYTES

    weight = head.lm_head.weight
    slots = SHAPES[size]["num_anchors"] * (config.block_size - 1) * SHAPES[size]["batch"]
    last = batch["target_last_hidden"].reshape(-1, weight.shape[1])[:slots]
    rows = distill_rows(slots, weight.shape[0], None, CE_CHUNK_BYTES,
                        distill_buffers(LossSpec.create("kl"), True))

    def floor_step():
        loss = step()
        with torch.no_grad():
            for start in range(0, slots, rows):
                (weight @ last[start:start + rows].t()).float()
        return loss

    return floor_step


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.split("\n")[0], allocator="default")  # steps timed as trained
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    parser.add_argument("--peaks-only", action="store_true", help=argparse.SUPPRESS)  # child
    args = parser.parse_args(argv)
    device, size = resolve(args)
    repeats = args.repeats or (3 if size == "toy" else 8)
    names = ["ce", *[n for n in args.losses if n != "ce"]]
    built = {n: build(n, size, device, "sdpa") for n in names}
    steps = {n: step for n, (_, step) in built.items()}
    for step in steps.values():  # warm-up: allocator, kernels
        step()
    if args.peaks_only:  # a pinned child: every loss's peak, as JSON
        print(json.dumps({n: step_peak_mib(step, device, built[n][0])
                          for n, step in steps.items()}))
        return {}
    times = interleaved_seconds(steps, device, repeats)
    if device.type == "cpu" and args.allocator != "pinned":
        peaks = pinned_child("benchmarks.loss_cost", ["--peaks-only", "--device", "cpu",
                                                      "--size", size, "--losses", *names])
    else:
        peaks = {n: step_peak_mib(step, device, built[n][0]) for n, step in steps.items()}
    rows = []
    for n in names:
        ratio = statistics.median(t / c for t, c in zip(times[n], times["ce"], strict=True))
        rows.append({"loss": n, "step_ms": 1e3 * statistics.median(times[n]),
                     "time_vs_ce": ratio, "peak_mib": peaks[n],
                     "peak_vs_ce": peaks[n] / max(peaks["ce"], 1e-9)})
    table(rows, ["loss", "step_ms", "time_vs_ce", "peak_mib", "peak_vs_ce"])
    return report("loss_cost", args, {"size": size, "repeats": repeats, "rows": rows})


if __name__ == "__main__":
    main()
