"""Load conversation datasets (local JSONL/JSON/parquet or hub ids) with ``datasets``, and turn
rows into chat-template samples with loss masks, skipping or refusing bad rows by setting."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_lab.data.row_files import LOCAL_BUILDERS, check_columns, read_row_file
from dflash_lab.targets.chat import BadConversation, normalize_conversation, tokenize_conversation
from dflash_lab.targets.demo_corpus import write_demo_jsonl

log = logging.getLogger(__name__)

#: Column :func:`load_conversations` adds: the row's number in the input file (before any
#: shuffling), the id every bad-row report and skip record uses.
INPUT_ROW = "input_row"
_CONVERSATION_COLUMNS = ("messages", "conversations")


def load_conversations(path: str, *, split: str = "train", limit: int | None = None,
                       shuffle_seed: int | None = None):
    """A ``datasets.Dataset`` of conversation rows (``messages`` or ``conversations``), shuffled (if
    a seed is given) then limited; ``path``: a ``.jsonl``/``.json``/``.parquet`` file, else a hub
    id. Column INPUT_ROW (replacing any of that name) keeps each row's file number for reports.
    ValueError: missing file, unknown format, empty dataset, no conversation column, or a bad
    file (:func:`~dflash_lab.data.row_files.read_row_file`)."""
    import datasets

    looks_local = Path(path).suffix in LOCAL_BUILDERS or path.startswith((".", "/")) or "\\" in path
    local = Path(path) if looks_local else None
    if local is not None:
        if local.is_dir():
            raise ValueError(f"data file {path!r} is a directory; pass one .jsonl/.json/.parquet "
                             "file of conversations in it (or a hub dataset id); a capture "
                             "directory is read by data=offline data.path=DIR")
        if not local.is_file():
            raise ValueError(f"data file {path!r} does not exist; pass a local .jsonl/.json/"
                             ".parquet file or a hub dataset id")
        if local.suffix not in LOCAL_BUILDERS:
            raise ValueError(f"data file {path!r}: unknown format {local.suffix!r}; use one of "
                             f"{sorted(LOCAL_BUILDERS)}")
        ds = read_row_file(local, f"data file {path!r}")
    else:
        ds = datasets.load_dataset(path, split=split)
    if len(ds) == 0:
        raise ValueError(f"data {path!r} is empty; nothing to capture")
    check_columns(ds, f"data {path!r}", _CONVERSATION_COLUMNS,
                  "OpenAI messages or ShareGPT format", local)
    if INPUT_ROW in ds.column_names:
        ds = ds.remove_columns(INPUT_ROW)
    ds = ds.add_column(INPUT_ROW, list(range(len(ds))))
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=shuffle_seed)
    if limit is not None:
        ds = ds.select(range(min(int(limit), len(ds))))
    return ds


# ------------------------------------------------------------------ tokenising rows, bad rows
BAD_ROW_MODES = ("skip", "error")


def check_bad_rows_mode(mode: str, key: str) -> str:
    """``mode`` if it is one of BAD_ROW_MODES, else a ValueError naming the setting ``key``."""
    if mode not in BAD_ROW_MODES:
        raise ValueError(f"{key}={mode!r}: use 'skip' (log each bad row with its row id and "
                         "reason, count it in the manifest) or 'error' (stop at the first)")
    return mode


def input_row(row: dict[str, Any], position: int) -> int:
    """The row's ``INPUT_ROW`` (file number, from :func:`load_conversations`), else ``position``."""
    return int(row.get(INPUT_ROW, position))


@dataclass
class TokenizedRows:
    """What :func:`tokenize_rows` made of some rows: ``samples`` (position, TokenizedConversation)
    with a loss token left after truncation, ``bad_rows`` [{"row", "reason"}] that cannot be
    trained on, ``zero_loss_rows`` (input rows left with no loss token, e.g. cut by max_length)."""

    samples: list[tuple[int, Any]] = field(default_factory=list)
    bad_rows: list[dict[str, Any]] = field(default_factory=list)
    zero_loss_rows: list[int] = field(default_factory=list)


def tokenize_rows(tokenizer, rows, first: int, *, source: str, bad_rows: str, setting: str,
                  **tokenize_kwargs: Any) -> TokenizedRows:
    """Chat template + loss mask of ``rows`` (positions ``first``, ``first + 1``, ...). A
    :class:`~dflash_lab.targets.chat.BadConversation` is logged and skipped (``bad_rows=skip``) or
    raises a ValueError naming the row, ``source`` and the ``setting`` that skips it; rows without
    loss tokens are logged together. ``tokenize_kwargs``: ``tokenize_conversation``'s."""
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
        rows, more = out.zero_loss_rows, len(out.zero_loss_rows) - 10
        log.warning("%s: %d rows have no loss token after truncation to max_length and are "
                    "dropped (rows %s%s)", source, len(rows), ", ".join(map(str, rows[:10])),
                    f", ... ({more} more)" if more > 0 else "")
    return out


@dataclass
class Conversations:
    """The conversation rows of a run and where they came from (recorded in the manifest)."""

    dataset: Any   # datasets.Dataset of rows with messages / conversations
    source: dict[str, Any]


def open_conversations(path: str, split: str = "train", limit: int | None = None,
                       shuffle_seed: int | None = 0, demo_rows: int = 512, demo_seed: int = 1,
                       demo_file: str = "outputs/demo/conversations.jsonl") -> Conversations:
    """The conversations every command reads (``data.path``, ``split``, ``limit``,
    ``shuffle_seed``, ``demo_*``), shuffled then limited: conf/conversations/'s ``_target_`` and
    dflash-train's online data. ``path=demo`` first writes ``demo_rows`` rows to ``demo_file``."""
    if path == "demo":
        path = str(write_demo_jsonl(demo_file, num=demo_rows, seed=demo_seed))
    dataset = load_conversations(str(path), split=split, limit=limit, shuffle_seed=shuffle_seed)
    source = {"path": str(path), "split": split, "limit": limit, "shuffle_seed": shuffle_seed}
    return Conversations(dataset, source)
