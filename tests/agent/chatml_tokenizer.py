"""A Qwen2.5-style tokenizer built in-process (no downloads): byte-level BPE with ChatML's
special tokens (<|endoftext|>, <|im_start|>, <|im_end|>), the tool tags as added tokens that are
NOT special (as Qwen2.5 has them: split_special_tokens does not split those), and a ChatML chat
template that renders `tools=` and tool messages the way Qwen2.5's does (consecutive tool results
in one user turn, each in <tool_response> tags). Written for these tests; the layout, not the
wording, follows Qwen's."""
from __future__ import annotations

from transformers import AddedToken

from tests.data.tiny_tokenizer import make_tiny_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'assistant') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TEXTS = ["The answer is 42 . Call the calculator with an expression like ( 3 + 4 ) * 2 .",
         "hello world tool call response error truncated tokens shown of",
         '{"name": "calculator", "arguments": {"expression": "1 + 2"}}']


def make_chatml_tokenizer():
    tok = make_tiny_tokenizer(texts=TEXTS, kind="bpe", vocab_size=600)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    return tok
