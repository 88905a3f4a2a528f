"""On-policy data: replace every assistant turn of a conversation set with the target's reply,
turn by turn on the regenerated history, through ``generate`` here or a running server
(:mod:`dflash_lab.serving.completions`); atomic ``part-XXXXX.jsonl`` files (the unit of resume
and of the rank split), ``settings.json``, then ``conversations.jsonl`` and ``manifest.json``
(docs/capture.md, "On-policy data: dflash-regenerate").
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_lab.data.conversations import check_bad_rows_mode, input_row
from dflash_lab.data.row_files import write_jsonl
from dflash_lab.paths import atomic_path, atomic_write_text
from dflash_lab.serving.completions import CompletionServer
from dflash_lab.targets.chat import (
    BadConversation,
    check_conversation,
    normalize_conversation,
    render_prompt,
    target_stop_ids,
)
from dflash_lab.terminal import Bar

log = logging.getLogger("dflash_lab.regenerate")

MERGED_FILE = "conversations.jsonl"
SETTINGS_FILE = "settings.json"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class RegenerateSettings:
    out_dir: str
    max_new_tokens: int = 1024    # per assistant turn
    max_length: int = 4096        # prompt + reply tokens; a turn that would not fit ends the row
    temperature: float = 0.0      # 0: greedy; > 0: sampling (seeded per part)
    top_p: float = 1.0
    batch_size: int = 8           # conversations generated together
    part_size: int = 256          # input rows per part file
    enable_thinking: bool | None = None
    seed: int = 0
    bad_rows: str = "skip"        # skip|error (runtime, not part of the resume check): a bad row
                                  # (roles not alternating, empty turn, template error) is logged
                                  # with its input row and dropped, or stops the run

    def __post_init__(self) -> None:
        check_bad_rows_mode(self.bad_rows, "regenerate.settings.bad_rows")
        checks = {"max_new_tokens": self.max_new_tokens >= 1, "batch_size": self.batch_size >= 1,
                  "part_size": self.part_size >= 1, "temperature": self.temperature >= 0,
                  "top_p": 0 < self.top_p <= 1,
                  "max_length": self.max_length > self.max_new_tokens}
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"regenerate.{key}={getattr(self, key)!r} is out of range "
                                 "(max_new_tokens, batch_size, part_size >= 1; temperature >= 0; "
                                 "0 < top_p <= 1; max_length > max_new_tokens)")


def part_path(out_dir: str | Path, index: int) -> Path:
    return Path(out_dir) / f"part-{index:05d}.jsonl"


def _generation_config(s: RegenerateSettings, stops: list[int], pad: int):
    """Exactly the settings asked for: the model's own generation defaults (a top_k, a
    repetition penalty, do_sample) are not inherited."""
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": 0}
    return GenerationConfig(max_new_tokens=s.max_new_tokens, eos_token_id=stops,
                            pad_token_id=pad, **(sampling if s.temperature > 0 else
                                                 {"do_sample": False}))


def generate_replies(target, histories: list[list[dict[str, Any]]], s: RegenerateSettings,
                     server: CompletionServer | None = None) -> list[tuple[str, int] | None]:
    """The target's next assistant turn for each history: (text, new tokens), or None when the
    prompt plus ``max_new_tokens`` exceeds ``max_length``. Prompts are templated here for both
    backends; ``server`` None runs ``transformers.generate`` on ``target``."""
    tok = target.tokenizer
    prompts = [tok(render_prompt(tok, h, s.enable_thinking), add_special_tokens=False)[
        "input_ids"] for h in histories]
    fits = [k for k, p in enumerate(prompts) if len(p) + s.max_new_tokens <= s.max_length]
    out: list[tuple[str, int] | None] = [None] * len(histories)
    if fits:
        ask, stops = [prompts[k] for k in fits], target_stop_ids(target)
        replies = (_hf_replies(target, ask, s, stops) if server is None
                   else _server_replies(server, ask, s, tok, stops))
        for k, reply in zip(fits, replies):
            out[k] = reply
    return out


def _hf_replies(target, prompts: list[list[int]], s: RegenerateSettings,
                stops: list[int]) -> list[tuple[str, int]]:
    """``generate`` on the left-padded batch; each reply cut at its first end-of-turn token."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]  # pads are masked out
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        gen = target.model.generate(input_ids=ids.to(target.device),
                                    attention_mask=mask.to(target.device),
                                    generation_config=_generation_config(s, stops, pad))
    return [decode_reply(tok, gen[row, width:].tolist(), stops) for row in range(len(prompts))]


def decode_reply(tok, ids: list[int], stops: list[int]) -> tuple[str, int]:
    """(text, token count) of a reply, the same for both backends: the text stops before the first
    end-of-turn token (counted) and skips special tokens; a partial multi-byte character at the
    budget is dropped (``decode`` would invent a U+FFFD; servers withhold it)."""
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    text = tok.decode(ids[:end], skip_special_tokens=True)
    if end == len(ids):
        text = text.rstrip("\ufffd")
    return text, min(end + 1, len(ids))


def _server_replies(server: CompletionServer, prompts: list[list[int]], s: RegenerateSettings,
                    tok, stops: list[int]) -> list[tuple[str, int]]:
    """The served model's replies, decoded here from the token ids the server returns (vLLM and
    SGLang do when asked), else its own text. Sampling: each request gets a seed from torch's
    generator (seeded per part): a part is reproducible where the engine honours seeds."""
    seeds = (torch.randint(0, 2**31 - 1, (len(prompts),)).tolist() if s.temperature > 0
             else [None] * len(prompts))
    replies = server.complete_many(prompts, seeds, max_tokens=s.max_new_tokens,
                                   temperature=s.temperature, top_p=s.top_p,
                                   stop_token_ids=stops)
    return [decode_reply(tok, r.token_ids, stops) if r.token_ids is not None
            else (r.text, r.num_tokens) for r in replies]


def regenerate_batch(target, conversations: list[list[dict[str, Any]]], s: RegenerateSettings,
                     server: CompletionServer | None = None
                     ) -> tuple[list[list[dict[str, Any]] | None], int]:
    """Regenerate every assistant turn, turn by turn across the batch; returns (conversations,
    generated tokens). A conversation stops before a turn that does not fit ``max_length``; one
    left with no assistant turn, or no history for its first, becomes None (dropped)."""
    done: list[list[dict[str, Any]]] = [[] for _ in conversations]
    open_ = [True] * len(conversations)
    tokens = 0
    for turn in range(max(len(c) for c in conversations)):
        asking = []
        for k, conv in enumerate(conversations):
            if not open_[k] or turn >= len(conv):
                continue
            if conv[turn]["role"] != "assistant":
                done[k].append(dict(conv[turn]))
            elif done[k]:
                asking.append(k)
        if not asking:
            continue
        for k, reply in zip(asking, generate_replies(target, [done[k] for k in asking], s,
                                                     server)):
            if reply is None:
                open_[k] = False
                continue
            done[k].append({"role": "assistant", "content": reply[0]})
            tokens += reply[1]
    kept = [c if any(m["role"] == "assistant" for m in c) else None for c in done]
    return kept, tokens


def regenerate_part(target, dataset, index: int, s: RegenerateSettings, progress=None,
                    server: CompletionServer | None = None) -> int:
    """Regenerate input rows [index * part_size, ...) into part ``index``; returns tokens."""
    lo = index * s.part_size
    hi = min(lo + s.part_size, len(dataset))
    torch.manual_seed(s.seed * 1_000_003 + index)  # sampling is reproducible per part
    rows, tokens = [], 0
    for start in range(lo, hi, s.batch_size):
        stop = min(start + s.batch_size, hi)
        good = [(i, c) for i in range(start, stop)
                if (c := _checked(target.tokenizer, dataset[i], i, s)) is not None]
        new, n = regenerate_batch(target, [c for _, c in good], s, server) if good else ([], 0)
        tokens += n
        for (i, _), m in zip(good, new):
            if m is None:  # counted in the manifest's "dropped"; logged so it can be found
                log.warning("input row %d dropped: no assistant turn fitted "
                            "regenerate.settings.max_length=%d", input_row(dataset[i], i),
                            s.max_length)
        rows += [{"messages": m, "source_row": i} for (i, _), m in zip(good, new)
                 if m is not None]
        if progress is not None:
            progress.count(stop - start, n, "generated_tok_per_s")
    write_jsonl(part_path(s.out_dir, index), rows)
    return tokens


def _checked(tokenizer, row: dict[str, Any], position: int,
             s: RegenerateSettings) -> list[dict[str, Any]] | None:
    """The row's messages; a bad row: None (logged, ``bad_rows=skip``) or a ValueError naming it."""
    row_id = input_row(row, position)
    try:
        messages = normalize_conversation(row, "row")
        # Assistant turns are rewritten: they may be empty or missing (prompt-only rows).
        check_conversation(tokenizer, messages, s.enable_thinking, answers=False)
    except BadConversation as err:
        if s.bad_rows == "error":
            raise ValueError(f"input row {row_id}: {err}; fix or drop the row, or set "
                             "regenerate.settings.bad_rows=skip to skip bad rows") from err
        log.warning("input row %d skipped: %s", row_id, err)
        return None
    return messages


def check_settings(out_dir: Path, record: dict[str, Any]) -> None:
    """Write settings.json, or refuse to resume parts made with other settings."""
    path = out_dir / SETTINGS_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k))
        if diff:
            changes = [(k, old.get(k), record.get(k)) for k in diff]
            raise ValueError(f"{out_dir} holds parts made with other settings (differing: "
                             f"{changes}); use a new regenerate.out_dir, or the same settings "
                             "to resume")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")  # every rank


def run_regenerate(target, dataset, s: RegenerateSettings, source: dict[str, Any], *,
                   rank: int = 0, world_size: int = 1, progress: bool = True,
                   server: CompletionServer | None = None) -> dict[str, Any] | None:
    """This process's parts (index % world_size == rank), then the merge once all exist; returns
    the manifest when complete, else None. ``server``: generate through a running vLLM/SGLang
    server (the target then supplies only tokenizer, chat template and stop tokens)."""
    if server is None and getattr(target, "head_only", False):
        raise ValueError("regeneration runs the target: load it whole (target.head_only=false) "
                         "or generate through a server (regenerate.backend=server)")
    out = Path(s.out_dir)
    record = {"settings": {k: v for k, v in asdict(s).items() if k not in ("out_dir",
                                                                          "bad_rows")},
              "source": source, "num_rows": len(dataset), "target": target.identity()}
    if server is not None:
        # A resume must use the same backend and served model; the server's address, root path
        # and context length may change (they do not change the text).
        info = server.connect(s.max_length)
        log.info("generating through %s: model %r (root %s, max_model_len %s)", server.base,
                 info["model"], info["root"], info["max_model_len"])
        record["server"] = {"model": info["model"]}
    check_settings(out, record)
    num_parts = -(-len(dataset) // s.part_size)
    mine = [i for i in range(num_parts) if i % world_size == rank]
    todo = [i for i in mine if not part_path(out, i).is_file()]
    rows = sum(min(s.part_size, len(dataset) - i * s.part_size) for i in todo)
    bar = Bar(total=rows, unit="conv", disable=not progress, desc="regenerate")
    try:
        for i in todo:
            regenerate_part(target, dataset, i, s, bar, server)
    finally:
        bar.close()
    if not all(part_path(out, i).is_file() for i in range(num_parts)):
        return None
    return merge_parts(out, num_parts, record)


def merge_parts(out: Path, num_parts: int, record: dict[str, Any]) -> dict[str, Any]:
    """conversations.jsonl (parts in order) and manifest.json, both written atomically."""
    merged, kept = out / MERGED_FILE, 0
    with atomic_path(merged) as tmp, tmp.open("w") as f:  # two ranks finishing together merge
        for i in range(num_parts):
            text = part_path(out, i).read_text()
            kept += text.count("\n")
            f.write(text)
    manifest = {**record, "num_parts": num_parts, "num_conversations": kept,
                "dropped": record["num_rows"] - kept, "file": MERGED_FILE}
    atomic_write_text(out / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
