"""Load conversation datasets (local JSONL/JSON/parquet or hub ids) with ``datasets``, and turn
rows into chat-template samples with loss masks, skipping or refusing bad rows by setting."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Column :func:`load_conversations` adds: the row's number in the input file (before any
#: shuffling), the id every bad-row report and skip record uses.
INPUT_ROW = "input_row"
_LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_CONVERSATION_COLUMNS = ("messages", "conversations")


def _looks_local(path: str) -> bool:
    return Path(path).suffix in _LOCAL_BUILDERS or path.startswith((".", "/")) or "\\" in path


def load_conversations(path: str, *, split: str = "train", limit: int | None = None,
                       shuffle_seed: int | None = None):
    """A ``datasets.Dataset`` of conversation rows, shuffled (if a seed is given) then limited.

    Local files: ``.jsonl``/``.json`` (one row per line or a JSON list) and ``.parquet``; anything
    else is treated as a hub dataset id (needs network). Rows must carry ``messages`` (OpenAI) or
    ``conversations`` (ShareGPT). A column ``input_row`` (INPUT_ROW, replacing any of that name)
    keeps each row's number in the file, so reports name a row the user can find. Raises
    ValueError for a missing file, an unknown format, an empty dataset or missing conversation
    columns.
    """
    import datasets

    if _looks_local(path):
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"data file {path!r} does not exist; pass a local .jsonl/.json/"
                             ".parquet file or a hub dataset id")
        builder = _LOCAL_BUILDERS.get(p.suffix)
        if builder is None:
            raise ValueError(f"data file {path!r}: unknown format {p.suffix!r}; use one of "
                             f"{sorted(_LOCAL_BUILDERS)}")
        if not p.read_bytes()[:4096].strip():
            raise ValueError(f"data file {path!r} is empty; nothing to capture")
        try:
            ds = datasets.load_dataset(builder, data_files=str(p), split="train")
        except Exception as err:  # datasets/pyarrow raise many error types for bad files
            where = locate_json_error(p) if builder == "json" else None
            if where is not None:
                raise ValueError(f"data file {path!r}, {where}; fix that line (each line of a "
                                 ".jsonl file is one JSON object in UTF-8)") from err
            raise ValueError(f"data file {path!r} could not be read as {builder} ({err!r}); "
                             "check the file format") from err
        if builder == "json" and not is_utf8(p):  # pyarrow replaces bad bytes silently
            raise ValueError(f"data file {path!r}, {locate_json_error(p)}; fix that line (each "
                             "line of a .jsonl file is one JSON object in UTF-8)")
    else:
        ds = datasets.load_dataset(path, split=split)
    if len(ds) == 0:
        raise ValueError(f"data {path!r} is empty; nothing to capture")
    if not any(c in ds.column_names for c in _CONVERSATION_COLUMNS):
        raise ValueError(f"data {path!r} has columns {ds.column_names}; expected one of "
                         f"{list(_CONVERSATION_COLUMNS)} (OpenAI messages or ShareGPT format)")
    if INPUT_ROW in ds.column_names:
        ds = ds.remove_columns(INPUT_ROW)
    ds = ds.add_column(INPUT_ROW, list(range(len(ds))))
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=shuffle_seed)
    if limit is not None:
        ds = ds.select(range(min(int(limit), len(ds))))
    return ds


def is_utf8(path: Path, chunk: int = 1 << 24) -> bool:
    """Whether the whole file decodes as UTF-8 (read in 16 MiB chunks)."""
    import codecs

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
    """``line N: reason`` of the first line of a JSON/JSONL file that is not UTF-8 or not
    valid JSON (a .json file is parsed whole: its error carries the line), else None. Only
    called after ``datasets`` failed, whose pyarrow errors name neither file nor line."""
    import json

    data = path.read_bytes()
    lines = [data] if path.suffix == ".json" else data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return (f"line {number}: not UTF-8 (byte {raw[err.start]:#04x} at column "
                    f"{err.start + 1})")
        if not text.strip():
            continue
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            line = err.lineno if path.suffix == ".json" else number
            return f"line {line}: malformed JSON ({err.msg} at column {err.colno})"
    return None


# ------------------------------------------------------------------ tokenising rows, bad rows
BAD_ROW_MODES = ("skip", "error")


def check_bad_rows_mode(mode: str, key: str) -> str:
    """``mode`` if it is one of BAD_ROW_MODES, else a ValueError naming the setting ``key``."""
    if mode not in BAD_ROW_MODES:
        raise ValueError(f"{key}={mode!r}: use 'skip' (log each bad row with its row id and "
                         "reason, count it in the manifest) or 'error' (stop at the first)")
    return mode


def input_row(row: dict[str, Any], position: int) -> int:
    """The row's number in the input file (the ``INPUT_ROW`` column that
    :func:`load_conversations` adds before shuffling), else its ``position``."""
    return int(row.get(INPUT_ROW, position))


@dataclass
class TokenizedRows:
    """What :func:`tokenize_rows` made of some rows.

    ``samples``: (position, TokenizedConversation) of rows with at least one loss token after
    truncation; ``bad_rows``: {"row": input row, "reason"} of rows that cannot be trained on;
    ``zero_loss_rows``: input rows left with no loss token (e.g. cut by ``max_length``).
    """

    samples: list[tuple[int, Any]] = field(default_factory=list)
    bad_rows: list[dict[str, Any]] = field(default_factory=list)
    zero_loss_rows: list[int] = field(default_factory=list)


def tokenize_rows(tokenizer, rows, first: int, *, source: str, bad_rows: str, setting: str,
                  **tokenize_kwargs: Any) -> TokenizedRows:
    """Chat template + loss mask of ``rows`` (positions ``first``, ``first + 1``, ...).

    A bad row (:class:`~dflash_lab.target.chat.BadConversation`) is logged with its input row
    and skipped when ``bad_rows == "skip"``; with ``"error"`` it raises a ValueError naming the
    row, ``source`` (the input file) and the ``setting`` that would skip it. Rows without loss
    tokens are logged together. ``tokenize_kwargs`` go to ``tokenize_conversation``.
    """
    from dflash_lab.target.chat import (
        BadConversation,
        normalize_conversation,
        tokenize_conversation,
    )

    out = TokenizedRows()
    for k, row in enumerate(rows):
        row_id = input_row(row, first + k)
        try:
            tc = tokenize_conversation(tokenizer, normalize_conversation(row, "row"),
                                       **tokenize_kwargs)
        except BadConversation as err:
            if bad_rows == "error":
                raise ValueError(f"{source} row {row_id}: {err}; fix or drop the row, or set "
                                 f"{setting}=skip to skip bad rows (each is logged and "
                                 "counted)") from err
            log.warning("%s row %d skipped: %s", source, row_id, err)
            out.bad_rows.append({"row": row_id, "reason": str(err)})
            continue
        if tc.loss_mask.any():
            out.samples.append((first + k, tc))
        else:
            out.zero_loss_rows.append(row_id)
    if out.zero_loss_rows:
        log.warning("%s: %d rows have no loss token after truncation to max_length and are "
                    "dropped (rows %s)", source, len(out.zero_loss_rows),
                    _head(out.zero_loss_rows))
    return out


def _head(items: list[int], num: int = 10) -> str:
    shown = ", ".join(str(i) for i in items[:num])
    return shown + (f", ... ({len(items) - num} more)" if len(items) > num else "")
