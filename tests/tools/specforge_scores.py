"""Test double run in .venv-specforge (no dflash_lab): SpecForge's Domino built by
benchmarks/specforge_train.py for a plan, its GRU and correction tensors perturbed (seeded), saved
through the bridge's writer as ``OUT/step-0``, and their teacher-forced final logits on seeded
inputs written to ``OUT/scores.safetensors``::

    .venv-specforge/bin/python -m tests.tools.specforge_scores PLAN TARGET OUT

Inputs (one block of B slots, H hidden): ``hidden`` [B, H] the draft's output states, ``ids``
[B] the block's tokens (slot k's label: anchor + k). Output: ``final`` [B, V], their
``OnlineDominoModel._apply_domino_head`` on their LM head's base logits, what our Domino head
must give."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks import specforge_train as sf
from benchmarks.speculators_train import save


def main(plan_path: str, target: str, out: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    draft = sf.draft_config_fields(plan, sf.target_config(target))
    config = {**sf.their_defaults(), **sf.training_fields(plan, 0)}
    model = sf.build_model(target, draft, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.draft_model.named_parameters():
            if name.startswith(("prefix_gru", "embed_proj")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    save(model, Path(out), 0, sf.save_draft(model))
    b, h = int(draft["block_size"]), int(draft["hidden_size"])
    hidden = torch.randn(1, 1, b, h, generator=g)
    ids = torch.randint(0, int(draft["vocab_size"]), (1, 1, b), generator=g)
    with torch.no_grad():
        base = model.lm_head(hidden)
        final = model._apply_domino_head(base, hidden, prev_ids=ids, target_ids=ids)
    save_file({"hidden": hidden[0, 0], "ids": ids[0, 0], "final": final[0, 0].contiguous()},
              str(Path(out) / "scores.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
