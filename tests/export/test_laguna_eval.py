"""dflash-eval drafter.path=<Laguna directory> on the tiny target: greedy decoding stays
lossless, tau is reported and the report records how the directory was read."""

from __future__ import annotations

import pytest

from tests.eval_doubles import cli_eval_report, demo_prompts
from tests.export.test_laguna import write_laguna_dir

pytest.importorskip("transformers.models.laguna")


def test_cli_eval_of_a_laguna_dir_is_lossless(tiny_target_dir, tiny_target, tmp_path,
                                              monkeypatch):
    vocab, mask = tiny_target.vocab_size, tiny_target.token_id("<|mask|>")
    path = write_laguna_dir(tmp_path / "laguna", hidden_size=64, vocab_size=vocab,
                            draft_vocab_size=vocab, num_target_layers=8,
                            dflash_config={"mask_token_id": mask, "target_layer_ids": [1, 3, 5]})
    prompts = demo_prompts(tmp_path / "prompts.jsonl")
    report = cli_eval_report(monkeypatch, tiny_target_dir, path, prompts, tmp_path / "out")
    assert report["lossless"] is True and report["tau_mean"] >= 1.0
    assert report["settings"]["trained_block_size"] == 4
    assert report["settings"]["drafter_source"].startswith("Laguna directory")
