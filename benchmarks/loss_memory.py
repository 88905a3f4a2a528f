"""Benchmark 6: peak memory of the vocab projection + CE (49k vocab), chunked vs full logits.

M anchored slots of width H go through a frozen LM head (V = 49152) and a CE, forward and
backward to the hidden states. The naive path holds the [M, V] fp32 logits (and their gradient)
at once; ``chunked_head_pass`` holds one chunk of logits and recomputes it in backward.
Peak memory above the inputs is measured per variant in the same run (CUDA: max allocated;
CPU: resident-set high-water mark), with the time of each.

    python -m benchmarks.loss_memory [--device cpu|cuda] [--size toy|cpu|paper]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import base_parser, peak_memory, report, resolve, table, time_it
from dflash_lab.train.loss import chunked_head_pass

#: (M slots, H, V, dtype, chunk sizes) per size; paper M = N*B = 512*16 of one sequence.
SIZES = {
    "toy": (512, 64, 49152, torch.float32, [128]),
    "cpu": (4096, 576, 49152, torch.float32, [1024, 4096]),
    "paper": (8192, 4096, 49152, torch.bfloat16, [1024, 4096]),
}


def naive(hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return F.cross_entropy(logits, labels, reduction="none")


def main(argv: list[str] | None = None) -> dict:
    args = base_parser(__doc__.splitlines()[0]).parse_args(argv)
    device, size = resolve(args)
    m, h, v, dtype, chunks = SIZES[size]
    repeats = args.repeats or (2 if size == "toy" else 3)
    g = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(h, v, bias=False).to(device, dtype).requires_grad_(False)
    base = torch.randn(m, h, generator=g).to(device, dtype)
    labels = torch.randint(0, v, (m,), generator=g).to(device)

    def run(loss_fn):
        hidden = base.detach().requires_grad_()
        loss_fn(hidden).sum().backward()
        return hidden.grad

    variants = {"naive full logits": lambda x: naive(x, labels, lm_head)}
    for c in chunks:
        variants[f"chunked (chunk {c})"] = (
            lambda x, c=c: chunked_head_pass(x, labels, lm_head, chunk_size=c).ce)
    grads, rows = {}, []
    for name, fn in variants.items():
        run(fn)  # warm-up
        with peak_memory(device) as pk:
            grads[name] = run(fn)
        sec = time_it(lambda fn=fn: run(fn), device, repeats, warmup=0)
        rows.append({"variant": name, "peak_MiB": pk.mib, "ms": sec * 1e3,
                     "method": pk.method})
    ref = grads["naive full logits"].float()
    for r in rows:
        r["max_grad_diff"] = (grads[r["variant"]].float() - ref).abs().max().item()
    logits_mib = m * v * 4 / 2**20
    print(f"M={m} slots, H={h}, V={v}, {str(dtype).removeprefix('torch.')} on {device}; "
          f"fp32 logits alone would be {logits_mib:.0f} MiB; median of {repeats}")
    table(rows, ["variant", "peak_MiB", "ms", "max_grad_diff", "method"])
    naive_row = rows[0]
    ratios = {}
    for r in rows[1:]:
        ratios[f"naive peak / {r['variant']} peak"] = naive_row["peak_MiB"] / max(
            r["peak_MiB"], 1e-9)
        ratios[f"{r['variant']} time / naive time"] = r["ms"] / naive_row["ms"]
    for key, val in ratios.items():
        print(f"ratio {key}: {val:.3g}")
    return report("loss_memory", args, {"device": str(device), "size": size,
                                        "dims": dict(M=m, H=h, V=v, dtype=str(dtype)),
                                        "rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
