"""Tokenizers of real model families, built locally (no hub) for the loss-mask tests.

Each family is its chat template text as the model ships it, its named special tokens and the
turn tokens it adds to the vocabulary, on a tiny byte-level BPE. The turn tokens are added as
transformers 5 loads them: present in ``added_tokens_decoder`` but (unless ``special=True``)
not in ``all_special_tokens``, the case that hid Gemma's ``<end_of_turn>`` from the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n"
)

QWEN3_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n"
    "<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- set tool_start = \"<tool_response>\" %}\n"
    "    {%- set tool_start_length = tool_start|length %}\n"
    "    {%- set start_of_message = message.content[:tool_start_length] %}\n"
    "    {%- set tool_end = \"</tool_response>\" %}\n"
    "    {%- set tool_end_length = tool_end|length %}\n"
    "    {%- set start_pos = (message.content|length) - tool_end_length %}\n"
    "    {%- if start_pos < 0 %}\n        {%- set start_pos = 0 %}\n    {%- endif %}\n"
    "    {%- set end_of_message = message.content[start_pos:] %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and not(start_of_message == "
    "tool_start and end_of_message == tool_end) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "\n    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set content = message.content %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is defined and message.reasoning_content is not "
    "none %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n            {%- if '</think>' in message.content %}\n"
    "                {%- set content = (message.content.split('</think>')|last).lstrip('\\n') %}"
    "\n        {%- set reasoning_content = (message.content.split('</think>')|first)"
    ".rstrip('\\n') %}\n"
    "        {%- set reasoning_content = (reasoning_content.split('<think>')|last).lstrip('\\n')"
    " %}\n            {%- endif %}\n        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

#: SmolLM2-Instruct's ChatML template (a default system prompt when none is given).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """A model family's chat format: template, named special tokens (``bos``/``eos``/...),
    the turn tokens it adds, its end-of-turn token, its role-header tokens and the stop ids
    its generation config lists (as token strings)."""

    name: str
    template: str
    named: dict[str, str]
    added: tuple[str, ...]
    end_of_turn: str
    headers: tuple[str, ...]
    generation_eos: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)


FAMILIES = {
    "gemma3": Family("gemma3", GEMMA3_TEMPLATE,
                     {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                      "unk_token": "<unk>"},
                     ("<start_of_turn>", "<end_of_turn>", "<mask>"), "<end_of_turn>",
                     ("<start_of_turn>",), ("<eos>", "<end_of_turn>")),
    "qwen3": Family("qwen3", QWEN3_TEMPLATE,
                    {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                    ("<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>"),
                    "<|im_end|>", ("<|im_start|>",), ("<|im_end|>", "<|endoftext|>")),
    # Llama 3 base settings: the tokenizer's EOS is <|end_of_text|>; only the generation config
    # knows that <|eot_id|> ends an instruct turn.
    "llama3": Family("llama3", LLAMA3_TEMPLATE,
                     {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
                     ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>",
                     ("<|start_header_id|>", "<|end_header_id|>"),
                     ("<|end_of_text|>", "<|eot_id|>")),
    "chatml_smollm2": Family("chatml_smollm2", CHATML_TEMPLATE,
                             {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                              "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"},
                             (), "<|im_end|>", ("<|im_start|>",), ("<|im_end|>",)),
}

_CORPUS = ("What is two plus three? Two plus three is five. Be brief and exact. And four plus "
           "four? Four plus four is eight. system user assistant model")


def build_tokenizer(family: Family, special: bool = False):
    """A fast tokenizer with the family's chat template on a tiny byte-level BPE (vocab < 400).

    The named special tokens are trained in as specials; the family's turn tokens are added
    afterwards, ``special`` as transformers 5 marks them (False: added but not special).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    named = list(dict.fromkeys(family.named.values()))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_CORPUS], trainer=trainers.BpeTrainer(
        vocab_size=360, special_tokens=named, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **family.named)
    hf.add_tokens([AddedToken(t, special=special, normalized=False) for t in family.added])
    hf.chat_template = family.template
    return hf


def generation_stop_ids(family: Family, tokenizer) -> list[int]:
    """The ids the family's generation_config.json lists as ``eos_token_id``."""
    return [tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos]


def masked_runs(tok, tc) -> list[str]:
    """Decoded text of each contiguous run of loss-masked tokens of a TokenizedConversation."""
    runs, cur = [], []
    for tid, m in zip(tc.input_ids.tolist(), tc.loss_mask.tolist()):
        if m:
            cur.append(tid)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])
