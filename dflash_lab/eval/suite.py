"""The datasets of a generate run: one ``data`` option, or a suite (``suite=reference``: z-lab's
``dflash benchmark`` datasets, prompt formats and ``random.Random(42)`` row order, MT-Bench turns
conditioned on the speculative answers), and the reasoning switch :func:`template_kwargs`, passed
only to a template that reads it (docs/eval.md, "The reference suite").
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf

from dflash_lab.data.row_files import LOCAL_BUILDERS, check_columns, read_row_file, row_place
from dflash_lab.eval.long_prompts import KIND as LONG_KIND
from dflash_lab.eval.long_prompts import build_long_chats, context_targets
from dflash_lab.eval.prompts import encode_prompt, load_rows, row_messages, row_where, set_fields
from dflash_lab.eval.records import ResponseRecord
from dflash_lab.paths import CONF_DIR
from dflash_lab.terminal import Bar

log = logging.getLogger("dflash_lab.eval")
DATA_GROUP = "eval_data"  #: conf/eval_data/: the options of ``data=`` (placed at ``data``)
SUITES = {"reference": ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")}
_OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


@dataclass
class Item:
    """One dataset row to answer: the messages up to its first user turn, then the later user
    turns (multi-turn rows), each answered after the assistant's answer to the one before."""

    index: int  #: row index in the dataset (before the shuffle)
    messages: list[dict[str, Any]]
    followups: list[str] = field(default_factory=list)


def data_configs(cfg) -> list:
    """The data config of each dataset to run: ``cfg.data``, or the suite's options
    (conf/eval_data/<name>.yaml with the run's rendering keys and ``suite_dir`` copies)."""
    suite = cfg.get("suite")
    if suite is None:
        return [cfg.data]
    if suite not in SUITES:
        raise ValueError(f"suite={suite!r}: use one of {sorted(SUITES)} (or null: the data option)")
    render = {k: cfg.data[k] for k in RENDER_KEYS if k in cfg.data}
    out = []
    for name in SUITES[suite]:
        node = OmegaConf.load(CONF_DIR / DATA_GROUP / f"{name}.yaml")
        node.merge_with(render)
        if cfg.get("suite_dir"):
            node.path = str(local_copy(Path(cfg.suite_dir), name))
        out.append(node)
    return out


#: data keys that say how prompts are rendered (conf/eval.yaml): shared by every dataset
RENDER_KEYS = ("chat_template", "enable_thinking", "reasoning_effort", "chat_template_kwargs",
               "max_prompt_tokens")


def local_copy(root: Path, name: str) -> Path:
    """``root/<name>.jsonl|.json|.parquet`` or the save_to_disk directory ``root/<name>``."""
    found = [root / f"{name}{s}" for s in LOCAL_BUILDERS if (root / f"{name}{s}").is_file()]
    if (root / name).is_dir():
        found.append(root / name)
    if not found:
        raise ValueError(f"suite_dir={root}: no local copy of {name} ({name}.jsonl, "
                         f"{name}.json, {name}.parquet or a datasets save_to_disk dir {name}/)")
    return found[0]


def dataset_name(d) -> str:
    """The report's row label of a data config."""
    return str(d.name) if d.get("name") else Path(str(d.path)).name or str(d.path)


def is_reference(d) -> bool:
    return d.get("hub_id") is not None


def _read_local(path: str, split: str | None):
    import datasets

    p = Path(path)
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"data.path={path}: a DatasetDict without split {split!r} "
                                 f"(it has {sorted(ds)})")
            ds = ds[split]
        return ds
    if p.suffix not in LOCAL_BUILDERS or not p.is_file():
        raise ValueError(f"data.path={path!r}: expected a .jsonl/.json/.parquet file or a "
                         "datasets save_to_disk directory in the hub schema")
    return read_row_file(p, f"data.path={path!r}")


def _offline_fix(d) -> str:
    return (f"data={d.name} reads {d.hub_id} from the hub; offline, pass a local copy in its "
            f"schema: data.path=FILE.jsonl|.parquet or a datasets save_to_disk dir (suite: "
            f"suite_dir=DIR with {d.name}.jsonl or {d.name}/)")


def _read_hub(d):
    import datasets

    if any(os.environ.get(k, "0") not in ("", "0", "false", "False") for k in _OFFLINE_ENV):
        raise ValueError(f"{_offline_fix(d)} ({'/'.join(_OFFLINE_ENV)} is set)")
    try:
        return datasets.load_dataset(d.hub_id, d.get("hub_config"), split=d.split)
    except Exception as err:  # no network, no such id: the user's fix is the same
        raise ValueError(f"{_offline_fix(d)}: loading it failed with {type(err).__name__}: "
                         f"{err}") from err


def reference_rows(d) -> list[dict[str, Any]]:
    """The rows of a reference dataset, checked for its text field: the column first (a copy
    in another schema), then each row (by its row, and line in a .jsonl copy)."""
    ds = _read_local(str(d.path), d.split) if d.get("path") else _read_hub(d)
    name = f"data.path={str(d.path)!r}" if d.get("path") else d.hub_id
    local = Path(str(d.path)) if d.get("path") else None
    check_columns(ds, name, [d.field], f"the {d.hub_id} schema; rename the column or pass a copy "
                  "in that schema", local)
    rows = [dict(r) for r in ds]
    where = row_where(str(d.path)) if local is not None else lambda i: row_place(name, i, None)
    for i, row in enumerate(rows):
        value = row.get(d.field)
        ok = (isinstance(value, list) and value and all(isinstance(t, str) for t in value)
              if d.multi_turn else isinstance(value, str))
        if not ok:
            kind = "a list of turn strings" if d.multi_turn else "a string"
            raise ValueError(f"{where(i)}: field {d.field!r} must be {kind} ({d.hub_id} "
                             f"schema); the row has fields {set_fields(row)}; fix that row")
    return rows


def _reference_item(d, index: int, row: dict[str, Any]) -> Item:
    turns = row[d.field] if d.multi_turn else [row[d.field]]
    texts = [d.prompt_format.format(prompt=t) for t in turns]
    return Item(index, [{"role": "user", "content": texts[0]}], texts[1:])


def is_long(d) -> bool:
    """A long-context option (``kind: long_chat``, :mod:`dflash_lab.eval.long_prompts`): its
    prompts are built to token lengths, so they need the target's tokenizer."""
    return d.get("kind") == LONG_KIND


def long_items(d, num_prompts: int | None, tokenizer) -> list[Item]:
    """The long-context prompt set of ``d``: ``num_prompts`` chats of held-out conversations,
    each rendered (as :func:`prompt_ids` renders it) to its target length."""
    if num_prompts is None:
        raise ValueError(f"data={dataset_name(d)} builds num_prompts prompts to spread lengths "
                         "over [data.min_context, data.max_context]: give num_prompts=N")
    path = str(d.path)
    kwargs = template_kwargs(tokenizer, d)
    targets = context_targets(int(num_prompts), int(d.min_context), int(d.max_context),
                              str(d.get("spacing", "log")))
    chats = build_long_chats(load_rows(path), row_where(path), tokenizer,
                             lambda m: len(prompt_ids(tokenizer, m, d, kwargs)), targets,
                             max_context=int(d.max_context), seed=int(d.shuffle_seed or 0))
    for k, (msgs, used) in enumerate(chats):
        log.info("%s prompt %d: target %d tokens, %d messages from rows %s", dataset_name(d), k,
                 targets[k], len(msgs), used)
    return [Item(k, msgs) for k, (msgs, _) in enumerate(chats)]


def check_long_fits(d, max_new: int, max_positions: int | None) -> None:
    """A long prompt set's longest prompt plus the answer must fit the target's positions."""
    if max_positions is not None and int(d.max_context) + max_new > int(max_positions):
        raise ValueError(f"data.max_context={d.max_context} + max_new_tokens={max_new} > the "
                         f"target's max_position_embeddings={max_positions}; lower "
                         "data.max_context (or max_new_tokens)")


def items_before_target(configs: list, num_prompts: int | None) -> list[list[Item] | None]:
    """Each data config's items, read before anything loads (a bad file stops the run first); None
    for a long-context option (read here; items need the tokenizer: :func:`items_with_target`)."""
    for d in filter(is_long, configs):
        load_rows(str(d.path))
    return [None if is_long(d) else load_items(d, num_prompts) for d in configs]


def items_with_target(configs: list, items: list[list[Item] | None], num_prompts: int | None,
                      target, budgets: list[int]) -> list[list[Item]]:
    """:func:`items_before_target`'s list completed with the long-context options' items (built
    with ``target``'s tokenizer, checked against its ``max_position_embeddings`` if any)."""
    config = getattr(getattr(target, "model", None), "config", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    for d, its, max_new in zip(configs, items, budgets):
        if its is None:
            check_long_fits(d, max_new, max_positions)
    return [long_items(d, num_prompts, target.tokenizer) if its is None else its
            for d, its in zip(configs, items)]


def load_items(d, num_prompts: int | None) -> list[Item]:
    """The first ``num_prompts`` rows of a data config after its seeded shuffle, as items."""
    rows = reference_rows(d) if is_reference(d) else load_rows(str(d.path), d.get("split"))
    order = list(range(len(rows)))
    if d.get("shuffle_seed") is not None:
        random.Random(int(d.shuffle_seed)).shuffle(order)
    if num_prompts is not None and int(num_prompts) > len(rows):
        log.warning("num_prompts=%d but %s holds %d rows: evaluating all %d", int(num_prompts),
                    dataset_name(d), len(rows), len(rows))
    order = order if num_prompts is None else order[:int(num_prompts)]
    if not order:
        raise ValueError(f"data {dataset_name(d)} gave no prompts (rows={len(rows)})")
    if is_reference(d):
        return [_reference_item(d, i, rows[i]) for i in order]
    where = row_where(str(d.path))
    return [Item(i, row_messages(rows[i], where(i), d.get("prompt_format"))) for i in order]


def template_kwargs(tokenizer, d) -> dict[str, Any]:
    """``chat_template_kwargs`` plus the reasoning switch (refused if the template ignores it)."""
    kwargs = dict(d.get("chat_template_kwargs") or {})
    template = str(getattr(tokenizer, "chat_template", "") or "")
    name = getattr(tokenizer, "name_or_path", "") or "the target"
    if d.get("enable_thinking") is not None:
        if "enable_thinking" not in template:
            raise ValueError(f"data.enable_thinking={d.enable_thinking}: the chat template of "
                             f"{name} has no enable_thinking switch; leave it null")
        kwargs["enable_thinking"] = bool(d.enable_thinking)
    if d.get("reasoning_effort") is not None:
        keys = [k for k in ("reasoning_effort", "reasoning_strength") if k in template]
        if not keys:
            raise ValueError(f"data.reasoning_effort={d.reasoning_effort}: the chat template of "
                             f"{name} reads neither reasoning_effort nor reasoning_strength; "
                             "leave it null (data.enable_thinking is the on/off switch)")
        kwargs[keys[0]] = d.reasoning_effort
    return kwargs


def budget(cfg, d) -> int:
    """``max_new_tokens``; left at its default (``${data.max_new_tokens}``), the suite's datasets
    each keep their own (2048, the reference budget)."""
    default = OmegaConf.is_config(cfg) and OmegaConf.is_interpolation(cfg, "max_new_tokens")
    value = d.max_new_tokens if (cfg.get("suite") and default) else cfg.max_new_tokens
    if int(value) < 1:
        raise ValueError(f"max_new_tokens={value}: must be >= 1")
    return int(value)


def prompt_ids(tokenizer, messages: list[dict[str, Any]], d, kwargs: dict[str, Any]) -> list[int]:
    """A turn's prompt as the data config renders it: the chat template (with ``kwargs``, from
    :func:`template_kwargs`) or plain text, then the ``max_prompt_tokens`` tail if set."""
    ids = encode_prompt(tokenizer, messages, chat_template=d.chat_template,
                        template_kwargs=kwargs)
    return ids[-int(d.max_prompt_tokens):] if d.get("max_prompt_tokens") else ids


@dataclass(frozen=True)
class Turn:
    """Where a prompt sits: its dataset, the item's index in it, the turn (0 = first)."""

    dataset: str
    index: int
    turn: int


class Responder(Protocol):
    """What answers the prompts of a run: the local decoder (eval/evaluate.py) or a serving
    engine's client (eval/server_eval.py). It keeps what it gathers for its own report."""

    def warm(self, ids: list[int], max_new: int) -> None:
        """An untimed answer before the first measured one (kernels, caches)."""

    def respond(self, ids: list[int], max_new: int, where: Turn) -> tuple[ResponseRecord, str]:
        """Answer ``ids`` (<= ``max_new`` new tokens): the record and text a later turn follows."""


def answer_every_prompt(responder: Responder, tokenizer, configs: list, items: list[list[Item]],
                        budgets: list[int], *, warm: bool, progress: bool, label: str,
                        ) -> tuple[list[ResponseRecord], list[list[int]]]:
    """Every turn of every item of every dataset through ``responder``, in order, after one
    untimed warm-up when ``warm``: the records and the prompt ids. Turn 0 is the item's messages;
    each later turn adds the item's follow-up to the conversation so far, whose assistant messages
    are the responder's answers (the speculative or served one, not the dataset's), so a
    multi-turn score follows what was actually generated."""
    records: list[ResponseRecord] = []
    asked: list[list[int]] = []
    for d, its, max_new in zip(configs, items, budgets):
        name, kwargs = dataset_name(d), template_kwargs(tokenizer, d)
        for item in Bar(its, desc=f"{label} {name}", unit="prompt", disable=not progress):
            messages = list(item.messages)
            for turn, followup in enumerate([None, *item.followups]):
                if followup is not None:
                    messages.append({"role": "user", "content": followup})
                ids = prompt_ids(tokenizer, messages, d, kwargs)
                if warm:
                    responder.warm(ids, max_new)
                    warm = False
                record, answer = responder.respond(ids, max_new, Turn(name, item.index, turn))
                records.append(record)
                asked.append(ids)
                messages.append({"role": "assistant", "content": answer})
    return records, asked
