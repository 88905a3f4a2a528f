"""Decoded texts in the eval report: prompt, target output and the output with its accepted
draft spans marked (dflash_lab/eval/report.py)."""

from __future__ import annotations

import json

from dflash_lab.eval.loop import Generation
from dflash_lab.eval.report import (
    CLOSE,
    OPEN,
    draft_spans,
    generation_report,
    markdown,
    marked_text,
    write_report,
)


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def words(ids: list[int]) -> str:
    """A tokenizer whose pieces depend on their neighbours (a space between tokens)."""
    return " ".join(f"w{i}" for i in ids)


def test_each_round_marks_its_drafts_not_its_bonus():
    # first token, round of 3 (2 drafts + bonus), round of 1 (bonus only), round of 2
    gen = Generation(list(range(7)), 1.0, acceptance_lengths=[3, 1, 2])
    assert draft_spans(gen) == [(1, 3), (5, 6)]
    marked = marked_text(gen.output_ids, draft_spans(gen), letters)
    assert marked == f"a{OPEN}bc{CLOSE}de{OPEN}f{CLOSE}g"


def test_marked_text_without_markers_is_the_plain_decode():
    ids = [4, 8, 15, 16, 23, 42]
    text = marked_text(ids, [(0, 2), (3, 5)], words)
    assert text == f"{OPEN}w4 w8{CLOSE} w15{OPEN} w16 w23{CLOSE} w42"
    assert text.replace(OPEN, "").replace(CLOSE, "") == words(ids)


def test_marked_text_with_the_tiny_tokenizer(tiny_target):
    tok = tiny_target.tokenizer
    ids = tok("The answer is 42, as computed.", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 4
    text = marked_text(ids, [(1, 3)], tok.decode)
    assert text.count(OPEN) == 1 and text.count(CLOSE) == 1
    assert text.replace(OPEN, "").replace(CLOSE, "") == tok.decode(ids)


def report_of(decode, baseline_ids=None):
    spec = [Generation([0, 1, 2, 3], 1.0, acceptance_lengths=[3], ttft_seconds=0.1)]
    base = None if baseline_ids is None else [Generation(baseline_ids, 2.0, ttft_seconds=0.1)]
    return generation_report(spec, base, [[5, 6]], 4, {"block_size": 4, "temperature": 0},
                             decode=decode)


def test_report_json_and_md_hold_the_texts(tmp_path):
    report = report_of(letters, baseline_ids=[0, 1, 2, 4])
    assert report["responses"] == [{"prompt_text": "fg", "target_output_text": "abce",
                                    "output_text": "abcd",
                                    "output_marked": f"a{OPEN}bc{CLOSE}d"}]
    write_report(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["responses"] == report["responses"]
    md = (tmp_path / "report.md").read_text()
    responses = md[md.index("## Responses"):]
    assert f"a{OPEN}bc{CLOSE}d" in responses and "fg" in responses
    assert "The target alone wrote:" in responses and "abce" in responses  # it differs


def test_no_decoder_no_texts():
    report = report_of(None)
    assert report["responses"] is None
    assert "## Responses" not in markdown(report)
