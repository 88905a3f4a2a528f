"""ShareGPT preparation: the truncation-tolerant array reader, filtering, the deterministic
split and the written files, on small handmade inputs (no package data needed)."""

import json

import pytest

from dflash_lab.data.sharegpt import (
    TruncatedArray,
    clean_conversation,
    is_heldout,
    iter_json_array,
    prepare_sharegpt,
    split_key,
)
from dflash_lab.targets.chat import normalize_conversation


def _conv(cid, *turns):
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def _rows(n):
    return [_conv(f"c{i}_0", ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(n)]


def _decode(text):
    info = TruncatedArray()
    return list(iter_json_array(text, info)), info


def test_complete_array_reads_everything():
    rows = _rows(3)
    out, info = _decode(json.dumps(rows, indent=2))
    assert out == rows and info.num_elements == 3 and not info.truncated


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.9])
def test_truncated_mid_element_keeps_complete_rows(cut):
    rows = _rows(4)
    text = json.dumps(rows, indent=2)
    last_start = text.rfind('{\n    "id": "c3_0"')
    cut_at = last_start + int(cut * (len(text) - 2 - last_start))  # inside the last element
    out, info = _decode(text[:cut_at])
    assert out == rows[:3]
    assert info.truncated and info.stopped_at == last_start


def test_truncated_right_after_a_comma_or_element():
    rows = _rows(2)
    text = json.dumps(rows)
    first_end = text.index("}]}") + 3
    assert _decode(text[:first_end + 1])[0] == rows[:1]  # "...}," cut after the comma
    out, info = _decode(text[:first_end])                 # "...}" cut after the element
    assert out == rows[:1] and info.truncated


def test_empty_array_and_bad_inputs():
    assert _decode(" [ ] ")[0] == []
    with pytest.raises(ValueError, match="does not start with"):
        _decode('{"a": 1}')
    with pytest.raises(ValueError, match="expected ',' or ']'"):
        _decode('[{"a": 1} {"b": 2}]')


def test_clean_conversation_filters_and_trims():
    ok = _conv("a", ("gpt", "orphan continuation"), ("human", "hi"), ("gpt", "hello"))
    assert [t["from"] for t in clean_conversation(ok)] == ["human", "gpt"]
    assert clean_conversation(_conv("b", ("human", "hi"))) is None            # no answer
    assert clean_conversation(_conv("c", ("human", "hi"), ("gpt", "  "))) is None  # empty answer
    assert clean_conversation(_conv("d", ("human", "hi"), ("robot", "x"))) is None  # unknown
    assert clean_conversation({"id": "e", "conversations": [{"from": "human", "value": 3}]}) \
        is None
    assert clean_conversation({"id": "f"}) is None


def test_split_is_deterministic_and_keeps_chat_parts_together():
    assert split_key("QWJhYvA_12") == "QWJhYvA" and split_key("no_suffix_x") == "no_suffix_x"
    ids = [f"chat{i}" for i in range(2000)]
    held = [c for c in ids if is_heldout(c, 0.1)]
    assert 120 < len(held) < 280  # ~10 %
    assert held == [c for c in ids if is_heldout(c, 0.1)]
    for c in ids[:200]:
        assert is_heldout(f"{c}_0", 0.1) == is_heldout(f"{c}_7", 0.1) == is_heldout(c, 0.1)


def test_prepare_sharegpt_writes_split_files(tmp_path):
    rows = _rows(60) + [_conv("bad_0", ("human", "no answer"))] + [_rows(1)[0]]  # + a duplicate
    text = json.dumps(rows, indent=2).rstrip().removesuffix("]").rstrip()  # the array goes on
    src = tmp_path / "sharegpt.json"
    src.write_text(text + ',\n  {"id": "cut_0", "conversations": [{"from": "hu')  # truncated
    out = tmp_path / "out"
    stats = prepare_sharegpt(out, heldout_fraction=0.25, source=src)
    assert stats["source_truncated"] and stats["num_decoded"] == 62
    assert stats["num_dropped"] == 2 and stats["num_kept"] == 60
    assert stats["num_train"] + stats["num_heldout"] == 60 and stats["num_heldout"] > 0
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines()]
    prompts = [json.loads(x) for x in (out / "heldout_prompts.jsonl").read_text().splitlines()]
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in held)
    assert [p["id"] for p in prompts] == [r["id"] for r in held]
    assert prompts[0]["messages"][0]["role"] == "user"
    for row in train + held:  # the chat module accepts every written row
        assert normalize_conversation(row)[-1]["role"] == "assistant"
    mtime = (out / "train.jsonl").stat().st_mtime_ns
    assert prepare_sharegpt(out, heldout_fraction=0.25, source=src) == stats  # idempotent
    assert (out / "train.jsonl").stat().st_mtime_ns == mtime
    assert prepare_sharegpt(out, heldout_fraction=0.5, source=src)["heldout_fraction"] == 0.5


def test_prepare_sharegpt_rejects_bad_fraction(tmp_path):
    with pytest.raises(ValueError, match="heldout_fraction"):
        prepare_sharegpt(tmp_path, heldout_fraction=1.0, source=tmp_path / "x.json")
