"""dflash-taps: rank candidate ``target_layer_ids`` for a target from one short capture of every
layer (with its final-normed state). A candidate set's score is the greedy acceptance
(``probe_tau``) of a ridge probe predicting, from the set's features at an anchor row, the
target's final state at the next B - 1 rows. Why a probe, how it was validated against trained
tau, and its limits: docs/taps.md.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.data.shards import ShardDataset
from dflash_lab.errors import user_errors
from dflash_lab.model.config import build_target_layer_ids
from dflash_lab.paths import CONF_DIR, RECIPES_DIR, atomic_write_text
from dflash_lab.targets.features import check_target_layer_ids, chunked_argmax
from dflash_lab.terminal import Bar

log = logging.getLogger("dflash_lab.taps")


def candidate_sets(num_layers: int, n: int) -> list[list[int]]:
    """The default candidates for an L-layer target and n taps: the evenly spread set (z-lab's
    rule) shifted by -2..+2 layers, and n evenly spread ids within the lower and upper half."""
    base = build_target_layer_ids(num_layers, n)
    half = num_layers // 2
    sets = [[i + s for i in base] for s in (-2, -1, 0, 1, 2)]
    sets += [[round((half - 1) * k / max(n - 1, 1)) for k in range(n)]] if half >= n else []
    sets += [[i + num_layers - half for i in sets[-1]]] if half >= n else []
    out: list[list[int]] = []
    for ids in sets:
        if ids not in out and len(set(ids)) == n and all(0 <= i < num_layers for i in ids):
            out.append(ids)
    return out


def anchor_rows(dataset: ShardDataset, block: int, max_anchors: int, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample anchors t (the row before an assistant token, with B - 1 rows after it); returns
    ``hidden`` [N, D] (every captured layer at t, float32), ``future`` [N, B-1, H] (the target's
    final-normed state at t+1..t+B-1) and ``labels`` [N, B-1] (its argmax there: the tokens a
    drafter must propose after the anchor token)."""
    rows = []
    for k in range(len(dataset)):
        loss = dataset.tokens(k)["loss_mask"]
        rows += [(k, int(t)) for t in torch.nonzero(loss[1:len(loss) - block + 1]).flatten()]
    if not rows:
        raise ValueError(f"{dataset.root}: no assistant row with {block - 1} rows after it; "
                         "capture longer conversations (taps.max_length) or lower taps.block_size")
    pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:max_anchors]
    by_sample: dict[int, list[int]] = {}
    for j in pick.tolist():
        by_sample.setdefault(rows[j][0], []).append(rows[j][1])
    hidden, future, labels = [], [], []
    for k, starts in by_sample.items():
        item = dataset[k]
        for t in starts:
            hidden.append(item["hidden"][t].float())
            future.append(item["target_last_hidden"][t + 1:t + block].float())
            labels.append(item["target_argmax"][t + 1:t + block].long())
    return torch.stack(hidden), torch.stack(future), torch.stack(labels)


def probe_tau(x: torch.Tensor, future: torch.Tensor, labels: torch.Tensor, lm_head,
              ridge: float, folds: int = 5) -> tuple[float, list[float]]:
    """Ridge maps x [N, F] -> future [N, B-1, H], scored by ``folds``-fold cross-validation (every
    anchor once, by maps fitted on the other folds): greedy tokens ``argmax lm_head(x W_j)`` against
    ``labels`` [N, B-1]. Returns (1 + mean count of leading correct tokens, i.e. the acceptance
    length of a drafter proposing exactly these tokens; the per-offset accuracy)."""
    hits = torch.empty(labels.shape)
    for held in torch.arange(len(x)).chunk(folds):
        fit = torch.ones(len(x), dtype=torch.bool)
        fit[held] = False
        mean, std = x[fit].mean(0), x[fit].std(0).clamp_min(1e-6)
        zf, yf = (x[fit] - mean) / std, future[fit].flatten(1)
        gram = zf.T @ zf + ridge * len(zf) * torch.eye(x.shape[1])
        weights = torch.linalg.solve(gram, zf.T @ (yf - yf.mean(0)))
        pred = ((x[held] - mean) / std @ weights + yf.mean(0)).view(len(held), *future.shape[1:])
        hits[held] = (chunked_argmax(lm_head, pred) == labels[held]).float()
    accepted = hits.cumprod(dim=1).sum(dim=1)
    return 1.0 + float(accepted.mean()), [round(float(a), 4) for a in hits.mean(0)]


def rank_sets(dataset: ShardDataset, lm_head, sets: list[list[int]], block: int,
              max_anchors: int, ridge: float, seed: int, progress: bool = True
              ) -> list[dict[str, Any]]:
    """Score every candidate set on the same anchors; best first."""
    captured = [int(i) for i in dataset.manifest["target_layer_ids"]]
    width = int(dataset.manifest["feature_dim"]) // len(captured)
    hidden, future, labels = anchor_rows(dataset, block, max_anchors, seed)
    log.info("probe: %d anchors x %d offsets, %d candidate sets", len(hidden), block - 1,
             len(sets))
    results = []
    for ids in Bar(sets, desc="taps", unit="set", disable=not progress):
        cols = [torch.arange(width) + captured.index(i) * width for i in ids]
        tau, per_offset = probe_tau(hidden[:, torch.cat(cols)], future, labels, lm_head, ridge)
        results.append({"target_layer_ids": ids, "probe_tau": round(tau, 4),
                        "accuracy_per_offset": per_offset})
    return sorted(results, key=lambda r: -r["probe_tau"])


def write_recipe(base: str, ids: list[int], ranking_file: Path) -> Path:
    """``recipes/<base>_taps.yaml``: the recipe ``base`` with the best set (atomic write)."""
    path = RECIPES_DIR / f"{base}_taps.yaml"
    atomic_write_text(path, (
        f"# @package _global_\n# {base} with the tap layers dflash-taps ranked best "
        f"({ranking_file}; docs/taps.md)\ndefaults:\n  - {base}\n  - _self_\n\n"
        f"run_name: {base}_taps\n\ndrafter:\n  target_layer_ids: {ids}\n"))
    return path


def taps(cfg: DictConfig) -> list[dict[str, Any]]:
    """Capture every layer (resumable, reused when the plan matches), rank, write the record."""
    t = cfg.taps
    if t.recipe and not (RECIPES_DIR / f"{t.recipe}.yaml").is_file():  # refused before a capture
        raise ValueError(f"taps.recipe={t.recipe!r}: no recipes/{t.recipe}.yaml; name an existing "
                         f"recipe (ls {RECIPES_DIR}) or leave taps.recipe=null")
    target = instantiate(cfg.target)
    every = list(range(target.num_hidden_layers))
    sets = [list(map(int, s)) for s in t.sets] if t.sets else candidate_sets(len(every),
                                                                              int(t.num_layers))
    for ids in sets:
        check_target_layer_ids(ids, len(every))
    out = Path(t.out_dir)
    settings = CaptureSettings(out_dir=str(out / "capture"), target_layer_ids=every,
                               max_length=int(t.max_length), hidden_dtype="bfloat16",
                               distribution=("last_hidden",), batch_size=int(t.batch_size))
    data = instantiate(cfg.data)
    run_capture(target, data.dataset, settings, data.source, progress=bool(t.progress))
    lm_head = target.model.get_output_embeddings().float()
    results = rank_sets(ShardDataset(settings.out_dir), lm_head, sets, int(t.block_size),
                        int(t.max_anchors), float(t.ridge), int(t.seed), bool(t.progress))
    record = out / "taps.json"
    probe = {k: t[k] for k in ("block_size", "max_anchors", "ridge", "seed")}
    atomic_write_text(record, json.dumps(probe | {"ranking": results}, indent=1) + "\n")
    for r in results:
        print(f"probe_tau {r['probe_tau']:.3f}  target_layer_ids={r['target_layer_ids']}")
    print(f"ranking -> {record}")
    print("(so far this probe has not predicted trained tau: docs/taps.md; train what you keep)")
    if t.recipe:
        print(f"recipe  -> {write_recipe(str(t.recipe), results[0]['target_layer_ids'], record)}")
    return results


@hydra.main(config_path=str(CONF_DIR), config_name="taps", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Console entry point (``dflash-taps``)."""
    log.debug("config:\n%s", OmegaConf.to_yaml(cfg))
    with user_errors():
        taps(cfg)


if __name__ == "__main__":
    main()
