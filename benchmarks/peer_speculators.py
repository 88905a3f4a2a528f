"""Benchmark 3: our training step against speculators 0.9.0's DFlash trainer, same work.

Same drafter shape (``SHAPES[size]``: layers, width, heads, vocab, block size), same batch (one
sequence of S tokens, every token supervised), same number of anchors N, same labels (the CE
on the target's argmax), gamma, AdamW. speculators runs from its own venv
(``.venv-speculators``, ``make speculators-venv``) with sdpa attention and its eager loss (its
flex attention has no CPU backward and its fused loss needs Triton). Each side runs in a fresh
process (both alive at once, only one working at a time) and, after warm-up, the two sides
alternate single optimizer steps, so a load change on the machine hits both; the speed-up is the
median over step pairs. Steps are timed under glibc's default allocator, as training runs them;
a second pair of workers with the pinned allocator (benchmarks/common.py) measures each side's
peak memory above its pre-step level and times a few more pairs. Optimizers: ours is the one
conf/module/default.yaml configures (fused AdamW); theirs is what speculators' trainer builds
(``torch.optim.AdamW`` with its defaults).

Ratios: our step time / theirs (goal <= 1/1.5 = 0.67) and our peak / theirs (goal <= 1). Their
step also projects the verifier's last hidden state through norm + LM head at every anchored
slot to get labels (we store the target's argmax at capture time); that projection is timed on
its own and a second time ratio leaves it out.

``--variant dflash2``: both sides train a DFlash 2 drafter of that shape (the released conv and
selector setting, ``benchmarks.train_step.DFLASH2``) on the unary CE plus 1.0 x the K-way
selector CE, teacher-forced, with a gold token outside the unary top-K swapped in for the K-th
candidate (speculators' only rule; ours is ``module.selector.missing_gold=swap``); speculators'
``DFlash2DraftModel`` also computes its eager TV metric over the vocabulary every step (part of
its step, as its trainer runs it), we compute our selector metrics (recall, accuracy, the walk).

    python -m benchmarks.peer_speculators [--size toy|cpu] [--repeats STEP_PAIRS]
        [--variant dflash1|dflash2]
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.common import SHAPES, base_parser, report, resolve, table
from benchmarks.speculators_worker import serve

ROOT = Path(__file__).resolve().parent.parent
SPEC_PYTHON = Path(os.environ.get("SPECULATORS_PYTHON",
                                  ROOT / ".venv-speculators" / "bin" / "python"))
GAMMA = 4.0


def shape_json(size: str, variant: str = "dflash1") -> str:
    from benchmarks.train_step import DFLASH2

    shape = SHAPES[size]
    config = {**shape["config"], **(DFLASH2 if variant == "dflash2" else {})}
    return json.dumps({"config": config, "seq_len": shape["seq_len"],
                       "num_anchors": shape["num_anchors"], "gamma": GAMMA,
                       "selector_alpha": 1.0})


def our_worker(size: str, warmup: int, device: torch.device, variant: str = "dflash1") -> None:
    """Our side, in its own process, speaking the worker line protocol."""
    from benchmarks.train_step import build, held_grad_bytes, make_step

    module, opt, batch = build(size, device, "sdpa", batch=1, variant=variant)
    step = make_step(module, opt, batch)
    for _ in range(warmup):
        step()
    params = sum(p.numel() for p in module.drafter.parameters() if p.requires_grad)
    serve({"step": lambda: float(step().detach()), "held": lambda: held_grad_bytes(module)},
          device,
          {"who": "dflash-lab", "trainable_params": params, "torch": torch.__version__})


class Worker:
    """A running worker process (either side) and its line protocol."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args[:3]} died:\n"
                               f"{self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def alternate(size: str, warmup: int, steps: int, allocator: str, with_peaks: bool = False,
              variant: str = "dflash1"):
    """Start both workers with one allocator setting and alternate single steps (who goes
    first swaps every pair). Returns ([(ours_s, theirs_s)], [infos], peaks by who or None,
    the median seconds of their target projection)."""
    ours = Worker([sys.executable, "-m", "benchmarks.peer_speculators", "--worker", "--size",
                   size, "--device", "cpu", "--allocator", allocator, "--variant", variant])
    theirs = Worker([str(SPEC_PYTHON), "benchmarks/speculators_worker.py", "--shape",
                     shape_json(size, variant), "--warmup", str(warmup), "--allocator",
                     allocator])
    peaks = None
    try:
        pairs = []
        for i in range(steps):
            first, second = (ours, theirs) if i % 2 == 0 else (theirs, ours)
            a, b = first.ask("time step")["seconds"], second.ask("time step")["seconds"]
            pairs.append((a, b) if first is ours else (b, a))
        if with_peaks:
            peaks = {w.info["who"]: w.ask("peak step")["peak_bytes"] for w in (ours, theirs)}
        proj = statistics.median(theirs.ask("time projection")["seconds"] for _ in range(3))
        return pairs, [ours.info, theirs.info], peaks, proj
    finally:
        ours.close()
        theirs.close()


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.splitlines()[0], allocator="default")
    p.add_argument("--variant", default="dflash1", choices=["dflash1", "dflash2"],
                   help="drafter variant both sides train (dflash2: conv + candidate selector)")
    p.add_argument("--worker", action="store_true", help=argparse_hidden())
    args = p.parse_args(argv)
    device, size = resolve(args)
    steps = args.repeats or (3 if size == "toy" else 20)
    warmup = 1 if size == "toy" else 2
    if args.worker:
        our_worker(size, warmup, device, args.variant)
        return {}
    if device.type != "cpu":
        raise SystemExit("the peer comparison runs on CPU only: speculators is installed in "
                         ".venv-speculators on the CPU machine (none on the GPU machine)")
    if not SPEC_PYTHON.exists():
        raise SystemExit(f"{SPEC_PYTHON} not found: run `make speculators-venv` first")
    # Steps are timed under glibc's default allocator (as a training run has it); peaks are
    # taken by a second pair of workers with the pinned allocator (benchmarks/common.py), which
    # also time a few pairs so the two settings can be compared.
    pairs, infos, _, proj = alternate(size, warmup, steps, "default", variant=args.variant)
    pinned_pairs, _, peaks, _ = alternate(size, warmup, max(2, steps // 4), "pinned",
                                          with_peaks=True, variant=args.variant)
    ours_s = [x for x, _ in pairs]
    theirs_s = [y for _, y in pairs]
    paired = statistics.median(y / x for x, y in pairs)
    rows = []
    for info, times in zip(infos, (ours_s, theirs_s)):
        rows.append({"who": info["who"], "step_ms": statistics.median(times) * 1e3,
                     "min_step_ms": min(times) * 1e3, "peak_MiB": peaks[info["who"]] / 2**20,
                     "trainable_params": info["trainable_params"], "torch": info["torch"]})
    rows[1]["target_projection_ms"] = proj * 1e3
    shape = SHAPES[size]
    print(f"variant {args.variant}; shape {size}: S={shape['seq_len']} N={shape['num_anchors']} "
          f"B={shape['config']['block_size']} H={shape['config']['hidden_size']} "
          f"layers={shape['config']['num_hidden_layers']} V={shape['config']['vocab_size']} fp32 "
          f"cpu; {steps} alternating step pairs (glibc default allocator), peaks and "
          f"{len(pinned_pairs)} more pairs with the pinned allocator")
    table(rows, ["who", "step_ms", "min_step_ms", "peak_MiB", "trainable_params",
                 "target_projection_ms", "torch"])
    ratios = {
        "speedup, median of paired steps (theirs / ours)": paired,
        "speedup, median step theirs / median step ours": rows[1]["step_ms"] / rows[0]["step_ms"],
        "speedup, fastest step theirs / fastest ours":
            rows[1]["min_step_ms"] / rows[0]["min_step_ms"],
        "speedup without their target projection (paired)":
            statistics.median((y - proj) / x for x, y in pairs),
        "speedup with the pinned allocator (paired)":
            statistics.median(y / x for x, y in pinned_pairs),
        "our peak / speculators peak": rows[0]["peak_MiB"] / max(rows[1]["peak_MiB"], 1e-9),
    }
    for key, val in ratios.items():
        print(f"ratio {key}: {val:.3g}")
    goal = paired >= 1.5 and ratios["our peak / speculators peak"] <= 1.0
    print(f"goal (>= 1.5x faster, peak <= theirs): {'met' if goal else 'NOT met'}")
    return report("peer_speculators", args, {"size": size, "variant": args.variant,
                                             "rows": rows, "ratios": ratios,
                                             "goal_met": goal, "pairs_s": pairs,
                                             "pinned_pairs_s": pinned_pairs})


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
