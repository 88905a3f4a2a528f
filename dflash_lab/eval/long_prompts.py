"""Long-context prompts from held-out chats: ``data=long_sharegpt`` (conf/eval_data/). A prompt is
whole held-out conversations ending with the next one's first question, built to a token length
``T_i`` spread log- or linearly over ``[min_context, max_context]``, the overshoot cut from the
front; deterministic (``random.Random(shuffle_seed)`` order, each conversation used once)
(docs/eval.md, "Long-context prompts").
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from dflash_lab.targets.chat import normalize_conversation

KIND = "long_chat"  #: conf/eval_data/long_sharegpt.yaml's ``kind``
SPACINGS = ("log", "linear")
#: fitting rounds for the front cut (re-tokenising decoded text can shift a token or two)
_FIT_ROUNDS = 6

#: ``messages -> rendered prompt length in tokens`` (chat template + generation prompt)
Measure = Callable[[list[dict[str, Any]]], int]


def context_targets(count: int, min_context: int, max_context: int,
                    spacing: str = "log") -> list[int]:
    """``count`` prompt lengths in ``[min_context, max_context]``, increasing: the midpoints of
    ``count`` equal steps in log (or linear) space, so each of ``count`` strata gets one."""
    if count < 1:
        raise ValueError(f"num_prompts={count}: the long prompt set needs at least 1")
    if not 1 <= min_context <= max_context:
        raise ValueError(f"data.min_context={min_context}, data.max_context={max_context}: "
                         "need 1 <= min_context <= max_context")
    if spacing not in SPACINGS:
        raise ValueError(f"data.spacing={spacing!r}: use one of {list(SPACINGS)}")
    fractions = [(i + 0.5) / count for i in range(count)]
    if spacing == "log":
        lo, hi = math.log(min_context), math.log(max_context)
        return [round(math.exp(lo + f * (hi - lo))) for f in fractions]
    return [round(min_context + f * (max_context - min_context)) for f in fractions]


def chat_turns(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """A conversation's user/assistant turns, alternating, non-empty, ending with an answer
    (system turns dropped: the history is a sequence of chats, not of system prompts)."""
    turns: list[dict[str, str]] = []
    for m in normalize_conversation(row, where):
        if m["role"] not in ("user", "assistant") or not str(m["content"]).strip():
            continue
        if turns and turns[-1]["role"] == m["role"]:
            continue  # keep alternation: the first of two same-role turns
        if not turns and m["role"] == "assistant":
            continue  # a chat starts with a question
        turns.append({"role": m["role"], "content": m["content"]})
    while turns and turns[-1]["role"] != "assistant":
        turns.pop()
    return turns


def cut_front(messages: list[dict[str, Any]], target: int, measure: Measure,
              tokenizer) -> list[dict[str, Any]]:
    """Drop the oldest history so the rendered length is ``target`` (within a few tokens, never
    above): whole leading messages while the rest still reaches ``target``, then the first
    message's leading tokens. The last message (the question) is never cut into."""
    msgs = [dict(m) for m in messages]
    while len(msgs) > 1 and measure(msgs[1:]) >= target:
        msgs.pop(0)
    for _ in range(_FIT_ROUNDS):
        excess = measure(msgs) - target
        if excess <= 0:
            break
        ids = tokenizer(msgs[0]["content"], add_special_tokens=False)["input_ids"]
        if excess >= len(ids):
            if len(msgs) == 1:
                break  # only the question left, and it is longer than the target by itself
            msgs.pop(0)
            continue
        msgs[0]["content"] = tokenizer.decode(ids[excess:], skip_special_tokens=True)
    return msgs


def build_long_chats(rows: list[dict[str, Any]], where: Callable[[int], str], tokenizer,
                     measure: Measure, targets: list[int], *, max_context: int,
                     seed: int = 0) -> list[tuple[list[dict[str, Any]], list[int]]]:
    """One chat per target length: (messages ending with a user question, the row indices of
    the conversations it used). ValueError when the rows run out or a prompt cannot be fitted
    under ``max_context`` (naming the source and the fix)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    stream = iter(order)
    out = []
    for n, target in enumerate(targets):
        history: list[dict[str, Any]] = []
        used: list[int] = []
        while True:
            j = next(stream, None)
            if j is None:
                raise ValueError(
                    f"{where(0).split(' row ')[0]}: its {len(rows)} conversations ran out at "
                    f"prompt {n + 1} of {len(targets)} (target {target} tokens); lower "
                    "num_prompts or data.max_context, or pass a larger data.path")
            turns = chat_turns(rows[j], where(j))
            if not turns:
                continue
            used.append(j)
            question = [turns[0]]
            if measure(history + question) >= target:
                history += question
                break
            history += turns
        msgs = cut_front(history, target, measure, tokenizer)
        length = measure(msgs)
        if length > max_context:
            raise ValueError(f"{where(used[-1])}: its first question alone renders to {length} "
                             f"tokens, above data.max_context={max_context}; raise "
                             "data.max_context or change data.shuffle_seed")
        out.append((msgs, used))
    return out
