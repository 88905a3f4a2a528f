"""The long-context prompt set (``data=long_sharegpt``): lengths spread over the range, each
prompt rendered to its length, built from whole held-out chats, deterministic; end to end on the
tiny target with tau by context bucket."""

from __future__ import annotations

import json
import math
import sys

import pytest
from omegaconf import OmegaConf

from dflash_lab.eval import cli
from dflash_lab.eval.long_prompts import chat_turns, context_targets
from dflash_lab.eval.suite import (
    check_long_fits,
    items_before_target,
    long_items,
    prompt_ids,
    template_kwargs,
)
from dflash_lab.paths import CONF_DIR
from dflash_lab.targets.demo_corpus import demo_conversations
from tests.eval_doubles import tiny_drafter_for, write_serving_dir

MIN, MAX = 64, 480


@pytest.fixture(scope="module")
def chats_file(tmp_path_factory):
    """40 demo chats in ShareGPT form (the heldout.jsonl layout), with a system turn and an
    empty turn in the first to be dropped."""
    rows = []
    for k, conv in enumerate(demo_conversations(40, seed=7)):
        turns = [{"from": {"user": "human", "assistant": "gpt", "system": "system"}[m["role"]],
                  "value": m["content"]} for m in conv]
        if k == 0:
            turns = [{"from": "system", "value": "be brief"}, {"from": "human", "value": " "},
                     *turns]
        rows.append({"id": f"c{k}", "conversations": turns})
    path = tmp_path_factory.mktemp("long") / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def long_config(path, **over):
    d = OmegaConf.load(CONF_DIR / "eval_data" / "long_sharegpt.yaml")
    d.merge_with({"path": str(path), "min_context": MIN, "max_context": MAX,
                  "chat_template": True, "max_prompt_tokens": None, **over})
    return d


def test_targets_spread_over_the_range():
    got = context_targets(8, 512, 8192)
    assert got == sorted(got) and got[0] >= 512 and got[-1] <= 8192
    per_doubling = [sum(lo <= t < 2 * lo for t in got) for lo in (512, 1024, 2048, 4096)]
    assert per_doubling == [2, 2, 2, 2]  # log spacing: the same count per doubling
    lin = context_targets(4, 100, 500, "linear")
    assert lin == [150, 250, 350, 450]
    assert context_targets(1, 300, 300) == [300]
    for bad in ((0, 1, 2, "log"), (2, 600, 500, "log"), (2, 1, 2, "cubic")):
        with pytest.raises(ValueError, match="num_prompts|min_context|spacing"):
            context_targets(*bad)


def test_chat_turns_alternate_and_end_with_an_answer():
    row = {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "system", "value": "s"},
                             {"from": "human", "value": "q1"}, {"from": "human", "value": "q1b"},
                             {"from": "gpt", "value": ""}, {"from": "gpt", "value": "a1"},
                             {"from": "human", "value": "q2"}]}
    assert chat_turns(row, "r") == [{"role": "user", "content": "q1"},
                                    {"role": "assistant", "content": "a1"}]


def test_each_prompt_is_rendered_to_its_length(tiny_target, chats_file):
    tok = tiny_target.tokenizer
    d = long_config(chats_file)
    items = long_items(d, 6, tok)
    targets = context_targets(6, MIN, MAX)
    source = [json.loads(line) for line in chats_file.read_text().splitlines()]
    texts = " ".join(t["value"] for r in source for t in r["conversations"])
    firsts = {chat_turns(r, "r")[0]["content"] for r in source}
    for item, target in zip(items, targets):
        n = len(prompt_ids(tok, item.messages, d, template_kwargs(tok, d)))
        assert target - 8 <= n <= target and n <= MAX, (n, target)
        assert item.messages[-1]["role"] == "user"
        assert item.messages[-1]["content"] in firsts  # an intact first question of a chat
        assert all(m["content"].strip() in texts for m in item.messages)  # held-out text only
        assert all(a["role"] != b["role"] for a, b in zip(item.messages, item.messages[1:]))
    assert [i.messages for i in long_items(d, 6, tok)] == [i.messages for i in items]
    other = long_items(long_config(chats_file, shuffle_seed=1), 6, tok)
    assert [i.messages for i in other] != [i.messages for i in items]


def test_refusals_name_the_fix(tiny_target, chats_file):
    tok = tiny_target.tokenizer
    with pytest.raises(ValueError, match="ran out.*lower num_prompts"):
        long_items(long_config(chats_file, min_context=1500, max_context=1900), 40, tok)
    with pytest.raises(ValueError, match="give num_prompts"):
        long_items(long_config(chats_file), None, tok)
    with pytest.raises(ValueError, match="max_position_embeddings=512; lower data.max_context"):
        check_long_fits(long_config(chats_file), 64, 512)
    with pytest.raises(ValueError, match="does not exist"):  # before the target loads
        items_before_target([long_config(chats_file.parent / "missing.jsonl")], 4)


def test_cli_tau_by_context_on_the_long_set(tiny_target_dir, tiny_target, chats_file, tmp_path,
                                            monkeypatch):
    """``dflash-eval data=long_sharegpt``: one response per built prompt, rounds counted in
    the buckets the prompt lengths span, greedy lossless."""
    serving = write_serving_dir(tiny_drafter_for(tiny_target, block_size=4), tmp_path / "d")
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [
        "dflash-eval", "target=hf", f"target.name_or_path={tiny_target_dir}",
        f"drafter.path={serving}", "data=long_sharegpt", f"data.path={chats_file}",
        f"data.min_context={MIN}", f"data.max_context={MAX}", f"output_dir={out}",
        "num_prompts=4", "max_new_tokens=8", "context_buckets=[128,256,512]",
        "target.device=cpu", "progress=false", "warmup=false"])
    cli.main()
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["datasets"] == ["long_sharegpt"] and report["lossless"] is True
    lengths = [len(p) for p in report["prompt_ids"]]
    assert len(lengths) == 4 and lengths == sorted(lengths) and lengths[0] < 128 < lengths[-1]
    rows = {r["context"]: r for r in report["tau_by_context"]}
    assert "0-127" in rows and "256-511" in rows
    assert sum(r["rounds"] for r in rows.values()) == report["num_rounds"]
    assert math.isclose(sum(r["tokens"] for r in rows.values()),
                        sum(sum(a) for a in report["acceptance_lengths"]))
