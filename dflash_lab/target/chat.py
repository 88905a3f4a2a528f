"""Conversations -> token ids + loss mask, through the tokenizer's own chat template.

The loss mask covers every assistant turn's content INCLUDING its end-of-turn token (the target
generates it, so the drafter must learn it), and nothing else (system/user text, role headers,
generation-prompt glue such as an empty think block). Accepted inputs: OpenAI ``messages``
(role/content) and ShareGPT ``conversations`` (from/value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant", "tool": "tool",
}
_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class TokenizedConversation:
    """``input_ids`` [S] int64 and ``loss_mask`` [S] bool (True on assistant tokens)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def normalize_conversation(row: dict[str, Any], where: str = "<row>") -> list[dict[str, Any]]:
    """A dataset row in OpenAI or ShareGPT format -> list of {"role", "content"} messages."""
    if "messages" in row and row["messages"] is not None:
        msgs = [dict(m) for m in row["messages"]]
        for m in msgs:
            if m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: message {m!r} needs role in {list(_ROLES)} and a "
                                 "string content (OpenAI 'messages' format)")
        return msgs
    if "conversations" in row and row["conversations"] is not None:
        msgs = []
        for turn in row["conversations"]:
            role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None or not isinstance(turn.get("value"), str):
                raise ValueError(f"{where}: ShareGPT turn {turn!r} needs 'from' in "
                                 f"{sorted(_SHAREGPT_ROLES)} and a string 'value'")
            msgs.append({"role": role, "content": turn["value"]})
        return msgs
    raise ValueError(f"{where}: row has keys {sorted(row)}; expected 'messages' (OpenAI "
                     "role/content) or 'conversations' (ShareGPT from/value)")


def _render(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
            template_kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def render_prompt(tokenizer, messages: list[dict[str, Any]],
                  enable_thinking: bool | None = None) -> str:
    """The chat-template text that asks the model for the next assistant turn."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return _render(tokenizer, messages, True, kwargs)


def _turn_end(text: str, start: int, content_end: int, special_tokens: list[str]) -> int:
    """End of an assistant turn: just past the first special token that follows its content
    (after optional whitespace), else the content end."""
    rest = text[content_end:]
    stripped = len(rest) - len(rest.lstrip())
    for tok in special_tokens:
        if rest[stripped:].startswith(tok):
            return content_end + stripped + len(tok)
    return content_end


def assistant_char_spans(tokenizer, messages: list[dict[str, Any]], *,
                         last_turn_only: bool = False,
                         enable_thinking: bool | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation and return (text, [(start, end) char spans of assistant turns]).

    A turn starts where the template's generation prompt for it ends (so header glue such as an
    empty think block is excluded) and ends just after the end-of-turn token that follows the
    message content. Raises ValueError when the template does not render the conversation
    prefix-consistently or the conversation has no assistant turn.
    """
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = _render(tokenizer, messages, False, kwargs)
    specials = sorted(tokenizer.all_special_tokens, key=len, reverse=True)
    spans = []
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:k], True, kwargs)
        if not text.startswith(prompt):
            raise ValueError("chat template renders turn prefixes inconsistently (the generation "
                             f"prompt before assistant turn {k} is not a prefix of the full "
                             "text); this template is not supported for loss masking")
        content_at = text.find(msg["content"], len(prompt))
        if content_at < 0:
            raise ValueError(f"assistant turn {k}: content not found in the rendered text")
        content_end = content_at + len(msg["content"])
        spans.append((len(prompt), _turn_end(text, len(prompt), content_end, specials)))
    if not spans:
        raise ValueError("conversation has no assistant turn, so no token would get a loss; "
                         "drop such rows or add the target's answers")
    return text, spans[-1:] if last_turn_only else spans


def tokenize_conversation(tokenizer, messages: list[dict[str, Any]], *,
                          max_length: int | None = None, last_turn_only: bool = False,
                          enable_thinking: bool | None = None) -> TokenizedConversation:
    """Token ids and loss mask of one conversation (truncated to ``max_length`` tokens).

    A token is in the loss mask when its first character lies inside an assistant span.
    Needs a fast tokenizer (offset mapping).
    """
    text, spans = assistant_char_spans(tokenizer, messages, last_turn_only=last_turn_only,
                                       enable_thinking=enable_thinking)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = torch.tensor([s for s, _ in enc["offset_mapping"]], dtype=torch.long)
    mask = torch.zeros(len(starts), dtype=torch.bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenizedConversation(ids, mask)
