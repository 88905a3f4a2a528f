"""Benchmark 4: draft latency per block (cached context) and the spec-decoding loop's overhead.

Part A, draft latency: the benchmark drafter shape (``SHAPES[size]``) with a context cache of C
positions drafts one block (``DFlashDrafter.draft``; plus the LM head on the B-1 slots, as the
proposer does), against recomputing the context K/V for that block (the training forward with
one anchor at C): the cache's speed-up per block, at several C.

Part A also times, for a DFlash 2 drafter of that shape, what its selector adds per block:
the top-K candidates of the B-1 slots' unary logits and the left-to-right walk.

Part A, every head (``--heads``, default all: dflash1 and each conf/drafter/NAME.yaml setting a
variant, its fields from that file): one drafting round at the longest context of the size,
``DFlashProposer.draft`` as the loop calls it (block forward, LM head, the head's own walk:
DFlash 2's selector, LiLiCorr's lattice, XPress's Jacobi passes, Domino's GRU, DSpark's Markov
bias), the heads' rounds rotated every repeat; per head the median round and the median of
round-by-round ratios to DFlash 1's round.

Part B, loop overhead on the built-in tiny target, a DFlash 1 and a DFlash 2 drafter side by
side (alternating prompt by prompt): ``speculative_generate`` with every target forward,
drafter call (block forward + LM head, + the selector's candidates and walk for DFlash 2) and
context append timed; overhead = wall time outside those calls, as a share of the total (goal
< 10%); for DFlash 2 also with the selector counted as overhead. ``--drafter`` / ``--drafter2``
take a trained DFlash 1 / DFlash 2 run or checkpoint for the tiny target (realistic
acceptance); default: freshly initialised drafters.

    python -m benchmarks.draft_latency [--device cpu|cuda] [--size toy|cpu|paper]
        [--drafter outputs/runs/RUN] [--drafter2 outputs/runs/RUN2]
        [--tiny-target outputs/tiny_target] [--heads all|dflash2,xpress,...]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import (
    SHAPES,
    base_parser,
    drafter_config,
    head_fields,
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
    f = cfg.num_features
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


def _loop_parts(target, device: torch.device, drafter_path: str | None, variant: str):
    """(runner, proposer, timers) for one drafter on the tiny target; every timed call wrapped.

    Timers: target forwards, drafter calls (``draft``: block forward + LM head, + for DFlash 2
    the selector's candidates and walk), context appends, and for DFlash 2 the selector alone
    (top-K candidates + the left-to-right walk, inside the drafter call)."""
    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.eval.proposer import DFlashProposer
    from dflash_lab.eval.target_runner import TargetRunner
    from dflash_lab.train.factory import build_drafter

    if drafter_path:
        drafter = load_drafter(drafter_path, device=device).drafter
    else:
        torch.manual_seed(0)
        extra = {"variant": "dflash2"} if variant == "dflash2" else {}
        drafter = build_drafter(target, backend="sdpa", num_hidden_layers=2, block_size=8,
                                target_layer_ids=3, **extra).to(device).eval()
    if drafter.config.variant != variant:
        raise SystemExit(f"{drafter_path}: a {drafter.config.variant} drafter where the "
                         f"benchmark expects {variant} (--drafter: DFlash 1, --drafter2: DFlash 2)")
    pieces = target.pieces()
    runner = TargetRunner(target.model, drafter.config.target_layer_ids)
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    timers = {"target_s": Timed(runner.forward, device), "drafter_s": Timed(proposer.draft, device),
              "context_append_s": Timed(proposer.extend, device)}
    runner.forward, proposer.draft = timers["target_s"], timers["drafter_s"]
    proposer.extend = timers["context_append_s"]
    selector = getattr(drafter, "candidate_selector", None)  # DFlash 2's (heads/dflash2.py)
    if selector is not None:  # instance attributes shadow the methods DFlash2.draft calls
        timers["selector_s"] = Timed(selector.walk, device)
        timers["candidates_s"] = Timed(selector.candidates, device)
        selector.walk, selector.candidates = timers["selector_s"], timers["candidates_s"]
    what = drafter_path or f"freshly initialised {variant} (2 layers, B=8)"
    return runner, proposer, timers, what


def loop_overhead(device: torch.device, drafters: dict[str, str | None], tiny_dir: str,
                  num_prompts: int, max_new_tokens: int) -> list[dict]:
    """Part B: the overhead share of speculative_generate on the tiny target, one row per drafter
    variant; the variants alternate prompt by prompt (who goes first swaps every prompt).

    overhead = wall time outside target forwards, drafter calls and context appends (the loop's
    own work: acceptance, bookkeeping, tensors to lists). For DFlash 2 the selector (top-K
    candidates + walk) is inside the drafter call; ``overhead+selector_share`` counts it as loop
    overhead too (the strictest reading)."""
    from dflash_lab.eval.loop import DecodeSettings, speculative_generate
    from dflash_lab.eval.prompts import encode_prompt
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.targets.loader import load_target
    from dflash_lab.targets.tiny import materialize_tiny_target

    root = materialize_tiny_target(tiny_dir)
    target = load_target(str(root), dtype="float32", device=str(device))
    parts = {v: _loop_parts(target, device, path, v) for v, path in drafters.items()}
    settings = DecodeSettings(max_new_tokens=max_new_tokens,
                              stop_token_ids=(target.tokenizer.eos_token_id,))
    prompts = [encode_prompt(target.tokenizer, conv[:1])
               for conv in demo_conversations(num_prompts + 1, seed=7)[1:]]
    for runner, proposer, timers, _ in parts.values():
        speculative_generate(runner, proposer, prompts[0], settings)  # warm-up
        for t in timers.values():
            t.seconds, t.calls = 0.0, 0
    names = list(parts)
    sums = {v: {"total_s": 0.0, "tokens": 0, "rounds": 0} for v in names}
    for i, ids in enumerate(prompts):
        for v in names[i % len(names):] + names[:i % len(names)]:
            gen = speculative_generate(parts[v][0], parts[v][1], ids, settings)
            sums[v]["total_s"] += gen.seconds
            sums[v]["tokens"] += len(gen.output_ids)
            sums[v]["rounds"] += len(gen.acceptance_lengths)
    return [_loop_row(v, sums[v], parts[v][2], parts[v][3], len(prompts)) for v in names]


def _loop_row(variant: str, sums: dict, timers: dict, what: str, num_prompts: int) -> dict:
    total = sums["total_s"]
    inside = timers["target_s"].seconds + timers["drafter_s"].seconds
    inside += timers["context_append_s"].seconds
    row = {"variant": variant, "prompts": num_prompts, "tokens": sums["tokens"],
           "rounds": sums["rounds"], "tau": (sums["tokens"] - num_prompts) / max(sums["rounds"], 1),
           "total_s": total, **{k: t.seconds for k, t in timers.items()},
           "overhead_s": total - inside, "overhead_share": (total - inside) / total,
           "drafter": what}
    if "selector_s" in timers:
        sel = timers["selector_s"].seconds + timers["candidates_s"].seconds
        row["overhead+selector_share"] = (total - inside + sel) / total
        row["selector_share"] = sel / total
    return row


def selector_latency(size: str, device: torch.device, repeats: int) -> dict:
    """Part A, DFlash 2: per block, the unary LM head on the B-1 drafted slots, the selector's
    top-K candidates of those logits and its walk, at the benchmark shape (``DFLASH2``)."""
    from benchmarks.train_step import DFLASH2

    dtype = SHAPES[size]["dtype"]
    cfg = drafter_config(size, **DFLASH2)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, backend="sdpa").to(device, dtype).eval()
    head = target_head(cfg, device, dtype)
    hidden_1th = torch.randn(1, cfg.block_size - 1, cfg.hidden_size, device=device, dtype=dtype)
    anchor = torch.zeros(1, dtype=torch.long, device=device)
    selector = getattr(drafter, "candidate_selector", None)  # DFlash 2's (heads/dflash2.py)
    with torch.no_grad():
        unary = drafter.unary_logits(hidden_1th, head.lm_head)
        cand_unary, cand_ids = selector.candidates(unary)
        t_head = time_it(lambda: drafter.unary_logits(hidden_1th, head.lm_head), device, repeats)
        t_cand = time_it(lambda: selector.candidates(unary), device, repeats)
        t_torch = time_it(lambda: unary.topk(cfg.selector_top_k, dim=-1), device, repeats)
        t_walk = time_it(lambda: selector.walk(hidden_1th, cand_ids, cand_unary, anchor), device,
                         repeats)
    return {"slots": cfg.block_size - 1, "lm_head_ms": t_head * 1e3,
            "candidates_ms": t_cand * 1e3, "torch.topk_ms": t_torch * 1e3,
            "walk_ms": t_walk * 1e3, "selector / lm_head": (t_cand + t_walk) / t_head}


def head_latency(size: str, device: torch.device, repeats: int, heads: list[str]) -> list[dict]:
    """Part A per head: one round of ``DFlashProposer.draft`` (all its drafts, greedy) at the
    size's longest context C, every head's drafter of the benchmark shape plus its conf fields
    over the same frozen head and the same context features; the rounds rotate every repeat
    (``interleaved_seconds``), so load changes hit every head alike."""
    from benchmarks.train_step import interleaved_seconds
    from dflash_lab.eval.proposer import DFlashProposer

    dtype, c = SHAPES[size]["dtype"], CONTEXTS[size][-1]
    proposers = {}
    for name in heads:
        cfg = drafter_config(size, **head_fields(name))
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg, backend="sdpa").to(device, dtype).eval()
        head = target_head(cfg, device, dtype)
        proposers[name] = DFlashProposer(drafter, head.embed_tokens, head.lm_head)
        g = torch.Generator().manual_seed(1)
        proposers[name].start(torch.randn(1, c, cfg.num_features, generator=g).to(device, dtype))
    rounds = {n: (lambda p=p: p.draft(1, p.num_draft_tokens, 0.0, "exact_match", None))
              for n, p in proposers.items()}
    for fn in rounds.values():  # warm-up
        fn()
        fn()
    times = interleaved_seconds(rounds, device, repeats)
    base = times.get("dflash1")
    rows = []
    for name, secs in times.items():
        row = {"head": name, "context": c, "drafts": proposers[name].num_draft_tokens,
               "round_ms": statistics.median(secs) * 1e3}
        if base is not None:
            row["round / dflash1"] = statistics.median(b / a for a, b in zip(base, secs))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.splitlines()[0], allocator="default")  # times only
    p.add_argument("--drafter", default=None, help="trained DFlash 1 drafter for the tiny target")
    p.add_argument("--drafter2", default=None, help="trained DFlash 2 drafter for the tiny target")
    p.add_argument("--tiny-target", default="outputs/tiny_target")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--heads", default="all",
                   help="Part A per head: all (every head) or comma-separated heads, each timed "
                        "against dflash1 (common.head_names)")
    args = p.parse_args(argv)
    device, size = resolve(args)
    from benchmarks.train_step import chosen_heads

    heads = chosen_heads("all", None if args.heads == "all" else args.heads)
    for flag, path in (("--drafter", args.drafter), ("--drafter2", args.drafter2)):
        if path and not Path(path).exists():
            raise SystemExit(f"{flag} {path}: not found")
    repeats = args.repeats or (3 if size == "toy" else 10)
    rows = draft_latency(size, device, repeats)
    sel = selector_latency(size, device, repeats)
    shape = SHAPES[size]
    print(f"draft latency, size {size}: H={shape['config']['hidden_size']} "
          f"layers={shape['config']['num_hidden_layers']} B={shape['config']['block_size']} "
          f"{str(shape['dtype']).removeprefix('torch.')} on {device}; median of {repeats}")
    table(rows, ["context", "draft_ms", "draft+lm_head_ms", "recompute_ms", "recompute/cached",
                 "max_abs_diff"])
    print(f"DFlash 2 selector per block (same shape, V={shape['config']['vocab_size']}):")
    table([sel], ["slots", "lm_head_ms", "candidates_ms", "torch.topk_ms", "walk_ms",
                  "selector / lm_head"])
    per_head = head_latency(size, device, repeats, heads)
    print(f"draft round per head (DFlashProposer.draft, C={per_head[0]['context']}, "
          f"fields: conf/drafter/HEAD.yaml; rounds rotated, {repeats} each):")
    table(per_head, ["head", "drafts", "round_ms", "round / dflash1"])
    loops = loop_overhead(device, {"dflash1": args.drafter, "dflash2": args.drafter2},
                          args.tiny_target, args.prompts or (2 if size == "toy" else 8),
                          args.max_new_tokens or (16 if size == "toy" else 96))
    for loop in loops:
        print(f"loop on the tiny target, {loop['variant']} ({loop['drafter']}): "
              f"{loop['prompts']} prompts, {loop['tokens']} tokens, {loop['rounds']} rounds, "
              f"tau {loop['tau']:.2f}")
    table(loops, ["variant", "total_s", "target_s", "drafter_s", "selector_s", "candidates_s",
                  "context_append_s", "overhead_s", "overhead_share", "overhead+selector_share"])
    for loop in loops:
        print(f"ratio loop overhead share ({loop['variant']}): {loop['overhead_share']:.3g} "
              "(goal < 0.1)")
        if "overhead+selector_share" in loop:
            print(f"ratio loop overhead + selector share ({loop['variant']}): "
                  f"{loop['overhead+selector_share']:.3g} (goal < 0.1)")
    for r in rows:
        print(f"ratio recompute / cached draft at C={r['context']}: {r['recompute/cached']:.3g}")
    print(f"ratio DFlash 2 selector / LM head per block: {sel['selector / lm_head']:.3g}")
    for r in per_head[1:]:
        print(f"ratio {r['head']} / dflash1 draft round: {r['round / dflash1']:.3g}")
    return report("draft_latency", args, {"device": str(device), "size": size,
                                          "draft": rows, "selector": sel, "heads": per_head,
                                          "head_fields": {h: head_fields(h) for h in heads},
                                          "loops": loops})


if __name__ == "__main__":
    main()
