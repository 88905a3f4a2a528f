"""Benchmark 2: training step throughput and model FLOP utilisation (MFU).

One optimizer step = sorted anchor sampling -> drafter forward over the packed blocks -> labels
at anchored slots -> chunked weighted CE -> backward -> AdamW step (the DFlashModule's step
without Lightning's logging). Reported: tokens/s (context positions), anchored blocks/s and
block slots/s, and MFU = executed FLOPs per step (counted by torch's FlopCounterMode: matmuls,
attention, the chunked-CE recompute) / step time / the machine's dense matmul throughput
measured in the same run. ``--compile`` adds the same step with the layer stack compiled.

``--variant both`` (the default) builds a DFlash 1 and a DFlash 2 drafter of the same shape in
one process and alternates their steps (who goes first rotates every round), so a load change on
the machine hits both; the ratio DFlash 2 / DFlash 1 is the median over step pairs (goal
<= 1.15). ``--variant all`` (or ``--heads dflash2,xpress,...``) does the same for every head
(``common.head_names``: dflash1 and each conf/drafter/NAME.yaml setting a variant), each ratio
against DFlash 1 measured in that run. A head's drafter fields come from its
conf/drafter/NAME.yaml (``common.head_fields``), its loss settings (``module.head``) from the
head's own defaults; DFlash 2 trains its selector (alpha 1, ``missing_gold: swap``), and a
head whose loss reads the target's distribution (LiLiCorr's penalty) gets a dense teacher.

    python -m benchmarks.train_step [--device cpu|cuda] [--size toy|cpu|paper] [--compile]
        [--variant dflash1|dflash2|both|all|HEAD] [--heads dflash2,dspark,...]
        [--width qwen3] [--no-peak]

``--width qwen3`` keeps the size's sequence, anchors and blocks and takes a Qwen3 width
(``WIDTHS``), where the two selector codebooks are a small share of the drafter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import (
    SHAPES,
    base_parser,
    drafter_config,
    head_fields,
    head_names,
    matmul_peak_flops,
    peak_memory,
    pinned_child,
    product_optimizer,
    report,
    resolve,
    sync,
    table,
    target_head,
    teacher_batch,
    training_batch,
)
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import step_generator
from dflash_lab.train.module import DFlashModule

VARIANTS = ("dflash1", "dflash2")
#: The DFlash 2 drafter fields, conf/drafter/dflash2.yaml's: the released Qwen3.8-27B-DFlash2
#: setting (dflash.md section 7): K=2 taps and group 16 per channel, top-16 and rank 256 per
#: token, none of them scaling with the width (at H=576, V=49152 the two [V, 256] codebooks
#: hold 25.2 M parameters, twice the rest of the drafter).
DFLASH2 = head_fields("dflash2")


#: ``--width``: drafter fields over the size's own (its sequence, anchors and block stay).
#: qwen3: Qwen3-1.7B's width and vocabulary (H=2048, I=6144, 16/8 heads of 128, V=151936),
#: the qwen3.8_27b_dflash2 recipe's five target layers, its five draft layers scaled down to
#: two so both drafters, their AdamW state and the two frozen [V, H] heads fit in ~12 GB of RAM.
WIDTHS = {"qwen3": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=128, intermediate_size=6144, vocab_size=151936,
                        mask_token_id=151669, num_target_layers=28,
                        target_layer_ids=[1, 7, 13, 19, 25], num_hidden_layers=2,
                        rms_norm_eps=1e-6, rope_theta=1000000.0)}


def build(size: str, device: torch.device, backend: str, compile_layers: bool = False,
          batch: int | None = None, variant: str = "dflash1", missing_gold: str = "swap",
          selector_rank: int | None = None, width: str | None = None):
    """(module, optimizer, batch) for one size on one device. ``variant``: a head name
    (``head_names``; dflash2: ``DFLASH2``; ``missing_gold``: the selector's rule for a gold
    token outside the top-K;
    ``swap`` by default, so every valid slot trains the selector: random labels are almost
    never among a random drafter's top-16 of 49k, and ``exclude`` would train none);
    ``selector_rank``: overrides DFlash 2's rank (the codebooks' size); ``width``: a key
    of ``WIDTHS`` (None: the size's own width)."""
    shape = SHAPES[size]
    fields = head_fields(variant)
    if selector_rank and "selector_rank" in fields:
        fields["selector_rank"] = selector_rank
    cfg = drafter_config(size, **WIDTHS.get(width, {}), **fields)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, backend=backend).to(device)
    head = target_head(cfg, device, shape["dtype"])
    selector = {"alpha": 1.0, "missing_gold": missing_gold} if variant == "dflash2" else None
    # a dense teacher on offer; val_temperatures=[]: only a head whose loss needs it reads it
    module = DFlashModule(drafter, head, product_optimizer, gamma=4.0,
                          num_anchors=shape["num_anchors"], compile=compile_layers,
                          selector=selector, target_distribution={"last_hidden": True},
                          val_temperatures=[])
    module = module.to(device)
    if shape["dtype"] != torch.float32:
        drafter.to(shape["dtype"])
    opt = product_optimizer([p for p in drafter.parameters() if p.requires_grad])
    data = teacher_batch(training_batch(cfg, size, device, shape["dtype"], batch=batch), head)
    return module, opt, data


def make_step(module: DFlashModule, opt, batch: dict):
    """One full optimizer step (the step counter drives fresh anchors each call); the loss is the
    module's objective: unary, plus alpha x the selector term for DFlash 2."""
    counter = [0]

    def step():
        g = step_generator(0, counter[0])
        out = module.blocks_loss(batch, *module.sample_anchors(batch, g))
        loss = module.objective(out, counter[0])
        counter[0] += 1
        loss.backward()
        opt.step()
        module.optimizer_zero_grad(0, counter[0], opt)  # as the Lightning loop zeroes them
        return loss

    return step


class _TotalOnly:
    """FlopCounterMode's module tracker reduced to the total it reports (``Global``): torch's
    tracker hooks every module and asserts on one called on grad-requiring leaves outside
    autograd (XPress's argmax passes), where the total needs no per-module split."""

    parents = ("Global",)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def count_flops(step) -> int:
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _TotalOnly()
    with counter:
        step()
    return counter.get_total_flops()


def held_grad_bytes(module: DFlashModule) -> int:
    """Bytes of gradients alive between steps (the DFlash 2 codebook buffers the module keeps,
    CPU): memory of the step's backward that a rise above the pre-step level cannot see."""
    return sum(p.grad.nbytes for p in module.drafter.parameters() if p.grad is not None)


def step_peak_mib(step, device: torch.device, module: DFlashModule | None = None) -> float:
    """Peak memory of one (already warmed-up) step above the level before it, plus the
    gradients ``module`` keeps between steps (so a kept buffer counts as a fresh one would)."""
    held = held_grad_bytes(module) if module is not None else 0
    with peak_memory(device) as pk:
        step()
    return pk.mib + held / 2**20


def child_peak_mib(size: str, device: torch.device, backend: str, compile_layers: bool,
                   variant: str = "dflash1", selector_rank: int | None = None,
                   width: str | None = None) -> float:
    """The pinned child's measurement: its own module, one warm-up step, one measured step."""
    module, opt, batch = build(size, device, backend, compile_layers, variant=variant,
                               selector_rank=selector_rank, width=width)
    step = make_step(module, opt, batch)
    step()
    return step_peak_mib(step, device, module)


def interleaved_seconds(steps: dict, device: torch.device, repeats: int) -> dict[str, list]:
    """Seconds of ``repeats`` rounds of one step of every variant, in an order that rotates
    every round, so a change of the machine's speed hits every variant alike."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            sync(device)
            t0 = time.perf_counter()
            steps[name]()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def run_variants(variants: list[str], size: str, device: torch.device, backend: str,
                 repeats: int, peak_flops: float, compile_layers: bool = False,
                 allocator: str = "default", selector_rank: int | None = None,
                 width: str | None = None, peaks: bool = True,
                 ) -> tuple[list[dict], dict[str, list]]:
    """One row per drafter variant (their steps interleaved) and every step's seconds;
    ``peaks`` False: no peak column (a wide shape's pinned child would double the RAM)."""
    prefix = "compiled" if compile_layers else "eager"
    built = {v: build(size, device, backend, compile_layers, variant=v,
                      selector_rank=selector_rank, width=width) for v in variants}
    steps = {v: make_step(*built[v]) for v in variants}
    for step in steps.values():  # warm-up: allocator, optimizer state, compilation
        step()
        step()
    flops = {v: count_flops(steps[v]) for v in variants} if not compile_layers else {}
    times = interleaved_seconds(steps, device, repeats)
    rows = []
    for v in variants:
        module, _, batch = built[v]
        sec = statistics.median(times[v])
        if not peaks:
            peak_mib = float("nan")
        elif device.type == "cpu" and allocator != "pinned":  # steps timed as training runs
            argv = ["--peak-of", backend, "--variant", v, "--size", size, "--device", "cpu"]
            argv += ["--selector-rank", str(selector_rank)] if selector_rank else []
            argv += ["--width", width] if width else []
            peak_mib = pinned_child("benchmarks.train_step",
                                    argv + (["--compile"] if compile_layers else []))["peak_MiB"]
        else:  # the same module: a second one would double GPU memory and compile again
            peak_mib = step_peak_mib(steps[v], device, module)
        bt, s = batch["input_ids"].shape
        n, b = SHAPES[size]["num_anchors"], module.drafter.config.block_size
        row = {"variant": f"{prefix}/{backend}/{v}", "step_ms": sec * 1e3,
               "tokens/s": bt * s / sec, "anchors/s": bt * n / sec, "slots/s": bt * n * b / sec,
               "trainable_params": sum(p.numel() for p in module.drafter.parameters()
                                       if p.requires_grad),
               "peak_MiB": peak_mib}
        if v in flops:
            row["GFLOP/step"] = flops[v] / 1e9
            row["MFU"] = flops[v] / sec / peak_flops
        rows.append(row)
    return rows, times


def variant_ratios(rows: list[dict], times: dict[str, list], prefix: str) -> dict[str, float]:
    """Every head / DFlash 1 measured in this run: median of paired steps (the steps of one
    round; DFlash 2's goal <= 1.15), median / median, peaks."""
    if "dflash1" not in times or len(times) < 2:
        return {}
    by = {r["variant"].rsplit("/", 1)[1]: r for r in rows}
    one, out = by["dflash1"], {}
    for v in (v for v in times if v != "dflash1"):
        pairs = [b / a for a, b in zip(times["dflash1"], times[v])]
        out[f"{v} / dflash1 step, median of paired steps ({prefix})"] = statistics.median(pairs)
        out[f"{v} / dflash1 step, median / median ({prefix})"] = (by[v]["step_ms"]
                                                                  / one["step_ms"])
        out[f"{v} / dflash1 peak ({prefix})"] = by[v]["peak_MiB"] / max(one["peak_MiB"], 1e-9)
    return out


def chosen_heads(variant: str, heads: str | None) -> list[str]:
    """``--variant`` / ``--heads`` as a list of head names, DFlash 1 first (every ratio's base)
    unless a single head is asked; an unknown name: one ``error:`` line, exit 2."""
    known = head_names()
    if heads:
        names = [h.strip() for h in heads.split(",") if h.strip()]
        names = ["dflash1", *(h for h in names if h != "dflash1")]
    else:
        names = {"both": list(VARIANTS), "all": known}.get(variant, [variant])
    bad = [h for h in names if h not in known]
    if bad:
        print(f"error: head {bad[0]!r} (--variant/--heads): no conf/drafter/{bad[0]}.yaml sets "
              f"a variant; use one of {','.join(known)} (or both, all)", file=sys.stderr)
        raise SystemExit(2)
    return names


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.splitlines()[0], allocator="default")
    p.add_argument("--compile", action="store_true", help="also time the compiled layer stack")
    p.add_argument("--variant", default="both",
                   help="a head (common.head_names), both (DFlash 1 and DFlash 2) or all "
                        "(every head): their steps interleaved")
    p.add_argument("--heads", default=None,
                   help="comma-separated heads timed against dflash1 (overrides --variant)")
    p.add_argument("--selector-rank", type=int, default=None,
                   help=f"DFlash 2 selector rank (default {DFLASH2['selector_rank']}, released)")
    p.add_argument("--width", default=None, choices=sorted(WIDTHS),
                   help="drafter width over the size's own (WIDTHS; default: the size's)")
    p.add_argument("--no-peak", action="store_true",
                   help="skip the peak-memory children (a wide shape would need twice the RAM)")
    p.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)  # BACKEND: child mode
    args = p.parse_args(argv)
    device, size = resolve(args)
    variants = chosen_heads(args.variant, args.heads)
    if args.peak_of:  # a pinned child of run_variants: one step's peak, as JSON
        print(json.dumps({"peak_MiB": child_peak_mib(size, device, args.peak_of, args.compile,
                                                     variants[0], args.selector_rank,
                                                     args.width)}))
        return {}
    repeats = args.repeats or (2 if size == "toy" else 5)
    dtype = SHAPES[size]["dtype"]
    peak_flops, what = matmul_peak_flops(device, dtype if device.type == "cuda" else None,
                                         n=256 if size == "toy" else None)
    print(f"measured matmul peak: {peak_flops / 1e9:.1f} GFLOP/s ({what})")
    backends = ["sdpa"] + (["flex"] if device.type == "cuda" else [])
    rows, ratios, step_s = [], {}, {}
    for compiled in [False] + ([True] if args.compile else []):
        for b in backends:
            got, times = run_variants(variants, size, device, b, repeats, peak_flops, compiled,
                                      args.allocator, args.selector_rank, args.width,
                                      not args.no_peak)
            prefix = f"{'compiled' if compiled else 'eager'}/{b}"
            rows += got
            ratios.update(variant_ratios(got, times, prefix))
            step_s[prefix] = times
    # The matmul peak again after the steps: how much the machine's speed moved during the run.
    peak_after, _ = matmul_peak_flops(device, dtype if device.type == "cuda" else None,
                                      n=256 if size == "toy" else None)
    dflash2 = {**DFLASH2, "selector_rank": args.selector_rank or DFLASH2["selector_rank"]}
    print_shape(size, device, repeats, args.allocator, variants, args.width)
    table(rows, ["variant", "step_ms", "tokens/s", "anchors/s", "slots/s", "GFLOP/step", "MFU",
                 "trainable_params", "peak_MiB"])
    ratios = {"matmul peak after / before (machine drift)": peak_after / peak_flops,
              **ratios, **backend_ratios(rows, variants)}
    for key, val in ratios.items():
        print(f"ratio {key}: {val:.3g}")
    key = "dflash2 / dflash1 step, median of paired steps (eager/sdpa)"
    if key in ratios:
        print(f"goal (DFlash 2 step <= 1.15 x DFlash 1): "
              f"{'met' if ratios[key] <= 1.15 else 'NOT met'}")
    return report("train_step", args, {"device": str(device), "size": size, "width": args.width,
                                       "allocator": args.allocator, "dflash2": dflash2,
                                       "heads": {v: head_fields(v) for v in variants},
                                       "matmul_peak_flops": peak_flops, "matmul": what,
                                       "rows": rows, "ratios": ratios, "step_s": step_s})


def print_shape(size: str, device: torch.device, repeats: int, allocator: str,
                variants: list[str], width: str | None = None) -> None:
    shape, dtype = SHAPES[size], SHAPES[size]["dtype"]
    cfg = {**shape["config"], **WIDTHS.get(width, {})}
    print(f"size {size}{f' at width {width}' if width else ''}: S={shape['seq_len']} "
          f"N={shape['num_anchors']} B={cfg['block_size']} Bt={shape['batch']} "
          f"H={cfg['hidden_size']} layers={cfg['num_hidden_layers']} "
          f"V={cfg['vocab_size']} {str(dtype).removeprefix('torch.')} on {device}; "
          f"heads {variants} (fields: conf/drafter/HEAD.yaml); "
          f"median of {repeats} interleaved steps; "
          f"steps timed with the {allocator} allocator")


def backend_ratios(rows: list[dict], variants: list[str]) -> dict[str, float]:
    """flex / sdpa and compiled / eager step time, per variant, where both rows exist."""
    by = {r["variant"]: r["step_ms"] for r in rows}
    out = {}
    for v in variants:
        if f"eager/flex/{v}" in by:
            out[f"flex step / sdpa step ({v})"] = by[f"eager/flex/{v}"] / by[f"eager/sdpa/{v}"]
        for b in ("sdpa", "flex"):
            if f"compiled/{b}/{v}" in by:
                out[f"compiled / eager step ({b}, {v})"] = (
                    by[f"compiled/{b}/{v}"] / by[f"eager/{b}/{v}"])
    return out


if __name__ == "__main__":
    main()
