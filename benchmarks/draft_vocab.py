"""Benchmark: what a draft vocabulary saves (issue 27 item 5), side by side in one run.

For each target vocabulary (SmolLM2's 49,152 and a Qwen3-sized 151,936 head, by shape, at the
benchmark drafter width of ``--size``) and each draft vocabulary N (8k, 16k, 32k and the full
vocabulary): (a) the drafter's per-block draft latency with a cached context of C positions
(``DFlashDrafter.draft`` + the unary logits of the B-1 slots + their argmax, as the proposer
drafts), and (b) one full training step (anchors -> drafter -> head pass -> backward -> AdamW).
All variants of one vocabulary run interleaved, their order rotating every round; each ratio
is the median over rounds of (N's time / the full vocabulary's time) in the same round.

    python -m benchmarks.draft_vocab [--device cpu|cuda] [--size toy|cpu|paper] [--repeats N]
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.common import (
    SHAPES,
    base_parser,
    drafter_config,
    product_optimizer,
    report,
    resolve,
    sync,
    table,
    target_head,
    training_batch,
)
from benchmarks.train_step import interleaved_seconds, make_step
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.module import DFlashModule

VOCABS = {"smollm2": 49152, "qwen3": 151936}
DRAFT_SIZES = (8192, 16384, 32768)
CONTEXT = 256  #: cached context positions for the draft latency


def _variants(size: str, device: torch.device, vocab: int, sizes: tuple[int, ...]):
    """name -> (draft step, train step) of each draft vocabulary N (and the full one)."""
    base = {**SHAPES[size]["config"], "vocab_size": vocab,
            "mask_token_id": min(SHAPES[size]["config"]["mask_token_id"], vocab - 1)}
    dtype = SHAPES[size]["dtype"]
    head = target_head(drafter_config(size, **base), device, dtype)
    out = {}
    for n in (*[s for s in sizes if s < vocab], None):
        cfg = drafter_config(size, **base, draft_vocab_size=n)
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg, backend="sdpa").to(device, dtype)
        if n is not None:
            drafter.set_draft_vocab(torch.arange(n) * (vocab // n), head.lm_head)
        module = DFlashModule(drafter, head, product_optimizer, gamma=4.0,
                              num_anchors=SHAPES[size]["num_anchors"],
                              val_temperatures=[]).to(device)
        opt = product_optimizer([p for p in drafter.parameters() if p.requires_grad])
        batch = training_batch(cfg, size, device, dtype)
        label = "full" if n is None else f"{n // 1024}k" if n % 1024 == 0 else str(n)
        out[label] = (_draft_step(drafter, head, cfg, device), make_step(module, opt, batch))
    return out


def _draft_step(drafter: DFlashDrafter, head, cfg, device: torch.device):
    feats = torch.randn(1, CONTEXT, cfg.num_features, device=device,
                        dtype=next(drafter.parameters()).dtype)
    cache = drafter.new_cache()
    drafter.extend_context(cache, feats)
    anchor = torch.zeros(1, dtype=torch.long, device=device)

    @torch.no_grad()
    def step():
        hidden = drafter.draft(cache, anchor, head.embed_tokens)
        return drafter.unary_logits(hidden[:, 1:], head.lm_head).argmax(-1)

    return step


def _ratios(times: dict[str, list[float]]) -> dict[str, float]:
    return {n: statistics.median(t / f for t, f in zip(ts, times["full"], strict=True))
            for n, ts in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--vocabs", nargs="+", choices=list(VOCABS), default=list(VOCABS))
    args = parser.parse_args(argv)
    device, size = resolve(args)
    repeats = args.repeats or (3 if size == "toy" else 7)
    sizes = (64, 128, 256) if size == "toy" else DRAFT_SIZES
    rows = []
    for name in args.vocabs:
        vocab = 512 if size == "toy" else VOCABS[name]
        variants = _variants(size, device, vocab, sizes)
        for draft, train in variants.values():  # warm-up
            draft()
            train()
        sync(device)
        drafts = interleaved_seconds({n: v[0] for n, v in variants.items()}, device, repeats * 4)
        trains = interleaved_seconds({n: v[1] for n, v in variants.items()}, device, repeats)
        d_ratio, t_ratio = _ratios(drafts), _ratios(trains)
        for n in variants:
            rows.append({"vocab": vocab, "draft_vocab": n,
                         "draft_ms": 1e3 * statistics.median(drafts[n]),
                         "draft_vs_full": d_ratio[n],
                         "train_ms": 1e3 * statistics.median(trains[n]),
                         "train_vs_full": t_ratio[n]})
        del variants
    table(rows, ["vocab", "draft_vocab", "draft_ms", "draft_vs_full", "train_ms",
                 "train_vs_full"])
    return report("draft_vocab", args, {"size": size, "repeats": repeats, "context": CONTEXT,
                                        "rows": rows})


if __name__ == "__main__":
    main()
