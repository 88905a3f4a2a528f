"""Test double run in .venv-modelopt (no dflash_lab): ModelOpt's LiLiCorr built by
benchmarks/modelopt_train.py for a plan, its every head and backbone tensor perturbed (seeded,
so no tensor is left at its zero init), saved through the bridge's writer as ``OUT/step-0``,
and their lattice scores on seeded inputs written to ``OUT/scores.safetensors``::

    .venv-modelopt/bin/python -m tests.tools.modelopt_scores PLAN TARGET OUT

Inputs (one block; S slots, K candidates, H hidden, F = taps x H): ``ids`` [S, K] candidate ids,
``lp`` [S, K] descending log-probs, ``pass`` [S, H] slot rows, ``taps`` [F] the target row
before the anchor. Outputs: ``start`` [K] and ``pair`` [S-1, K, K], their logit-scaled factors
(``compose_log_factors``), what our ``LiLiCorrLattice`` must give as rows 0 and 1.. of its
scores."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks import modelopt_train as mt
from benchmarks.speculators_train import save


def main(plan_path: str, target: str, out: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    shape = mt.target_shape(target)
    fields = mt.dflash_fields(plan, "lilicorr", shape)
    model = mt.build_model(target, mt.their_recipe("lilicorr", fields, offline="x"), 0)
    g = torch.Generator().manual_seed(3)
    module = model.dflash_module
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    save(model, Path(out), 0, mt.export_step(model, shape["num_hidden_layers"]))
    d = plan["drafter"]
    s, k, h = d["block_size"] - 1, d["lilicorr_candidate_topk"], d["hidden_size"]
    taps = len(d["target_layer_ids"])
    ids = torch.randint(0, d["vocab_size"], (s, k), generator=g)
    lp = torch.randn(s, k, generator=g).sort(-1, descending=True).values - 2.0
    pass_h = torch.randn(s, h, generator=g)
    row = torch.randn(taps * h, generator=g)
    with torch.no_grad():  # anchor at position 1: the target row before it is position 0
        start, pair = module.score_lattice(
            candidate_token_ids=ids[None, None], candidate_log_probs=lp[None, None],
            pass_hidden=pass_h[None, None], embed_tokens=model._base_model_embeddings,
            target_hidden=row[None, None], anchor_positions=torch.ones(1, 1, dtype=torch.long))
        start, pair = module.lilicorr.compose_log_factors(start_scores=start, pair_scores=pair)
    save_file({"ids": ids, "lp": lp, "pass": pass_h, "taps": row, "start": start[0, 0].contiguous(),
               "pair": pair[0, 0].contiguous()}, str(Path(out) / "scores.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
