"""Two reports compared by context bucket: rounds placed by prompt + committed tokens, tau as
the report's tau_by_context, the paired bootstrap's interval, the files written."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from dflash_lab.eval.context_compare import compare, main, prompt_buckets
from dflash_lab.eval.records import ResponseRecord, tau_by_context


def _report(records: list[ResponseRecord]) -> dict:
    return {"records": [asdict(r) for r in records]}


def _records(lengths_by_prompt: list[tuple[int, list[int]]]) -> list[ResponseRecord]:
    return [ResponseRecord("long", i, acceptance_lengths=lengths, prompt_tokens=p)
            for i, (p, lengths) in enumerate(lengths_by_prompt)]


def test_buckets_match_the_reports_tau_by_context():
    recs = _records([(90, [3, 3, 3, 3]), (95, [1, 2, 1]), (300, [2, 2])])
    edges = [100, 200]
    cells = prompt_buckets(_report(recs), edges, "r")
    # prompt 0: contexts 90 | 93, 96, 99 -> bucket 0; prompt 1: 95, 96, 98 -> bucket 0
    assert cells[0] == [[4, 12], [0, 0], [0, 0]] and cells[2] == [[0, 0], [0, 0], [2, 4]]
    rows = compare(cells, cells, edges, samples=50)
    want = {r["context"]: r["tau"] for r in tau_by_context(recs, edges)}
    assert {r["context"]: r["tau_a"] for r in rows} == want
    assert all(r["diff"] == r["ci_low"] == r["ci_high"] == 0 for r in rows)


def test_interval_covers_noise_and_excludes_a_clear_gap():
    prompts = [(100 * k, [2, 1, 3, 1, 2]) for k in range(12)]
    same = _records(prompts)
    noisy = _records([(p, [n + (1 if (k + j) % 2 else -1) * (n > 1) for j, n in enumerate(ls)])
                      for k, (p, ls) in enumerate(prompts)])
    better = _records([(p, [n + 2 for n in ls]) for p, ls in prompts])
    edges = [10_000]
    a = prompt_buckets(_report(same), edges, "a")
    [noise] = compare(a, prompt_buckets(_report(noisy), edges, "b"), edges, samples=400)
    [gap] = compare(a, prompt_buckets(_report(better), edges, "b"), edges, samples=400)
    assert noise["ci_low"] <= 0 <= noise["ci_high"]
    assert gap["diff"] == pytest.approx(2.0) and gap["ci_low"] > 1.5


def test_cli_writes_table_plot_and_refuses_mismatched_reports(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report(_records([(500, [1, 2]), (1500, [2, 2])]))))
    b.write_text(json.dumps(_report(_records([(500, [2, 2]), (1500, [1, 1, 1, 1])]))))
    main([str(a), str(b), "--names", "full", "sliding", "--buckets", "1024", "--samples", "20",
          "--out", str(tmp_path / "cmp")])
    text = (tmp_path / "cmp.md").read_text()
    assert "| 0-1023 | 1 | 2 | 1.500 | 2 | 2.000 | +0.500 |" in text
    assert "| >=1024 | 1 | 2 | 2.000 | 4 | 1.000 | -1.000 |" in text
    assert (tmp_path / "cmp.png").stat().st_size > 0
    b.write_text(json.dumps(_report(_records([(500, [2])]))))
    with pytest.raises(SystemExit, match="same prompt set"):
        main([str(a), str(b), "--out", str(tmp_path / "x")])


def test_cli_refuses_a_missing_or_broken_report_naming_it(tmp_path):
    a, bad = tmp_path / "a.json", tmp_path / "bad.json"
    a.write_text(json.dumps(_report(_records([(500, [1, 2])]))))
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match=r"nope.json: no such report; pass the report.json"):
        main([str(a), str(tmp_path / "nope.json"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match=r"bad.json: not JSON"):
        main([str(a), str(bad), "--out", str(tmp_path / "x")])
