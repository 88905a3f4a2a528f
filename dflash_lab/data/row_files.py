"""Local row files (``.jsonl`` / ``.json`` / ``.parquet``) read with ``datasets``: the one error
path of every input loader, each fault one ValueError naming the file, line (or row) and fix,
located only after a failed read (docs/guarantees.md, "Bad values stop at start-up").
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_lab.paths import atomic_write_text

#: suffix -> ``datasets`` builder of the local files every loader reads
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
#: suffix -> what a good file of that kind holds (the fix of every message)
_SHAPES = {".jsonl": "each line of a .jsonl file is one JSON object in UTF-8",
           ".json": "a .json file of rows is one JSON list of objects in UTF-8",
           ".parquet": "a .parquet file is a table with one row per record"}
#: the ``datasets`` builders' loggers: on a bad file they log the error we raise, in other words
_BUILDER_LOGGERS = ("datasets.packaged_modules.json.json",
                    "datasets.packaged_modules.parquet.parquet")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as JSON lines (UTF-8 text as is), written to a temporary file then renamed."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_row_file(path: Path, name: str):
    """The rows of a local ``.jsonl`` / ``.json`` / ``.parquet`` file as a ``datasets.Dataset``
    (``name``: the user's setting; existence and suffix, LOCAL_BUILDERS, are the caller's).
    One-line ValueError: an empty file, a line not UTF-8/JSON/an object (its number), a file
    pyarrow cannot read."""
    import datasets

    builder = LOCAL_BUILDERS[path.suffix]
    with open(path, "rb") as f:  # first 4 KiB empty or whitespace: the file holds nothing
        blank = not f.read(4096).strip()
    if blank:
        raise ValueError(f"{name} is empty: no rows to read ({_SHAPES[path.suffix]})")
    try:
        with _quiet_builder_logs():
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # datasets/pyarrow raise many error types for bad files
        raise _read_error(path, name, err) from err
    if builder == "json" and not is_utf8(path):  # pyarrow replaces bad bytes silently
        raise _place_error(name, locate_json_error(path), path.suffix)
    if len(ds) == 0:
        raise ValueError(f"{name} holds no rows ({_SHAPES[path.suffix]})")
    return ds


def _read_error(path: Path, name: str, err: BaseException) -> ValueError:
    """The message for a file ``datasets`` failed to read: the line (JSON files), else "no
    rows" (an empty JSON list, a parquet table of 0 rows), else pyarrow's reason on one line."""
    builder, shape = LOCAL_BUILDERS[path.suffix], _SHAPES[path.suffix]
    where = locate_json_error(path) if builder == "json" else None
    if where is not None:
        return _place_error(name, where, path.suffix)
    if _holds_no_rows(path):
        return ValueError(f"{name} holds no rows ({shape})")
    return ValueError(f"{name} could not be read as {builder} ({_reason(err)}); the file is "
                      f"damaged or not {builder}: rewrite it ({shape})")


def _place_error(name: str, where: str, suffix: str) -> ValueError:
    """``NAME, line N: reason; fix that line (what a good file holds)`` (or ``row N``)."""
    return ValueError(f"{name}, {where}; fix that {where.split()[0]} ({_SHAPES[suffix]})")


def check_columns(ds, name: str, wanted: Sequence[str], schema: str,
                  path: Path | None = None) -> None:
    """ValueError unless ``ds`` has one of the columns ``wanted``; ``schema`` says which format
    has them. A ``.json`` ``path`` that holds one JSON object (``datasets`` reads it as a single
    row) is named as such: the usual mistake is a dict around the list of rows."""
    if any(c in ds.column_names for c in wanted):
        return
    if path is not None and _is_one_object(path, ds):
        raise ValueError(f"{name} holds one JSON object (keys {ds.column_names}), read as a "
                         f"single row without {' or '.join(map(repr, wanted))}; write the rows "
                         "as a JSON list [{...}, {...}] or one object per line in a .jsonl file")
    raise ValueError(f"{name} has columns {ds.column_names}; expected one of {list(wanted)} "
                     f"({schema})")


def row_lines(path: Path) -> list[int] | None:
    """The file line of each row of a ``.jsonl`` file (``datasets`` skips blank lines), so a
    row-level message can name the line; None for other formats (their rows have no line)."""
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    with open(path, "rb") as f:
        return [number for number, raw in enumerate(f, start=1) if raw.strip()]


def row_place(name: str, row: int, lines: list[int] | None) -> str:
    """``NAME row I`` (from 0, file order), plus ``(line N)`` when ``lines`` (row_lines) has it."""
    line = f" (line {lines[row]})" if lines is not None and row < len(lines) else ""
    return f"{name} row {row}{line}"


def parse_jsonl(data: bytes, name: str) -> list[dict[str, Any]]:
    """Rows of JSONL bytes without ``datasets`` (e.g. gzipped), with read_row_file's errors."""
    where = _jsonl_error(data)
    if where is not None:
        raise _place_error(name, where, ".jsonl")
    return [json.loads(raw) for raw in data.split(b"\n") if raw.strip()]


def is_utf8(path: Path, chunk: int = 1 << 24) -> bool:
    """Whether the whole file decodes as UTF-8 (read in 16 MiB chunks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                decoder.decode(block)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def locate_json_error(path: Path) -> str | None:
    """``line N: reason`` (or ``row N: reason``) of the first place of a JSON/JSONL file that is
    not UTF-8, not valid JSON or not a row object, else None. A .json file is parsed whole. Only
    called after ``datasets`` failed (or found bytes that are not UTF-8)."""
    data = path.read_bytes()
    return _json_document_error(data) if path.suffix == ".json" else _jsonl_error(data)


def _jsonl_error(data: bytes) -> str | None:
    """``line N: reason`` of the first JSONL line that is not a row, else None."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        problem = _json_line_error(raw)
        if problem is not None:
            return f"line {number}: {problem}"
    return None


def _json_line_error(raw: bytes) -> str | None:
    """Why one JSONL line is not a row (not UTF-8, not JSON, not an object), else None."""
    try:
        text = raw.decode("utf-8-sig")  # a BOM (of the first line), as datasets strips it
    except UnicodeDecodeError as err:
        return f"not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})"
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return f"malformed JSON ({err.msg} at column {err.colno})"
    return None if isinstance(value, dict) else f"{_json_kind(value)}, not an object"


def _json_document_error(data: bytes) -> str | None:
    """Why a whole .json file is not rows: its first non-UTF-8 byte or its JSON error (by line;
    JSON lines line by line), a top level neither a list nor an object, or a list item not an
    object (by row). An object is left to :func:`check_columns` (``datasets`` reads it as a row)."""
    try:
        text = data.decode("utf-8-sig")  # a leading BOM, as datasets strips it
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        return f"line {line}: not UTF-8 (byte {data[err.start]:#04x} at column {column})"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # one value per line: JSON lines, which datasets reads too
            return _jsonl_error(data)
        return f"line {err.lineno}: malformed JSON ({err.msg} at column {err.colno})"
    if isinstance(value, dict):
        return None
    if not isinstance(value, list):
        return f"line 1: {_json_kind(value)} at the top level, not a list of row objects"
    kinds = {type(item) for item in value}
    if kinds <= {str}:  # ``datasets`` reads a list of strings as a "text" column
        return None
    for row, item in enumerate(value):
        if not isinstance(item, dict):
            return f"row {row}: {_json_kind(item)}, not an object"
    return None


def _json_kind(value: Any) -> str:
    names = {list: "a JSON array", str: "a JSON string", bool: "a JSON boolean",
             int: "a JSON number", float: "a JSON number", type(None): "JSON null"}
    return names.get(type(value), "a JSON value")


def _holds_no_rows(path: Path) -> bool:
    """Whether a file that ``datasets`` refused is well formed but empty: a JSON list ``[]`` or
    a parquet table of 0 rows (``datasets`` fails on both with unrelated messages)."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows == 0
        return path.suffix == ".json" and json.loads(path.read_bytes()) == []
    except Exception:  # unreadable: not "empty", the caller reports pyarrow's reason
        return False


def _is_one_object(path: Path, ds) -> bool:
    """Whether a .json file is one JSON object (read by ``datasets`` as a single row)."""
    if path.suffix != ".json" or len(ds) != 1:
        return False
    with open(path, "rb") as f:
        return f.read(4096).lstrip().startswith(b"{")


def _reason(err: BaseException) -> str:
    """``Type: message`` on one line of the (pyarrow) error under ``datasets``' wrapper."""
    from datasets.exceptions import DatasetGenerationError

    while isinstance(err, DatasetGenerationError) and err.__cause__ is not None:
        err = err.__cause__
    return " ".join(f"{type(err).__name__}: {err}".split())


@contextmanager
def _quiet_builder_logs() -> Iterator[None]:
    """Silence the builders' own error log for one read: we raise the fault (file, line) once."""
    loggers = [logging.getLogger(n) for n in _BUILDER_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
