"""dflash-regenerate: the target's own replies, turn by turn on the regenerated history;
batching, max_length, resume, the rank split, seeded sampling, and capture of the result."""

import csv
import json

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.data.regenerate_loop import (
    MERGED_FILE,
    RegenerateSettings,
    part_path,
    regenerate_batch,
    run_regenerate,
)
from dflash_lab.paths import CONF_DIR
from dflash_lab.targets.chat import render_prompt
from dflash_lab.targets.demo_corpus import demo_conversations


def _greedy(target, history, max_new_tokens):
    """Reference: HF greedy generation of one prompt, cut at the end-of-turn token."""
    tok = target.tokenizer
    ids = tok(render_prompt(tok, history), add_special_tokens=False, return_tensors="pt")
    out = target.model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tok.pad_token_id)[0, ids["input_ids"].shape[1]:]
    out = out.tolist()
    end = out.index(tok.eos_token_id) if tok.eos_token_id in out else len(out)
    return tok.decode(out[:end], skip_special_tokens=True)


def test_every_assistant_turn_is_the_targets_greedy_reply_to_the_regenerated_history(
        tiny_target):
    conv = [{"role": "user", "content": "Remember these words: tiger, rocket, forest."},
            {"role": "assistant", "content": "ORIGINAL ONE"},
            {"role": "user", "content": "Now say them in reverse order."},
            {"role": "assistant", "content": "ORIGINAL TWO"}]
    s = RegenerateSettings(out_dir="unused", max_new_tokens=40)
    (new,), tokens = regenerate_batch(tiny_target, [conv], s)
    assert [m["role"] for m in new] == [m["role"] for m in conv]
    assert new[0] == conv[0] and new[2] == conv[2]
    first = _greedy(tiny_target, conv[:1], 40)
    assert new[1]["content"] == first and "ORIGINAL" not in first and first
    assert new[3]["content"] == _greedy(tiny_target, [conv[0], new[1], conv[2]], 40)
    assert tokens > 0


def test_batched_generation_equals_one_conversation_at_a_time(tiny_target):
    convs = [c for c in demo_conversations(7, seed=3)]
    s1 = RegenerateSettings(out_dir="unused", max_new_tokens=32, batch_size=1)
    one = [regenerate_batch(tiny_target, [c], s1)[0][0] for c in convs]
    batched, _ = regenerate_batch(tiny_target, convs, s1)
    assert batched == one


def test_a_turn_that_does_not_fit_ends_the_conversation(tiny_target):
    long_user = {"role": "user", "content": "tiger " * 60}
    fits = [{"role": "user", "content": "What is the season after autumn?"},
            {"role": "assistant", "content": "x"}, long_user, {"role": "assistant", "content": "y"}]
    never = [long_user, {"role": "assistant", "content": "z"}]
    s = RegenerateSettings(out_dir="unused", max_new_tokens=16, max_length=64)
    (kept, dropped), _ = regenerate_batch(tiny_target, [fits, never], s)
    assert dropped is None
    assert [m["role"] for m in kept] == ["user", "assistant", "user"]  # stopped before turn 4


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rank_split_and_resume_give_the_single_process_result(tiny_target, tmp_path):
    data = [{"messages": c} for c in demo_conversations(11, seed=5)]
    kw = dict(max_new_tokens=24, part_size=3, batch_size=2)
    single = run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / "one"), **kw),
                            {"path": "demo"}, progress=False)
    assert single["num_parts"] == 4 and single["num_conversations"] == 11
    split = RegenerateSettings(str(tmp_path / "two"), **kw)
    assert run_regenerate(tiny_target, data, split, {"path": "demo"}, rank=0, world_size=2,
                          progress=False) is None  # rank 1's parts are still missing
    run_regenerate(tiny_target, data, split, {"path": "demo"}, rank=1, world_size=2,
                   progress=False)
    want = _rows(tmp_path / "one" / MERGED_FILE)
    assert _rows(tmp_path / "two" / MERGED_FILE) == want
    assert [r["source_row"] for r in want] == list(range(11))
    # Resume after losing a part: only that part is generated again, identically.
    part_path(split.out_dir, 2).unlink()
    untouched = part_path(split.out_dir, 1).stat().st_mtime_ns
    run_regenerate(tiny_target, data, split, {"path": "demo"}, progress=False)
    assert part_path(split.out_dir, 1).stat().st_mtime_ns == untouched
    assert _rows(tmp_path / "two" / MERGED_FILE) == want
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_regenerate(tiny_target, data, RegenerateSettings(split.out_dir, max_new_tokens=8,
                                                             part_size=3, batch_size=2),
                       {"path": "demo"}, progress=False)


def test_sampling_is_seeded_per_part(tiny_target, tmp_path):
    data = [{"messages": c} for c in demo_conversations(4, seed=6)]
    kw = dict(max_new_tokens=24, part_size=2, temperature=1.0, seed=3)
    outs = []
    for name in ("a", "b"):
        run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / name), **kw),
                       {"path": "demo"}, progress=False)
        outs.append(_rows(tmp_path / name / MERGED_FILE))
    assert outs[0] == outs[1]
    greedy = tmp_path / "g"
    run_regenerate(tiny_target, data, RegenerateSettings(str(greedy), max_new_tokens=24,
                                                         part_size=2), {"path": "demo"},
                   progress=False)
    assert _rows(greedy / MERGED_FILE) != outs[0]  # sampling really sampled


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="regenerate.top_p=0"):
        RegenerateSettings(out_dir="x", top_p=0)


def test_cli_config_regenerates_and_capture_reads_the_result(tiny_target_dir, tmp_path):
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.data.conversations import load_conversations
    from dflash_lab.regenerate import regenerate
    from dflash_lab.targets.loader import load_target

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="regenerate", overrides=[
            f"target.path={tiny_target_dir}", "data.demo_rows=6",
            f"data.demo_file={tmp_path / 'demo.jsonl'}", "regenerate.progress=false",
            f"regenerate.settings.out_dir={tmp_path / 'out'}",
            "regenerate.settings.max_new_tokens=24", "regenerate.settings.part_size=4",
            "logger=csv"])
    manifest = regenerate(cfg)
    assert manifest["num_conversations"] == 6 and manifest["target"]["config_hash"]
    with (tmp_path / "out" / "csv" / "version_0" / "metrics.csv").open() as f:  # logger=csv
        rows = list(csv.DictReader(f))
    assert [float(r["regenerate/num_conversations"]) for r in rows] == [6]
    merged = tmp_path / "out" / MERGED_FILE
    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    rows = load_conversations(str(merged))
    settings = CaptureSettings(out_dir=str(tmp_path / "cap"), target_layer_ids=[1, 3, 5],
                               max_length=128, hidden_dtype="float32")
    cap = run_capture(target, rows, settings, {"path": str(merged)}, progress=False)
    assert cap["num_samples"] == 6 and 0 < cap["num_loss_tokens"] < cap["num_tokens"]
