"""Chat template rendering and the assistant loss mask, in both conversation formats."""

from __future__ import annotations

import pytest
import torch

from dflash_lab.targets.chat import (
    BadConversation,
    assistant_char_spans,
    check_roles,
    find_turn_end,
    normalize_conversation,
    target_stop_ids,
    tokenize_conversation,
)
from tests.targets.chat_families import masked_runs

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "4 + 4 = 8."},
]
SHAREGPT = {"conversations": [
    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2 + 3?"},
    {"from": "gpt", "value": "2 + 3 = 5."}, {"from": "human", "value": "And 4 + 4?"},
    {"from": "gpt", "value": "4 + 4 = 8."},
]}


@pytest.fixture(scope="module")
def tok(tiny_target):
    return tiny_target.tokenizer




def test_multi_turn_mask_is_exactly_the_assistant_turns_with_end_of_turn(tok):
    tc = tokenize_conversation(tok, MESSAGES)
    assert masked_runs(tok, tc) == ["2 + 3 = 5.<|im_end|>", "4 + 4 = 8.<|im_end|>"]
    assert tok.decode(tc.input_ids) == tok.apply_chat_template(MESSAGES, tokenize=False)
    assert tc.input_ids.dtype == torch.long and tc.loss_mask.dtype == torch.bool


def test_tiny_target_turn_end_is_its_eos_and_in_the_mask(tiny_target, tok):
    turn_end = find_turn_end(tok, target_stop_ids(tiny_target))
    assert (turn_end.text, turn_end.token_id, turn_end.is_stop) == (
        "<|im_end|>", tok.eos_token_id, True)
    tc = tokenize_conversation(tok, MESSAGES, turn_end=turn_end)
    assert tc.input_ids[tc.loss_mask].tolist().count(tok.eos_token_id) == 2


def test_sharegpt_and_openai_formats_give_identical_samples(tok):
    msgs = normalize_conversation(SHAREGPT)
    assert msgs == MESSAGES
    a = tokenize_conversation(tok, normalize_conversation({"messages": MESSAGES}))
    b = tokenize_conversation(tok, msgs)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)


def test_last_turn_only(tok):
    tc = tokenize_conversation(tok, MESSAGES, last_turn_only=True)
    assert masked_runs(tok, tc) == ["4 + 4 = 8.<|im_end|>"]


def test_thinking_switch_adds_an_unmasked_empty_think_block(tok):
    on = tokenize_conversation(tok, MESSAGES, enable_thinking=True)
    off = tokenize_conversation(tok, MESSAGES, enable_thinking=False)
    assert "<think>" not in tok.decode(on.input_ids)
    assert tok.decode(off.input_ids).count("<think>\n\n</think>\n\n") == 2
    assert masked_runs(tok, off) == masked_runs(tok, on)  # glue stays outside the loss


def test_reasoning_content_is_part_of_the_assistant_turn(tok):
    msgs = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5.", "reasoning_content": "add them"}]
    tc = tokenize_conversation(tok, msgs)
    assert masked_runs(tok, tc) == ["<think>\nadd them\n</think>\n\n5.<|im_end|>"]


def test_truncation_keeps_mask_aligned(tok):
    full = tokenize_conversation(tok, MESSAGES)
    cut = tokenize_conversation(tok, MESSAGES, max_length=20)
    assert len(cut.input_ids) == 20
    assert torch.equal(cut.input_ids, full.input_ids[:20])
    assert torch.equal(cut.loss_mask, full.loss_mask[:20])


def test_spans_are_char_exact(tok):
    text, spans = assistant_char_spans(tok, MESSAGES)
    assert [text[a:b] for a, b in spans] == ["2 + 3 = 5.<|im_end|>", "4 + 4 = 8.<|im_end|>"]


@pytest.mark.parametrize("row, match", [
    ({"text": "hi"}, "expected 'messages'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "from"),
])
def test_bad_rows_are_refused(row, match):
    with pytest.raises(ValueError, match=match):
        normalize_conversation(row)


def test_conversation_without_assistant_turn_is_refused(tok):
    with pytest.raises(ValueError, match="no assistant turn"):
        tokenize_conversation(tok, [{"role": "user", "content": "hello"}])


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
      {"role": "assistant", "content": "c"}], "messages 0 and 1 are both 'user' turns"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "assistant", "content": "c"}], "messages 1 and 2 are both 'assistant'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "  \n"}],
     "message 1 \\(assistant\\) is empty"),
    ([{"role": "user", "content": ""}, {"role": "assistant", "content": "b"}],
     "message 0 \\(user\\) is empty"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}], "no assistant turn"),
])
def test_conversations_that_cannot_be_trained_on_are_bad(tok, messages, match):
    with pytest.raises(BadConversation, match=match):
        check_roles(messages)
    with pytest.raises(BadConversation, match=match):
        tokenize_conversation(tok, messages)


def test_an_empty_system_prompt_and_tool_turns_are_accepted():
    check_roles([{"role": "system", "content": ""}, {"role": "user", "content": "a"},
                 {"role": "assistant", "content": "b"}, {"role": "tool", "content": "r"},
                 {"role": "tool", "content": "s"}, {"role": "assistant", "content": "c"}])
    check_roles([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}],
                answers=False)  # regeneration rewrites the answers


@pytest.mark.parametrize(("tokenizer_eos", "config_eos", "want"), [
    (2, [7, 2], [2, 7]),  # a chat model's end-of-turn beside the tokenizer's EOS
    (5, [7, 3], [3, 5, 7]),  # the config's list omits the tokenizer's EOS: both still stop
    (4, 4, [4]),  # an int in the generation config
    (None, None, []),
])
def test_target_stop_ids_are_the_tokenizer_and_generation_config_eos(tokenizer_eos, config_eos,
                                                                      want):
    """The one stop-id rule capture, regeneration and both eval backends read."""
    from types import SimpleNamespace

    target = SimpleNamespace(
        tokenizer=SimpleNamespace(eos_token_id=tokenizer_eos),
        model=SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=config_eos)))
    assert target_stop_ids(target) == want

