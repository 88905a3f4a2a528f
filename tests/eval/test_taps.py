"""dflash-taps: the candidate sets, the ridge probe's score on planted signals, and the command
end to end on the tiny target (capture every layer, rank, record, recipe)."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_lab import taps


def test_candidate_sets_are_valid_distinct_and_hold_zlab_rule():
    from dflash_lab.model.config import build_target_layer_ids

    for layers, n in ((8, 3), (8, 5), (30, 5), (36, 5)):
        sets = taps.candidate_sets(layers, n)
        assert build_target_layer_ids(layers, n) in sets
        assert all(len(set(s)) == n and all(0 <= i < layers for i in s) for s in sets)
        assert len({tuple(s) for s in sets}) == len(sets)
    # shifts -2..+1 of [2, 9, 15, 21, 28] (+2 passes layer 29), the lower and the upper half
    assert taps.candidate_sets(30, 5)[-2:] == [[0, 4, 7, 10, 14], [15, 19, 22, 25, 29]]
    assert len(taps.candidate_sets(30, 5)) == 6


def _planted(n: int, block: int, hidden: int, informative: bool):
    """Labels [n, B-1]; future = the LM head's row of each label (so argmax recovers it); x
    carries the future exactly (informative) or is independent noise."""
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(hidden, hidden, bias=False)
    lm_head.weight.data = torch.eye(hidden) * 4
    labels = torch.randint(0, hidden, (n, block - 1))
    future = torch.nn.functional.one_hot(labels, hidden).float()
    x = future.flatten(1) if informative else torch.randn(n, (block - 1) * hidden)
    return x, future, labels, lm_head


def test_probe_scores_a_full_block_when_features_determine_it_and_about_one_when_not():
    tau, per_offset = taps.probe_tau(*_planted(2000, 4, 8, True), ridge=1e-3)
    assert tau == pytest.approx(4.0) and per_offset == [1.0, 1.0, 1.0]
    tau, per_offset = taps.probe_tau(*_planted(2000, 4, 8, False), ridge=1e-3)
    assert tau < 1.3 and max(per_offset) < 0.25  # chance is 1/8 per offset


def test_taps_ranks_writes_the_record_and_the_recipe(tiny_target_dir, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from dflash_lab.paths import CONF_DIR

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "base.yaml").write_text("# @package _global_\n")
    monkeypatch.setattr(taps, "RECIPES_DIR", tmp_path / "recipes")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="taps", overrides=[
            f"target.path={tiny_target_dir}", f"taps.out_dir={tmp_path / 'taps'}",
            "data.limit=24", "data.demo_rows=24", f"data.demo_file={tmp_path / 'demo.jsonl'}",
            "taps.block_size=4", "taps.sets=[[0,1,2],[5,6,7]]", "taps.recipe=base",
            "taps.progress=false"])
    results = taps.taps(cfg)
    record = json.loads((tmp_path / "taps" / "taps.json").read_text())
    assert record["ranking"] == results and record["block_size"] == 4
    assert {tuple(r["target_layer_ids"]) for r in results} == {(0, 1, 2), (5, 6, 7)}
    assert results[0]["probe_tau"] >= results[1]["probe_tau"] >= 1.0
    assert all(len(r["accuracy_per_offset"]) == 3 for r in results)
    recipe = (tmp_path / "recipes" / "base_taps.yaml").read_text()
    assert f"target_layer_ids: {results[0]['target_layer_ids']}" in recipe
    assert "  - base\n" in recipe
    cfg.taps.sets = [[0, 1, 9]]  # outside the 8 layers: refused before any capture
    with pytest.raises(ValueError, match=r"target_layer_ids=\[0, 1, 9\] invalid"):
        taps.taps(cfg)
    cfg.taps.sets, cfg.taps.recipe = None, "missing"
    cfg.taps.num_layers = 3
    with pytest.raises(ValueError, match="taps.recipe=.missing.: no recipes/missing.yaml"):
        taps.taps(cfg)
