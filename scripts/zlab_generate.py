"""Greedy speculative decoding with z-lab's released loop (``dflash`` 0.1.0 ``dflash_generate``).

Usage (inside ``.venv-dflash``, built by ``make dflash-venv``; of dflash_lab it imports only the
standard-library ``dflash_lab/paths.py``, for the write-then-rename)::

    .venv-dflash/bin/python -m scripts.zlab_generate --target TARGET_DIR --prompts PROMPTS.json \
        --max-new-tokens N [--stop-token-ids ID ...] [--block-size B] --out OUT.json DRAFTER ...

TARGET_DIR: a Hugging Face causal LM directory (the tests use the built-in tiny target).
PROMPTS.json: a list of prompts, each a list of token ids (already templated). Each DRAFTER is a
directory (config.json + model.safetensors) loaded as z-lab's ``benchmark.py`` loads drafters:
``AutoConfig``, then ``DFlash2DraftModel`` if ``architectures`` names it, else
``DFlashDraftModel``, ``from_pretrained`` with sdpa attention; float32 here (the benchmark uses
bfloat16 on GPU). Stop ids default to the benchmark's rule (the generation config's EOS, else the
tokenizer's). ``_cuda_time`` is replaced by ``time.perf_counter`` (CPU). T = 0.

OUT.json: ``{"stop_token_ids": [...], "drafters": {DRAFTER: {"outputs": [[ids after the
prompt]], "acceptance_lengths": [[per round]]}}}``, written atomically.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from dflash import model as zlab
from dflash.benchmark import stop_token_ids
from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash_lab.paths import atomic_write_text  # standard library only

zlab._cuda_time = time.perf_counter  # the released loop synchronises CUDA for its timings
torch.set_num_threads(1)  # tiny models: threads only contend (CI boxes are small)


def load_drafter(path: str) -> DFlashDraftModel:
    """As ``dflash.benchmark.load_transformers_models`` loads a drafter (float32, CPU)."""
    config = AutoConfig.from_pretrained(path)
    cls = DFlash2DraftModel if "DFlash2DraftModel" in (config.architectures or []) \
        else DFlashDraftModel
    return cls.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()


def generate(drafter: DFlashDraftModel, target, prompts: list[list[int]], args,
             stops: list[int]) -> dict[str, list[list[int]]]:
    """Output ids (after the prompt) and per-round acceptance lengths of every prompt."""
    outputs, lengths = [], []
    for ids in prompts:
        stats = dflash_generate(drafter, target, torch.tensor([ids]), args.max_new_tokens,
                                stops, temperature=0.0, block_size=args.block_size,
                                return_stats=True)
        outputs.append(stats.output_ids[0, stats.num_input_tokens:].tolist())
        lengths.append([int(n) for n in stats.acceptance_lengths])
    return {"outputs": outputs, "acceptance_lengths": lengths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--max-new-tokens", required=True, type=int)
    parser.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("drafters", nargs="+")
    args = parser.parse_args()
    target = AutoModelForCausalLM.from_pretrained(args.target, attn_implementation="sdpa",
                                                  dtype=torch.float32).eval()
    stops = args.stop_token_ids
    if stops is None:
        stops = stop_token_ids(target, AutoTokenizer.from_pretrained(args.target))
    prompts = json.loads(args.prompts.read_text())
    result = {"stop_token_ids": stops,
              "drafters": {d: generate(load_drafter(d), target, prompts, args, stops)
                           for d in args.drafters}}
    atomic_write_text(args.out, json.dumps(result))
    print(f"wrote {args.out}: {len(args.drafters)} drafters x {len(prompts)} prompts")


if __name__ == "__main__":
    main()
