"""Tools in a prompt: how a chat template is shown the tools a model may call (data.tools).

A template that renders `tools=` (Qwen2.5, Llama 3.1) gets the OpenAI-style schemas that way; one
that ignores them (SmolLM2's ChatML) gets them as text in the system message, in the
<tool_call>{"name", "arguments"}</tool_call> format the built-in hermes parser reads
(agent/parsers.py). The dataset renders its prompts through `prompt_messages`, and the agent
loops' observation tokens (agent/observation.py) use the same rule.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

_PROBE_TOOL = {"type": "function", "function": {
    "name": "agent_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}, "required": []}}}


def template_supports_tools(tokenizer, **template_kwargs: Any) -> bool:
    """Whether the chat template renders `tools=` (a probe schema's name shows up)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template: "
                         "tools in the prompt need one")
    messages = [{"role": "user", "content": "x"}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, tools=[_PROBE_TOOL],
                                             **template_kwargs)
    except Exception:  # a template that raises on tools has no tool support
        return False
    return _PROBE_TOOL["function"]["name"] in text


def template_supports_system(tokenizer, **template_kwargs: Any) -> bool:
    """Whether the chat template accepts a system message (Gemma's raises on one)."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    try:
        tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    except Exception:  # jinja's raise_exception: no system role
        return False
    return True


def tools_system_prompt(schemas: Sequence[dict]) -> str:
    """The tools described as text, in the format the hermes parser reads, for templates
    without tool support."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("You can call tools. Each tool is described by one JSON line between <tools> and "
            f"</tools>:\n<tools>\n{listed}\n</tools>\n\n"
            "To call a tool, write its name and arguments as one JSON object between <tool_call> "
            "and </tool_call>, for example:\n<tool_call>\n"
            '{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
            "You may make several calls in one turn. Each result comes back in the next turn.")


class ToolPrompt:
    """`schemas` shown in prompts of one tokenizer's template (whether it renders `tools=` is
    found once, not per prompt)."""

    def __init__(self, tokenizer, schemas: Sequence[dict], **template_kwargs: Any):
        self.schemas = list(schemas)
        self.native = bool(self.schemas) and template_supports_tools(tokenizer, **template_kwargs)
        self.text = tools_system_prompt(self.schemas) if self.schemas and not self.native else ""
        # Where the description goes: the system message, or the first user message of a
        # template that refuses a system one.
        self.system = bool(self.text) and template_supports_system(tokenizer, **template_kwargs)

    def messages(self, messages: list[dict]) -> tuple[list[dict], dict]:
        """(messages, extra apply_chat_template kwargs) that put the schemas in the prompt:
        `tools=` when the template renders them, else the tools' description appended to the
        system message (one is inserted first when there is none), or put before the first
        user message's text when the template has no system role."""
        if not self.schemas:
            return list(messages), {}
        if self.native:
            return list(messages), {"tools": self.schemas}
        if not self.system:
            at = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
            if at is None:
                raise ValueError("data.tools: the chat template has no system role and the "
                                 "prompt has no user message to describe the tools in")
            first = dict(messages[at], content=f"{self.text}\n\n{messages[at]['content']}")
            return list(messages[:at]) + [first] + list(messages[at + 1:]), {}
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0], content=f"{messages[0]['content']}\n\n{self.text}")
            return [first] + list(messages[1:]), {}
        return [{"role": "system", "content": self.text}] + list(messages), {}


def prompt_messages(tokenizer, messages: list[dict], schemas: Sequence[dict],
                    **template_kwargs: Any) -> tuple[list[dict], dict]:
    """ToolPrompt(tokenizer, schemas).messages(messages), for one prompt."""
    return ToolPrompt(tokenizer, schemas, **template_kwargs).messages(messages)
