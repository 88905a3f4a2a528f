"""Conversations (OpenAI ``messages`` or ShareGPT ``conversations``) -> token ids + loss mask,
through the tokenizer's own chat template. The mask covers every assistant turn's content
including its end-of-turn token, read from the template itself (:func:`find_turn_end`); rows
that cannot be trained on raise :class:`BadConversation`, a ValueError the data loops count and
skip or stop on (docs/capture.md, "Your own target and data").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from dflash_lab.targets.target import BUILTIN_CHAT_TEMPLATES

log = logging.getLogger(__name__)

_SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant", "tool": "tool",
}
_ROLES = ("system", "user", "assistant", "tool")
#: Probe contents: plain ASCII words no template trims, splits or escapes.
_PROBE = ("dflashprobeuserone", "dflashprobeassistantone", "dflashprobeusertwo",
          "dflashprobeassistanttwo")


class BadConversation(ValueError):
    """A conversation that cannot be trained on, saying why (the data loop adds the row id)."""


@dataclass
class TokenizedConversation:
    """``input_ids`` [S] int64 and ``loss_mask`` [S] bool (True on assistant tokens)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor


@dataclass(frozen=True)
class TurnEnd:
    """What the chat template writes right after an assistant content, up to and including
    the end-of-turn token: ``text`` (e.g. ``"<end_of_turn>"``; empty when the template writes
    no such token), its ``token_id`` and whether that id is one of the target's stop ids."""

    text: str
    token_id: int | None
    is_stop: bool


def normalize_conversation(row: dict[str, Any], where: str = "<row>") -> list[dict[str, Any]]:
    """A dataset row in OpenAI or ShareGPT format -> list of {"role", "content"} messages."""
    if "messages" in row and row["messages"] is not None:
        msgs = [dict(m) for m in row["messages"]]
        for m in msgs:
            if m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise BadConversation(f"{where}: message {m!r} needs role in {list(_ROLES)} and "
                                      "a string content (OpenAI 'messages' format)")
        return msgs
    if "conversations" in row and row["conversations"] is not None:
        msgs = []
        for turn in row["conversations"]:
            role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None or not isinstance(turn.get("value"), str):
                raise BadConversation(f"{where}: ShareGPT turn {turn!r} needs 'from' in "
                                      f"{sorted(_SHAREGPT_ROLES)} and a string 'value'")
            msgs.append({"role": role, "content": turn["value"]})
        return msgs
    raise BadConversation(f"{where}: row has keys {sorted(row)}; expected 'messages' (OpenAI "
                          "role/content) or 'conversations' (ShareGPT from/value)")


def check_roles(messages: list[dict[str, Any]], answers: bool = True) -> None:
    """Refuse what no chat template renders into a usable sample: no assistant turn, an empty
    user/assistant/tool turn, or two user (or two assistant) turns in a row. ``answers=False``
    (regeneration rewrites the answers) accepts missing or empty assistant turns."""
    if answers and not any(m["role"] == "assistant" for m in messages):
        raise BadConversation("conversation has no assistant turn, so no token would get a "
                              "loss; drop such rows or add the target's answers")
    for k, m in enumerate(messages):
        blank_ok = m["role"] == "system" or (m["role"] == "assistant" and not answers)
        if not blank_ok and not m["content"].strip():
            raise BadConversation(f"message {k} ({m['role']}) is empty")
        if k and m["role"] in ("user", "assistant") and messages[k - 1]["role"] == m["role"]:
            raise BadConversation(f"roles do not alternate: messages {k - 1} and {k} are both "
                                  f"{m['role']!r} turns")


def check_conversation(tokenizer, messages: list[dict[str, Any]],
                       enable_thinking: bool | None = None, answers: bool = True) -> None:
    """BadConversation unless :func:`check_roles` accepts ``messages`` and the chat template
    renders them (templates such as Gemma's raise on roles they do not accept)."""
    check_roles(messages, answers)
    _render(tokenizer, messages, False, enable_thinking)


def require_chat_template(tokenizer, where: str) -> None:
    """One-line ValueError when ``tokenizer`` has no chat template (GGUF files often carry
    none), naming ``where`` and the fix, instead of transformers' multi-line error."""
    if getattr(tokenizer, "chat_template", None):
        return
    name = getattr(tokenizer, "name_or_path", "") or "the target"
    raise ValueError(f"{where}: the tokenizer of {name} has no chat template; set "
                     "target.chat_template=FILE (.jinja, or a JSON file with a chat_template "
                     f"key) or one of {' | '.join(sorted(BUILTIN_CHAT_TEMPLATES))}")


def _render(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
            enable_thinking: bool | None) -> str:
    """The template's text (``enable_thinking`` if set); a template error (Gemma's) is a bad row."""
    from jinja2.exceptions import TemplateError

    require_chat_template(tokenizer, "rendering conversations")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **({} if enable_thinking is None else
                                                {"enable_thinking": enable_thinking}))
    except TemplateError as err:
        raise BadConversation(f"chat template error: {type(err).__name__}: {err}") from err


def render_prompt(tokenizer, messages: list[dict[str, Any]],
                  enable_thinking: bool | None = None) -> str:
    """The chat-template text that asks the model for the next assistant turn."""
    return _render(tokenizer, messages, True, enable_thinking)


def target_stop_ids(target) -> list[int]:
    """Ids that end a generation: the tokenizer's EOS and the generation config's EOS list (sorted,
    distinct); the one definition capture, regeneration and the eval (local and server) read."""
    ids = [target.tokenizer.eos_token_id]
    gen = getattr(getattr(target, "model", None), "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids += [eos] if isinstance(eos, int) else list(eos or [])
    return sorted({int(i) for i in ids if i is not None})


def _closing_text(tokenizer, enable_thinking: bool | None) -> str:
    """What the template writes after an assistant content both mid-conversation and at the
    end (their common prefix): the turn's closing, without the next turn's header."""
    user1, bot1, user2, bot2 = _PROBE
    probe = [{"role": "user", "content": user1}, {"role": "assistant", "content": bot1},
             {"role": "user", "content": user2}, {"role": "assistant", "content": bot2}]
    try:
        text = _render(tokenizer, probe, False, enable_thinking)
    except BadConversation as err:  # a template property, not a row's: never skipped
        raise ValueError(f"the chat template cannot render a plain user/assistant "
                         f"conversation ({err}); it is not supported for loss masking") from err
    if bot1 not in text or bot2 not in text:
        raise ValueError("the chat template does not render assistant contents verbatim (a "
                         f"probe content went missing in {text!r}); it is not supported for "
                         "loss masking")
    mid = text[text.index(bot1) + len(bot1):]
    end = text[text.rindex(bot2) + len(bot2):]
    return os.path.commonprefix([mid, end])


def find_turn_end(tokenizer, stop_ids: list[int] | tuple[int, ...] = (),
                  enable_thinking: bool | None = None) -> TurnEnd:
    """The end of an assistant turn as this chat template writes it: in the closing text
    (:func:`_closing_text`), just past the first stop id (``stop_ids`` and the tokenizer's EOS),
    else the first added/special token. Warns when there is none (the drafter never learns to end
    a turn) or it is no stop id (the target would not stop: check its eos_token_id)."""
    closing = _closing_text(tokenizer, enable_thinking)
    stops = {int(i) for i in stop_ids} | ({tokenizer.eos_token_id} - {None})
    added = (set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)) - {
        tokenizer.unk_token_id}
    enc = tokenizer(closing, add_special_tokens=False, return_offsets_mapping=True)
    found = [(tid, end) for tid, (_, end) in zip(enc["input_ids"], enc["offset_mapping"])
             if tid in stops or tid in added]
    if not found:
        log.warning("the chat template writes no end-of-turn token after an assistant turn "
                    "(it writes %r): the loss mask ends at the content, so the drafter never "
                    "learns to end a turn", closing)
        return TurnEnd("", None, False)
    tid, end = next(((t, e) for t, e in found if t in stops), found[0])
    if tid not in stops:
        log.warning("end-of-turn token %r (id %d) written by the chat template is not among the "
                    "target's stop ids %s: it is in the loss mask, but generation would not stop "
                    "there (check generation_config.eos_token_id)", closing[:end], tid,
                    sorted(stops))
    return TurnEnd(closing[:end], int(tid), tid in stops)


def assistant_char_spans(tokenizer, messages: list[dict[str, Any]], *,
                         last_turn_only: bool = False, enable_thinking: bool | None = None,
                         turn_end: TurnEnd | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; returns (text, [(start, end) char spans of assistant turns]). A
    turn starts where its generation prompt ends (excluding header glue such as an empty think
    block) and ends just after ``turn_end`` (default :func:`find_turn_end`). BadConversation for
    roles :func:`check_roles` refuses, a template error, or a render not prefix-consistent."""
    check_roles(messages)
    if turn_end is None:
        turn_end = find_turn_end(tokenizer, enable_thinking=enable_thinking)
    text = _render(tokenizer, messages, False, enable_thinking)
    spans = []
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:k], True, enable_thinking)
        if not text.startswith(prompt):
            raise BadConversation("chat template renders turn prefixes inconsistently (the "
                                  f"generation prompt before assistant turn {k} is not a prefix "
                                  "of the full text); this template is not supported for loss "
                                  "masking")
        for content in (msg["content"], msg["content"].strip()):  # Gemma, Llama 3 trim it
            content_end = text.find(content, len(prompt))
            if content_end >= 0:
                content_end += len(content)
                break
        else:
            raise BadConversation(f"assistant turn {k}: content not found in the rendered text")
        if not text.startswith(turn_end.text, content_end):
            raise BadConversation(f"assistant turn {k}: the template's end of turn "
                                  f"{turn_end.text!r} does not follow the content")
        spans.append((len(prompt), content_end + len(turn_end.text)))
    return text, spans[-1:] if last_turn_only else spans


def tokenize_conversation(tokenizer, messages: list[dict[str, Any]], *,
                          max_length: int | None = None, last_turn_only: bool = False,
                          enable_thinking: bool | None = None,
                          turn_end: TurnEnd | None = None) -> TokenizedConversation:
    """Token ids and loss mask (tokens whose first character is in an assistant span) of one
    conversation, truncated to ``max_length``. Needs a fast tokenizer (offsets); ``turn_end``
    (:func:`find_turn_end`, once per dataset) saves re-deriving it per conversation."""
    text, spans = assistant_char_spans(tokenizer, messages, last_turn_only=last_turn_only,
                                       enable_thinking=enable_thinking, turn_end=turn_end)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = torch.tensor([s for s, _ in enc["offset_mapping"]], dtype=torch.long)
    mask = torch.zeros(len(starts), dtype=torch.bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenizedConversation(ids, mask)
