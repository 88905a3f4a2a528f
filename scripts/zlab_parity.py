"""Run z-lab's released drafter (``dflash`` 0.1.0) on a directory our code wrote.

Usage (inside ``.venv-dflash``, built by ``make dflash-venv``; of dflash_lab it imports only the
standard-library ``dflash_lab/paths.py``, for the write-then-rename)::

    .venv-dflash/bin/python -m scripts.zlab_parity DIR [DIR ...]

DIR holds ``config.json`` + ``model.safetensors`` (a serving directory written by
``DrafterConfig.to_dict()`` and the drafter's ``state_dict()``) and ``inputs.safetensors``:
``target_hidden`` [Bt, S, F] (the context's concatenated target features, positions 0..S-1),
``block_ids`` [Bt, B] (anchor then MASK ids), ``embed_weight`` [V, H] and ``lm_head_weight``
[V, H] of a stand-in target. The drafter is loaded as z-lab's ``benchmark.py`` loads one
(AutoConfig, then the class named in ``architectures``, ``from_pretrained``), the block is drafted
as ``dflash_generate`` drafts it (raw embedding rows times ``input_embedding_scale``, positions
0..S+B-1, hidden of slots 1..B-1, then ``propose`` or ``compute_logits`` + argmax at T=0).
Each ``DIR/zlab_outputs.safetensors`` gets ``hidden`` [Bt, B, H], ``logits`` [Bt, B-1, V]
(unary) and ``tokens`` [Bt, B-1]; DFlash 2 adds ``candidates`` [Bt, B-1, C] (sorted by token
id; z-lab's top-k is unsorted).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from dflash.model import (
    DFlash2DraftModel,
    DFlashDraftModel,
    _draft_value,
    _output_head,
    _raw_input_embeddings,
)
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig

from dflash_lab.paths import atomic_path  # standard library only


class StandInTarget(nn.Module):
    """Just what z-lab's loop reads from a target: the input embeddings and ``lm_head``."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight)
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        self.lm_head.weight.data.copy_(lm_head_weight)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens


def load_drafter(path: Path) -> DFlashDraftModel:
    config = AutoConfig.from_pretrained(path)
    cls = DFlash2DraftModel if "DFlash2DraftModel" in (config.architectures or []) \
        else DFlashDraftModel
    return cls.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()


@torch.inference_mode()
def run(path: Path) -> dict[str, torch.Tensor]:
    model = load_drafter(path)
    inputs = load_file(path / "inputs.safetensors")
    target = StandInTarget(inputs["embed_weight"], inputs["lm_head_weight"])
    ctx, block = inputs["target_hidden"], inputs["block_ids"]
    s, b = ctx.shape[1], block.shape[1]
    scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
    hidden = model(target_hidden=ctx, noise_embedding=_raw_input_embeddings(target, block, scale),
                   position_ids=torch.arange(s + b)[None].expand(block.shape[0], -1),
                   past_key_values=None, use_cache=False)
    head = _output_head(target)
    out = {"hidden": hidden, "logits": model.compute_logits(hidden[:, 1:], head)}
    if isinstance(model, DFlash2DraftModel):
        tokens, candidates, _ = model.propose(hidden[:, 1:], block[:, 0], head, 0.0)
        out["candidates"] = candidates.sort(dim=-1).values
    else:
        tokens = out["logits"].argmax(dim=-1)
    out["tokens"] = tokens
    return {k: v.contiguous() for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", type=Path, nargs="+", help="serving dirs with inputs.safetensors")
    for path in parser.parse_args().dirs:  # one process for all: importing transformers is slow
        out = run(path)
        with atomic_path(path / "zlab_outputs.safetensors") as tmp:
            save_file(out, str(tmp))
        print(f"wrote {path / 'zlab_outputs.safetensors'}: "
              + ", ".join(f"{k} {list(v.shape)}" for k, v in out.items()))


if __name__ == "__main__":
    main()
