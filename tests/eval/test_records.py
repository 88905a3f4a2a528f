"""The per-response record and the two tau conventions (dflash_lab/eval/records.py)."""

from __future__ import annotations

import pytest

from dflash_lab.eval.loop import Generation
from dflash_lab.eval.records import (
    ResponseRecord,
    context_buckets,
    per_dataset,
    record_from_generation,
    summarize,
    tau_by_context,
)


def test_macro_and_pooled_tau_differ_and_are_named():
    """A long response of tau 2 and a short one of tau 5: macro weighs responses, pooled rounds."""
    long = ResponseRecord("gsm8k", 0, acceptance_lengths=[2] * 9, num_output_tokens=19)
    short = ResponseRecord("gsm8k", 1, acceptance_lengths=[5], num_output_tokens=6)
    empty = ResponseRecord("gsm8k", 2, acceptance_lengths=[], num_output_tokens=1)
    row = summarize([long, short, empty], block_size=5)
    assert row["tau_macro"] == pytest.approx((2 + 5) / 2)  # the round-less response left out
    assert row["tau_pooled"] == pytest.approx((18 + 5) / 10)
    assert row["acceptance_histogram"] == [0, 9, 0, 0, 1]
    assert row["per_position_acceptance"] == pytest.approx([1.0, 0.1, 0.1, 0.1])
    assert row["num_responses"] == 3 and row["num_rounds"] == 10


def test_engine_totals_count_in_tau_but_not_the_histogram():
    """A server record with only totals (SGLang: spec_verify_ct, completion_tokens - 1)."""
    engine = ResponseRecord("mbpp", 0, num_output_tokens=13, num_rounds=4, num_round_tokens=12)
    local = ResponseRecord("mbpp", 1, acceptance_lengths=[1, 1], num_output_tokens=3)
    row = summarize([engine, local], block_size=4)
    assert row["tau_macro"] == pytest.approx((3 + 1) / 2)
    assert row["tau_pooled"] == pytest.approx(14 / 6)
    assert row["acceptance_histogram"] == [2, 0, 0, 0]


def test_tpot_is_decode_only_and_speedup_is_the_tpot_ratio():
    spec = Generation([1, 2, 3, 4], seconds=1.0, acceptance_lengths=[3], ttft_seconds=0.6)
    base = Generation([1, 2, 3, 4], seconds=2.6, ttft_seconds=0.2)
    rec = record_from_generation("humaneval", 3, 0, spec, base)
    assert rec.tpot_s == pytest.approx(0.4 / 4) and rec.baseline_tpot_s == pytest.approx(2.4 / 4)
    assert rec.lossless is True and rec.tau == 3
    row = per_dataset([rec], block_size=4)["humaneval"]
    assert row["decode_speedup"] == pytest.approx(6.0)
    assert row["ttft_ms"] == pytest.approx(600) and row["baseline_ttft_ms"] == pytest.approx(200)
    other = Generation([1, 2, 3, 5], seconds=2.6, ttft_seconds=0.2)
    assert record_from_generation("humaneval", 3, 0, spec, other).lossless is False
    assert record_from_generation("humaneval", 3, 0, spec, other, greedy=False).lossless is None


def test_each_round_counts_at_the_context_the_drafter_read():
    """Prompt 1000, rounds of 3, 4, 30, 2 tokens: the first two rounds read < 1024 tokens, the
    third starts at 1007 too, the fourth at 1037; a second turn's longer prompt counts there;
    an engine's totals count at their prompt length; a record without a prompt is left out."""
    local = ResponseRecord("d", 0, acceptance_lengths=[3, 4, 30, 2], prompt_tokens=1000)
    turn2 = ResponseRecord("d", 0, turn=1, acceptance_lengths=[5], prompt_tokens=2100)
    engine = ResponseRecord("d", 1, num_rounds=4, num_round_tokens=10, prompt_tokens=100)
    unknown = ResponseRecord("d", 2, acceptance_lengths=[7])
    rows = tau_by_context([local, turn2, engine, unknown], (1024, 2048, 4096))
    assert rows == [
        {"context": "0-1023", "rounds": 7, "tokens": 47, "tau": 47 / 7,
         "basis": "responses+rounds"},
        {"context": "1024-2047", "rounds": 1, "tokens": 2, "tau": 2.0, "basis": "rounds"},
        {"context": "2048-4095", "rounds": 1, "tokens": 5, "tau": 5.0, "basis": "rounds"}]
    beyond = tau_by_context([ResponseRecord("d", 0, acceptance_lengths=[2], prompt_tokens=5000)],
                            (1024, 4096))
    assert beyond[0]["context"] == ">=4096"


def test_context_buckets_must_increase():
    assert context_buckets({"context_buckets": [512, 4096]}) == [512, 4096]
    assert context_buckets({}) == [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    for bad in ([4096, 512], [0, 10], [], [8, 8]):
        with pytest.raises(ValueError, match="context_buckets=.*increasing token counts"):
            context_buckets({"context_buckets": bad})
