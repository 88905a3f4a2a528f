"""Loss masks from the chat template for real model families (tokenizers built locally).

The end-of-turn token must be in the mask (the target generates it, so the drafter must learn
to draft it) for Gemma 3, Qwen3, Llama 3 and ChatML (SmolLM2), whether or not the tokenizer
lists it in ``all_special_tokens``; user/system text and role headers never are.
"""

from __future__ import annotations

import logging

import pytest

from dflash_lab.targets.chat import (
    BadConversation,
    TurnEnd,
    find_turn_end,
    tokenize_conversation,
)
from tests.targets.chat_families import FAMILIES, build_tokenizer, generation_stop_ids, masked_runs

SYSTEM, USER1, USER2 = "Be brief.", "What is two plus three?", "And four plus four?"
BOT1, BOT2 = "Two plus three is five.", "Four plus four is eight."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1},
            {"role": "assistant", "content": BOT1}, {"role": "user", "content": USER2},
            {"role": "assistant", "content": BOT2}]
#: Qwen3 writes an (empty) think block into the last assistant turn, after its header.
LAST_TURN_GLUE = {"qwen3": "<think>\n\n</think>\n\n"}
CASES = [(name, special) for name in FAMILIES for special in (False, True)]




@pytest.mark.parametrize("name, special", CASES)
def test_end_of_turn_is_in_the_mask_and_headers_and_prompts_are_not(name, special):
    family = FAMILIES[name]
    tok = build_tokenizer(family, special=special)
    turn_end = find_turn_end(tok, generation_stop_ids(family, tok))
    tc = tokenize_conversation(tok, MESSAGES, turn_end=turn_end)
    eot = tok.convert_tokens_to_ids(family.end_of_turn)
    assert turn_end == TurnEnd(family.end_of_turn, eot, True)
    glue = LAST_TURN_GLUE.get(name, "")
    assert masked_runs(tok, tc) == [BOT1 + family.end_of_turn,
                                     glue + BOT2 + family.end_of_turn]
    masked = tc.input_ids[tc.loss_mask].tolist()
    assert masked.count(eot) == 2
    for header in family.headers:
        hid = tok.convert_tokens_to_ids(header)
        assert hid in tc.input_ids.tolist() and hid not in masked
    masked_text = "".join(masked_runs(tok, tc))
    assert not any(text in masked_text for text in (SYSTEM, USER1, USER2))


@pytest.mark.parametrize("name", ["gemma3", "llama3"])
def test_turn_end_found_without_the_generation_config_warns_it_is_no_stop(name, caplog):
    family = FAMILIES[name]
    tok = build_tokenizer(family)
    with caplog.at_level(logging.WARNING, logger="dflash_lab.targets.chat"):
        turn_end = find_turn_end(tok)  # tokenizer EOS only: <eos> / <|end_of_text|>
    assert turn_end.text == family.end_of_turn and not turn_end.is_stop
    assert "not among the target's stop ids" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_lab.targets.chat"):
        assert find_turn_end(tok, generation_stop_ids(family, tok)).is_stop
    assert caplog.text == ""


def test_template_without_an_end_of_turn_token_masks_to_the_content_and_warns(caplog):
    tok = build_tokenizer(FAMILIES["chatml_smollm2"])
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] + '\\n\\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}")
    with caplog.at_level(logging.WARNING, logger="dflash_lab.targets.chat"):
        turn_end = find_turn_end(tok)
    assert turn_end == TurnEnd("", None, False)
    assert "writes no end-of-turn token" in caplog.text
    tc = tokenize_conversation(tok, MESSAGES[1:3], turn_end=turn_end)
    assert masked_runs(tok, tc) == [BOT1]


def test_trimmed_contents_still_end_with_the_turn_token():
    family = FAMILIES["gemma3"]
    tok = build_tokenizer(family)
    msgs = [{"role": "user", "content": USER1}, {"role": "assistant", "content": f" {BOT1}\n"}]
    tc = tokenize_conversation(tok, msgs, turn_end=find_turn_end(tok))
    assert masked_runs(tok, tc) == [BOT1 + "<end_of_turn>"]


def test_gemma_alternation_errors_are_bad_conversations():
    tok = build_tokenizer(FAMILIES["gemma3"])
    two_users = [{"role": "user", "content": USER1}, {"role": "user", "content": USER2},
                 {"role": "assistant", "content": BOT1}]
    with pytest.raises(BadConversation, match="messages 0 and 1 are both 'user' turns"):
        tokenize_conversation(tok, two_users)
    # Roles our check accepts but Gemma's template refuses: its jinja error becomes a bad row.
    answer_first = [{"role": "assistant", "content": BOT1}, {"role": "user", "content": USER1},
                    {"role": "assistant", "content": BOT2}]
    with pytest.raises(BadConversation, match="chat template error: .*roles must alternate"):
        tokenize_conversation(tok, answer_first)
