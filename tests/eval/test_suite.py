"""The reference suite (dflash.md section 8): prompt formats, shuffle, hub ids, local copies in
the hub schema (jsonl, parquet, save_to_disk), the reasoning switch, MT-Bench's two turns, and
one suite run's report (per-dataset table, plots, command, wandb table)."""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import datasets
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from dflash_lab.eval import cli
from dflash_lab.eval import suite as suite_mod
from dflash_lab.eval.evaluate import run_features
from dflash_lab.eval.suite import SUITES, load_items, template_kwargs
from dflash_lab.paths import CONF_DIR
from tests.eval_doubles import tiny_drafter_for, write_serving_dir

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
#: rows in each dataset's hub schema (the columns the hub copies carry)
ROWS = {
    "gsm8k": [{"question": f"q{i}?", "answer": f"#### {i}"} for i in range(7)],
    "math500": [{"problem": f"p{i}", "solution": "s", "answer": "a", "subject": "x",
                 "level": 1, "unique_id": f"u{i}"} for i in range(5)],
    "humaneval": [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n",
                   "canonical_solution": "", "test": "", "entry_point": f"f{i}"}
                  for i in range(4)],
    "mbpp": [{"source_file": "m", "task_id": i, "prompt": f"Write f{i}.", "code": "",
              "test_imports": [], "test_list": []} for i in range(4)],
    "mt-bench": [{"prompt": [f"first {i}", f"second {i}"], "prompt_id": i, "category": "c",
                  "reference": []} for i in range(3)],
}
#: z-lab's dflash/benchmark.py DATASETS: load_dataset arguments
HUB_ARGS = {"gsm8k": ("openai/gsm8k", "main", "test"),
            "math500": ("HuggingFaceH4/MATH-500", None, "test"),
            "humaneval": ("openai/openai_humaneval", None, "test"),
            "mbpp": ("google-research-datasets/mbpp", "sanitized", "test"),
            "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train")}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory):
    """One local copy per reference dataset: jsonl, parquet and save_to_disk mixed."""
    root = tmp_path_factory.mktemp("suite")
    for name, rows in ROWS.items():
        if name == "math500":
            datasets.Dataset.from_list(rows).to_parquet(str(root / f"{name}.parquet"))
        elif name == "humaneval":
            datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(
                str(root / name))
        else:
            write_jsonl(root / f"{name}.jsonl", rows)
    return root


def compose_eval(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("eval", overrides=cli.data_group_overrides(list(overrides)))


def data_cfg(name: str, **keys):
    cfg = compose_eval(f"data={name}", "output_dir=o", "drafter.path=x")
    with open_dict(cfg):  # as +data.chat_template_kwargs.KEY=VALUE on the command line
        for key, value in keys.items():
            OmegaConf.update(cfg, f"data.{key}", value)
    return cfg.data


def test_reference_prompt_formats_and_shuffle(suite_dir):
    """random.Random(42) over the rows, the first N, each dataset's reference format."""
    paths = {"gsm8k": "gsm8k.jsonl", "math500": "math500.parquet", "humaneval": "humaneval",
             "mbpp": "mbpp.jsonl", "mt-bench": "mt-bench.jsonl"}
    got = {n: load_items(data_cfg(n, path=str(suite_dir / p)), 3) for n, p in paths.items()}
    order = list(range(7))
    random.Random(42).shuffle(order)
    assert [it.index for it in got["gsm8k"]] == order[:3]
    assert got["gsm8k"][0].messages == [{"role": "user", "content": f"q{order[0]}?{BOXED}"}]
    p = got["math500"][0]
    assert p.messages[0]["content"] == f"p{p.index}{BOXED}"
    h = got["humaneval"][0]
    assert h.messages[0]["content"] == (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\ndef f{h.index}():\n\n```")
    assert got["mbpp"][0].messages[0]["content"] == f"Write f{got['mbpp'][0].index}."
    m = got["mt-bench"][0]
    assert m.messages[0]["content"] == f"first {m.index}" and m.followups == [f"second {m.index}"]
    assert all(not it.followups for n in paths if n != "mt-bench" for it in got[n])


def test_hub_ids_when_online(monkeypatch):
    """No path: datasets.load_dataset(hub id, config, split=...) as the reference calls it."""
    calls = []

    def fake_load(hub_id, config=None, split=None):
        calls.append((hub_id, config, split))
        return datasets.Dataset.from_list(ROWS[next(n for n, a in HUB_ARGS.items()
                                                    if a[0] == hub_id)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    for name in SUITES["reference"]:
        assert load_items(data_cfg(name), None)
    assert calls == [HUB_ARGS[n] for n in SUITES["reference"]]


def test_offline_without_a_copy_and_wrong_schema_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="openai/gsm8k from the hub; offline, pass .*data.path="):
        load_items(data_cfg("gsm8k"), 2)
    wrong = write_jsonl(tmp_path / "gsm8k.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match=r"has columns \['messages'\]; expected one of "
                                         r"\['question'\] \(the openai/gsm8k schema"):
        load_items(data_cfg("gsm8k", path=str(wrong)), 2)
    with pytest.raises(ValueError, match="suite_dir=.*no local copy of math500"):
        suite_mod.data_configs(compose_eval("suite=reference", f"suite_dir={tmp_path}",
                                            "output_dir=o", "drafter.path=x"))
    with pytest.raises(ValueError, match="suite=reference generates answers: use mode=generate"):
        run_features(compose_eval("suite=reference", "mode=features", "output_dir=o"))
    with pytest.raises(ValueError, match="suite='paper': use one of"):
        suite_mod.data_configs(compose_eval("suite=paper", "output_dir=o"))


def test_reasoning_switch_goes_where_the_template_reads_it():
    qwen = SimpleNamespace(chat_template="{% if enable_thinking %}{% endif %}")
    effort = SimpleNamespace(chat_template="{{ reasoning_effort }}")
    plain = SimpleNamespace(chat_template="{{ messages }}")
    d = data_cfg("gsm8k", enable_thinking=False, chat_template_kwargs={"x": 1})
    assert template_kwargs(qwen, d) == {"enable_thinking": False, "x": 1}
    with pytest.raises(ValueError, match="enable_thinking=False: the chat template .* no "):
        template_kwargs(plain, d)
    d = data_cfg("gsm8k", reasoning_effort="high")
    assert template_kwargs(effort, d) == {"reasoning_effort": "high"}
    with pytest.raises(ValueError, match="reads neither reasoning_effort nor"):
        template_kwargs(plain, d)


def test_budget_defaults():
    """2048 new tokens for the reference datasets (each of the suite's), 256 for files; an
    explicit max_new_tokens wins."""
    assert compose_eval("data=gsm8k", "output_dir=o").max_new_tokens == 2048
    assert compose_eval("data.path=p.jsonl", "output_dir=o").max_new_tokens == 256
    cfg = compose_eval("suite=reference", "output_dir=o")
    assert [suite_mod.budget(cfg, d) for d in suite_mod.data_configs(cfg)] == [2048] * 5
    cfg = compose_eval("suite=reference", "output_dir=o", "max_new_tokens=7")
    assert [suite_mod.budget(cfg, d) for d in suite_mod.data_configs(cfg)] == [7] * 5


def test_mt_bench_turn_two_follows_the_speculative_answer(tiny_target, tiny_target_dir,
                                                          tmp_path, monkeypatch):
    drafter = tiny_drafter_for(tiny_target, block_size=4)
    serving = write_serving_dir(drafter, tmp_path / "d")
    rows = write_jsonl(tmp_path / "mt.jsonl", ROWS["mt-bench"])
    out = tmp_path / "out"
    argv = ["dflash-eval", "target=tiny", f"target.path={tiny_target_dir}",
            f"drafter.path={serving}", "data=mt-bench", f"data.path={rows}",
            f"output_dir={out}", "num_prompts=1", "max_new_tokens=6", "progress=false",
            "data.enable_thinking=false", "warmup=false"]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    report = json.loads((out / "report.json").read_text())
    order = list(range(3))
    random.Random(42).shuffle(order)
    assert [(r["index"], r["turn"]) for r in report["records"]] == [(order[0], 0), (order[0], 1)]
    tok = tiny_target.tokenizer
    first, second = report["prompt_ids"][:2]
    answer = tok.decode(report["outputs"][0], skip_special_tokens=True)
    assert answer.strip(), "turn 1 gave no text to condition on"
    i = report["records"][0]["index"]
    text = tok.decode(second)
    assert f"first {i}" in text and answer in text and text.rstrip().endswith(
        tok.decode(first[-4:]).rstrip())  # the generation prompt closes turn 2 as turn 1
    assert text.index(answer) < text.index(f"second {i}")
    assert report["settings"]["datasets"] == ["mt-bench"] and report["lossless"] is True
    assert "command: `dflash-eval target=tiny" in (out / "report.md").read_text()


def test_suite_run_reports_each_dataset(tiny_target, tiny_target_dir, suite_dir, tmp_path,
                                        monkeypatch):
    """suite=reference on local copies: one row per dataset (both taus, TTFT, TPOT, decode
    speedup), the paper-style table, each dataset's plots, wandb's table and scalars."""
    from lightning.pytorch.loggers import WandbLogger

    calls = []
    monkeypatch.setattr(WandbLogger, "log_image", lambda self, key, images, **kw:
                        calls.append(("image", key)))
    monkeypatch.setattr(WandbLogger, "log_table", lambda self, key, columns, data, **kw:
                        calls.append(("table", key, columns, data)))
    monkeypatch.setattr(WandbLogger, "log_metrics", lambda self, metrics, step=None:
                        calls.append(("metrics", metrics)))
    monkeypatch.setattr(WandbLogger, "log_hyperparams", lambda self, params: None)
    monkeypatch.setattr(WandbLogger, "experiment", property(lambda self: _FakeRun()))
    serving = write_serving_dir(tiny_drafter_for(tiny_target, block_size=4), tmp_path / "d")
    out = tmp_path / "out"
    cfg = compose_eval("target=tiny", f"target.path={tiny_target_dir}", f"drafter.path={serving}",
                       "suite=reference", f"suite_dir={suite_dir}", f"output_dir={out}",
                       "num_prompts=1", "max_new_tokens=5", "progress=false", "logger=wandb")
    report = cli.evaluate(cfg)
    names = list(SUITES["reference"])
    assert list(report["datasets"]) == names
    assert [r["dataset"] for r in report["records"]] == names + ["mt-bench"]  # two turns
    for row in report["datasets"].values():
        assert row["tau_macro"] >= 1 and row["tau_pooled"] >= 1 and row["lossless"] is True
        assert row["tpot_ms"] > 0 and row["baseline_tpot_ms"] > 0 and row["decode_speedup"] > 0
    taus = [sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"])
            for r in report["records"] if r["acceptance_lengths"]]
    assert report["tau_macro"] == pytest.approx(sum(taus) / len(taus))
    md = (out / "report.md").read_text()
    assert "| dataset | responses | tau macro | tau pooled |" in md
    assert "| | gsm8k | math500 | humaneval | mbpp | mt-bench | mean |" in md
    for name in names:
        assert (out / f"{name}_acceptance_histogram.png").is_file()
        assert (out / f"{name}_per_position_acceptance.png").is_file()
    tables = [c for c in calls if c[0] == "table"]
    assert len(tables) == 1 and [row[0] for row in tables[0][3]] == names
    final = [m for c in calls if c[0] == "metrics" for m in [c[1]] if "eval/tau_macro" in m]
    assert final[0]["eval/mt-bench/num_responses"] == 2


class _FakeRun:
    def finish(self):
        pass
