"""Benchmark 4: draft latency per block (cached context) and the spec-decoding loop's overhead.

Part A, draft latency: the benchmark drafter shape (``SHAPES[size]``) with a context cache of C
positions drafts one block (``DFlashDrafter.draft``; plus the LM head on the B-1 slots, as the
proposer does), against recomputing the context K/V for that block (the training forward with
one anchor at C): the cache's speed-up per block, at several C.

Part B, loop overhead on the built-in tiny target: ``speculative_generate`` with every target
forward, drafter call (draft + LM head) and context append timed; overhead = wall time outside
those forwards, as a share of the total (goal < 10%). ``--drafter`` takes a trained run or
checkpoint for the tiny target (realistic acceptance); default: a freshly initialised drafter.

    python -m benchmarks.draft_latency [--device cpu|cuda] [--size toy|cpu|paper]
        [--drafter outputs/runs/RUN] [--tiny-target outputs/tiny_target]
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.common import (
    SHAPES,
    base_parser,
    drafter_config,
    report,
    resolve,
    sync,
    table,
    target_head,
    time_it,
)
from dflash_lab.model.drafter import DFlashDrafter

CONTEXTS = {"toy": [16, 64], "cpu": [128, 512, 2048], "paper": [512, 2048, 8192]}


def draft_latency(size: str, device: torch.device, repeats: int) -> list[dict]:
    """Part A rows: cached draft vs context recompute, per context length."""
    dtype = SHAPES[size]["dtype"]
    cfg = drafter_config(size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, backend="sdpa").to(device, dtype).eval()
    head = target_head(cfg, device, dtype)
    return [_one_context(drafter, head, c, repeats) for c in CONTEXTS[size]]


def _one_context(drafter: DFlashDrafter, head, c: int, repeats: int) -> dict:
    cfg, device = drafter.config, drafter.fc.weight.device
    dtype = drafter.fc.weight.dtype
    f = len(cfg.target_layer_ids) * cfg.hidden_size
    feats = torch.randn(1, c + 1, f, device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size - 1, (1, c + 1), device=device)
    cache = drafter.new_cache()
    drafter.extend_context(cache, feats[:, :c])
    anchor = ids[:, c]
    anchors = torch.full((1, 1), c, device=device, dtype=torch.long)

    def cached():
        return drafter.draft(cache, anchor, head.embed_tokens)

    def cached_with_head():
        return head.lm_head(cached()[0, 1:])

    @torch.no_grad()
    def recompute():  # the training forward: context K/V recomputed for the one block
        return drafter(feats, ids, anchors, head.embed_tokens)

    with torch.no_grad():
        ref, got = recompute()[0, 0], cached()[0]
    err = (ref.float() - got.float()).abs().max().item()
    t_cached = time_it(cached, device, repeats, warmup=3)
    t_head = time_it(cached_with_head, device, repeats, warmup=1)
    t_re = time_it(recompute, device, repeats, warmup=1)
    return {"context": c, "draft_ms": t_cached * 1e3, "draft+lm_head_ms": t_head * 1e3,
            "recompute_ms": t_re * 1e3, "recompute/cached": t_re / t_cached,
            "max_abs_diff": err}


class Timed:
    """Wraps a bound method and accumulates its wall time (after a device sync)."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device, self.seconds, self.calls = fn, device, 0.0, 0

    def __call__(self, *args, **kwargs):
        sync(self.device)
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync(self.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def loop_overhead(device: torch.device, drafter_path: str | None, tiny_dir: str,
                  num_prompts: int, max_new_tokens: int) -> dict:
    """Part B: the overhead share of speculative_generate on the tiny target."""
    from dflash_lab.data.demo_corpus import demo_conversations
    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.eval.loop import DecodeSettings, speculative_generate
    from dflash_lab.eval.prompts import encode_prompt
    from dflash_lab.eval.proposer import DFlashProposer
    from dflash_lab.eval.target_runner import TargetRunner
    from dflash_lab.target.loader import load_target
    from dflash_lab.target.tiny import materialize_tiny_target
    from dflash_lab.train.factory import build_drafter

    root = materialize_tiny_target(tiny_dir)
    target = load_target(str(root), dtype="float32", device=str(device))
    if drafter_path:
        drafter = load_drafter(drafter_path, device=device).drafter
    else:
        torch.manual_seed(0)
        drafter = build_drafter(target, backend="sdpa", num_hidden_layers=2, block_size=8,
                                target_layer_ids=3).to(device).eval()
    pieces = target.pieces()
    runner = TargetRunner(target.model, drafter.config.target_layer_ids)
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    runner.forward = Timed(runner.forward, device)
    proposer.propose = Timed(proposer.propose, device)
    proposer.extend = Timed(proposer.extend, device)
    settings = DecodeSettings(max_new_tokens=max_new_tokens,
                              stop_token_ids=(target.tokenizer.eos_token_id,))
    prompts = [encode_prompt(target.tokenizer, conv[:1])
               for conv in demo_conversations(num_prompts + 1, seed=7)[1:]]
    speculative_generate(runner, proposer, prompts[0], settings)  # warm-up
    for t in (runner.forward, proposer.propose, proposer.extend):
        t.seconds, t.calls = 0.0, 0
    total, tokens, rounds = 0.0, 0, 0
    for ids in prompts:
        gen = speculative_generate(runner, proposer, ids, settings)
        total += gen.seconds
        tokens += len(gen.output_ids)
        rounds += len(gen.acceptance_lengths)
    inside = runner.forward.seconds + proposer.propose.seconds + proposer.extend.seconds
    return {
        "prompts": len(prompts), "tokens": tokens, "rounds": rounds,
        "tau": (tokens - len(prompts)) / max(rounds, 1), "total_s": total,
        "target_s": runner.forward.seconds, "drafter_s": proposer.propose.seconds,
        "context_append_s": proposer.extend.seconds, "overhead_s": total - inside,
        "overhead_share": (total - inside) / total,
        "drafter": drafter_path or "freshly initialised (2 layers, B=8)",
    }


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.splitlines()[0], allocator="default")  # times only
    p.add_argument("--drafter", default=None, help="trained drafter for the tiny target")
    p.add_argument("--tiny-target", default="outputs/tiny_target")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    args = p.parse_args(argv)
    device, size = resolve(args)
    repeats = args.repeats or (3 if size == "toy" else 10)
    rows = draft_latency(size, device, repeats)
    shape = SHAPES[size]
    print(f"draft latency, size {size}: H={shape['config']['hidden_size']} "
          f"layers={shape['config']['num_hidden_layers']} B={shape['config']['block_size']} "
          f"{str(shape['dtype']).removeprefix('torch.')} on {device}; median of {repeats}")
    table(rows, ["context", "draft_ms", "draft+lm_head_ms", "recompute_ms", "recompute/cached",
                 "max_abs_diff"])
    if args.drafter and not Path(args.drafter).exists():
        raise SystemExit(f"--drafter {args.drafter}: not found")
    loop = loop_overhead(device, args.drafter, args.tiny_target,
                         args.prompts or (2 if size == "toy" else 8),
                         args.max_new_tokens or (16 if size == "toy" else 96))
    print(f"loop overhead on the tiny target ({loop['drafter']}): {loop['prompts']} prompts, "
          f"{loop['tokens']} tokens, {loop['rounds']} rounds, tau {loop['tau']:.2f}")
    table([loop], ["total_s", "target_s", "drafter_s", "context_append_s", "overhead_s",
                   "overhead_share"])
    print(f"ratio loop overhead share: {loop['overhead_share']:.3g} (goal < 0.1)")
    for r in rows:
        print(f"ratio recompute / cached draft at C={r['context']}: {r['recompute/cached']:.3g}")
    return report("draft_latency", args, {"device": str(device), "size": size,
                                          "draft": rows, "loop": loop})


if __name__ == "__main__":
    main()
