"""A small, deterministic demo corpus of chat conversations (OpenAI ``messages`` format),
generated from a seed (nothing downloaded): templated but structured tasks (arithmetic, counting,
sequences, sorting, spelling, small facts, multi-turn follow-ups), so that a tiny target learns
real patterns and a drafter trained on its outputs has something to learn. Pre-trains the
built-in tiny target; demo training data.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from dflash_lab.paths import atomic_path

Conversation = list[dict[str, str]]

_WORDS = (
    "apple", "river", "stone", "cloud", "garden", "pencil", "window", "forest", "rocket",
    "candle", "bridge", "planet", "silver", "orange", "tiger", "music", "winter", "summer",
    "island", "mirror",
)
_FACTS = (
    ("color of the sky on a clear day", "blue"),
    ("color of fresh grass", "green"),
    ("number of days in a week", "seven"),
    ("number of legs of a spider", "eight"),
    ("opposite of hot", "cold"),
    ("opposite of up", "down"),
    ("first letter of the alphabet", "a"),
    ("number of months in a year", "twelve"),
    ("shape with three sides", "a triangle"),
    ("shape with four equal sides", "a square"),
    ("season after spring", "summer"),
    ("season after autumn", "winter"),
    ("day after monday", "tuesday"),
    ("day before friday", "thursday"),
    ("freezing point of water in celsius", "zero degrees"),
    ("number of hours in a day", "twenty four"),
)
_SYSTEM = "You are a helpful assistant. Answer briefly and exactly."


def _qa(question: str, answer: str) -> Conversation:
    """One user turn and the assistant's answer."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _arithmetic(rng: random.Random) -> Conversation:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return _qa(f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}.")


def _counting(rng: random.Random) -> Conversation:
    start, n = rng.randint(1, 50), rng.randint(3, 9)
    nums = ", ".join(str(start + i) for i in range(n))
    return _qa(f"Count {n} numbers starting from {start}.", f"Here they are: {nums}.")


def _sequence(rng: random.Random) -> Conversation:
    step, start, n = rng.randint(2, 9), rng.randint(0, 20), rng.randint(4, 8)
    nums = ", ".join(str(start + i * step) for i in range(n))
    return _qa(f"List {n} numbers from {start} in steps of {step}.", f"The list is {nums}.")


def _sorting(rng: random.Random) -> Conversation:
    nums = rng.sample(range(100), rng.randint(3, 7))
    given = ", ".join(map(str, nums))
    out = ", ".join(map(str, sorted(nums)))
    return _qa(f"Sort these numbers: {given}.", f"Sorted: {out}.")


def _spelling(rng: random.Random) -> Conversation:
    word = rng.choice(_WORDS)
    return _qa(f"Spell the word {word}.", f"{word} is spelled {'-'.join(word)}.")


def _fact(rng: random.Random) -> Conversation:
    question, answer = rng.choice(_FACTS)
    return _qa(f"What is the {question}?", f"The {question} is {answer}.")


def _multi_turn(rng: random.Random) -> Conversation:
    words = rng.sample(_WORDS, rng.randint(3, 5))
    listed = ", ".join(words)
    return [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": f"Remember these words: {listed}."},
        {"role": "assistant", "content": f"I will remember {len(words)} words: {listed}."},
        {"role": "user", "content": "Now say them in reverse order."},
        {"role": "assistant", "content": f"In reverse: {', '.join(reversed(words))}."},
    ]


_TASKS: tuple[Callable[[random.Random], Conversation], ...] = (
    _arithmetic, _counting, _sequence, _sorting, _spelling, _fact, _multi_turn,
)


def demo_conversations(num: int, seed: int = 0) -> list[Conversation]:
    """``num`` conversations in OpenAI ``messages`` format, fully determined by ``seed``."""
    rng = random.Random(seed)
    return [_TASKS[rng.randrange(len(_TASKS))](rng) for _ in range(num)]


def write_demo_jsonl(path: str | Path, num: int = 512, seed: int = 0) -> Path:
    """Write ``num`` demo conversations as JSONL rows ``{"messages": [...]}``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, tmp.open("w") as f:  # every rank of a launch writes it
        for conv in demo_conversations(num, seed):
            f.write(json.dumps({"messages": conv}) + "\n")
    return path
