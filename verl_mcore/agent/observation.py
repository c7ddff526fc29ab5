"""Observation tokens: what goes into a trajectory after the model's turn, as token ids.

Token in, token out: the model's own tokens stay as sampled; only the new turn is tokenized.
That turn's text is what the chat template renders for it, found as a difference of two
renderings of a placeholder conversation:

    A = render([system, user, assistant "<A>"])
    B = render([system, user, assistant "<A>", tool "<O0>", ..., tool "<Ok-1>"],
               add_generation_prompt=True)

B must start with A (the template only appends: "prefix-stable"; TemplateError otherwise). The
new turn is then what A renders after the assistant's content (its close, "<|im_end|>\\n") and
B[len(A):] (the tool turn's delimiters around each <Oi>, then the opener of the assistant turn
that follows, "<|im_start|>assistant\\n"), so the model goes on as the assistant. When the model's
turn already ended with the close's first token (its EOS, <|im_end|>), that token is not
repeated.

The template's delimiters are tokenized as template text (their special tokens are special
ids). An observation's text is tokenized as plain text: a tool that returns "<|im_end|>" or
"<tool_call>" must not end the turn or forge a call. split_special_tokens=True covers special
tokens; added tokens that are not "special" (Qwen's <tool_call>) are matched by the tokenizer
whatever that flag says, so each occurrence of an added token's text is cut after its first
character and the pieces tokenized apart (the text decodes the same). A leak of any such id
still raises.

`max_tokens` caps one observation turn (delimiters included): longer contents are cut, each
marked "[truncated: K of N tokens shown]", the room shared fairly among a turn's results.

Tools in the prompt (`render_prompt`; data/chat.py, which the dataset uses too): a template that
renders `tools=` (Qwen2.5, Llama 3.1) gets the schemas that way; one that ignores them (SmolLM2's
ChatML) gets them as text in the system message, with the <tool_call> format the built-in
hermes parser reads.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from verl_mcore.agent.tools import ToolResult
from verl_mcore.data.chat import prompt_messages, template_supports_tools, tools_system_prompt  # noqa: F401 - re-exported

_ASSISTANT = "AGENTASSISTANTPLACEHOLDER"
_PLACEHOLDER_HISTORY = [{"role": "system", "content": "AGENTSYSTEMPLACEHOLDER"},
                        {"role": "user", "content": "AGENTUSERPLACEHOLDER"},
                        {"role": "assistant", "content": _ASSISTANT}]


def _content(i: int) -> str:
    return f"AGENTOBSERVATIONPLACEHOLDER{i}END"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot give observation tokens (no template, not
    prefix-stable, a role it refuses, a cap smaller than its delimiters)."""


@dataclass(frozen=True)
class Observation:
    """One observation turn: `ids` to append after the model's turn; `truncated`: a content was
    cut to fit the cap; `content_tokens` the contents' tokens before any cut."""

    ids: list[int]
    truncated: bool = False
    content_tokens: int = 0


@dataclass(frozen=True)
class _Layout:
    close: list[int]  # what the template puts after the assistant's content
    between: list[list[int]]  # k + 1 delimiter pieces around the k contents


def _check_has_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template: "
                            "agent loops need one to delimit turns")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
           **kwargs: Any) -> str:
    """The chat template's text of `messages` (kwargs: tools=, enable_thinking=, ...)."""
    _check_has_template(tokenizer)
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


class ObservationTokens:
    """Token ids of tool / user turns for one tokenizer. `role`: the chat-template role of an
    observation ("tool", or "user" for a template without one); `max_tokens`: a turn's cap
    (None: none); `template_kwargs`: passed to every rendering (enable_thinking=False, ...);
    `key`: the config section named in errors."""

    def __init__(self, tokenizer, role: str = "tool", max_tokens: Optional[int] = None,
                 template_kwargs: Optional[dict] = None, key: str = "agent"):
        self.tokenizer, self.role, self.max_tokens = tokenizer, role, max_tokens
        self.template_kwargs, self.key = dict(template_kwargs or {}), key
        self._layouts: dict[int, _Layout] = {}
        # The added tokens whose text must not become their id inside an observation (a
        # one-character one is that character).
        added = {tok.content: i for i, tok in tokenizer.added_tokens_decoder.items()
                 if len(tok.content) >= 2}
        # (The unknown token is what a word-level vocabulary gives a word it lacks: no leak.)
        self._added_ids = (set(added.values()) | set(tokenizer.all_special_ids)) - {
            tokenizer.unk_token_id}
        self._added = re.compile("(?=(" + "|".join(
            re.escape(t) for t in sorted(added, key=len, reverse=True)) + "))") if added else None
        _check_has_template(tokenizer)  # before anything is tokenized
        # Room kept for one truncation mark: the longest numbers a mark will hold.
        self._mark_reserve = len(self.plain_ids(_mark(10 ** 7, 10 ** 7)))
        self._layout(1)  # a template that cannot do it fails now, not at the first tool call

    @classmethod
    def from_config(cls, tokenizer, cfg, key: str = "agent",
                    template_kwargs: Optional[dict] = None) -> "ObservationTokens":
        """For an AgentToolsConfig at `key`: its observation_role and max_observation_tokens."""
        return cls(tokenizer, cfg.observation_role, cfg.max_observation_tokens, template_kwargs,
                   key)

    # ------------------------------------------------------------------ public

    def turn(self, texts: Sequence[str], after_token: Optional[int] = None) -> Observation:
        """The ids of one observation turn holding `texts` (one message each, in order), then
        the assistant turn's opener. `after_token`: the last token of the model's turn (its EOS
        when it stopped there), so a close the model already wrote is not repeated."""
        if not texts:
            raise ValueError("an observation turn needs at least one text")
        layout = self._layout(len(texts))
        close = layout.close
        if close and after_token is not None and close[0] == after_token:
            close = close[1:]
        contents = [self.plain_ids(t) for t in texts]
        total = sum(len(c) for c in contents)
        fixed = len(close) + sum(len(p) for p in layout.between)
        truncated = False
        if self.max_tokens is not None and fixed + total > self.max_tokens:
            contents, truncated = self._cut(contents, self.max_tokens - fixed), True
        ids = list(close)
        for piece, content in zip(layout.between, contents):
            ids += piece + content
        ids += layout.between[-1]
        return Observation(ids, truncated, total)

    def tool_turn(self, results: Sequence[ToolResult],
                  after_token: Optional[int] = None) -> Observation:
        """`turn` of tool results' texts."""
        return self.turn([r.text for r in results], after_token)

    def plain_ids(self, text: str) -> list[int]:
        """`text` tokenized as plain text: no special or added token's id, whatever it holds."""
        ids: list[int] = []
        for piece in self._pieces(text):
            ids += self.tokenizer(piece, add_special_tokens=False,
                                  split_special_tokens=True)["input_ids"]
        leaked = sorted(set(ids) & self._added_ids)
        if leaked:
            raise TemplateError(f"tokenizing an observation as plain text still gave the special "
                                f"token ids {leaked} ({self.tokenizer.convert_ids_to_tokens(leaked)}"
                                f"): this tokenizer cannot keep them out")
        return ids

    # ------------------------------------------------------------------ inside

    def _pieces(self, text: str) -> list[str]:
        """`text` cut one character into each occurrence of an added token's text."""
        if self._added is None:
            return [text]
        cuts = sorted({m.start() + 1 for m in self._added.finditer(text)})
        bounds = [0] + cuts + [len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]

    def _template_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _layout(self, k: int) -> _Layout:
        if k in self._layouts:
            return self._layouts[k]
        where = f"{self.key}.observation_role={self.role!r}"
        turn = [{"role": self.role, "content": _content(i)} for i in range(k)]
        # Without the system message for a template that has no system role (Gemma's): the
        # new turn's delimiters do not depend on it.
        for history in (_PLACEHOLDER_HISTORY, _PLACEHOLDER_HISTORY[1:]):
            try:
                a = render(self.tokenizer, history, **self.template_kwargs)
                b = render(self.tokenizer, history + turn, add_generation_prompt=True,
                           **self.template_kwargs)
                break
            except TemplateError:
                raise
            except Exception as e:  # jinja's raise_exception, an unknown role
                refused = e
        else:
            raise TemplateError(f"{where}: the chat template refuses a {self.role!r} message "
                                f"after an assistant message ({type(refused).__name__}: "
                                f"{refused}); try "
                                "the other observation_role") from None
        if a.count(_ASSISTANT) != 1:
            raise TemplateError(f"{where}: the chat template does not render an assistant "
                                "message's content as it is, so the end of the model's turn "
                                "cannot be found")
        if not b.startswith(a):
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise TemplateError(
                f"{where}: the chat template is not prefix-stable: adding a {self.role!r} "
                f"message changes what it renders before it (at character {i}: "
                f"{a[i:i + 40]!r} became {b[i:i + 40]!r}), so the new turn's tokens are not an "
                "addition to the trajectory's; use a template (or an observation_role) that "
                "only appends")
        delta = b[len(a):]
        between, start = [], 0
        for i in range(k):
            at = delta.find(_content(i), start)
            if at < 0 or delta.count(_content(i)) != 1:
                raise TemplateError(f"{where}: the chat template does not render a "
                                    f"{self.role!r} message's content once and as it is")
            between.append(self._template_ids(delta[start:at]))
            start = at + len(_content(i))
        between.append(self._template_ids(delta[start:]))
        close = self._template_ids(a[a.index(_ASSISTANT) + len(_ASSISTANT):])
        layout = _Layout(close, between)
        fixed = len(close) + sum(len(p) for p in between)
        if self.max_tokens is not None and self.max_tokens < fixed + k * (self._mark_reserve + 1):
            raise TemplateError(f"{self.key}.max_observation_tokens={self.max_tokens}: a turn of "
                                f"{k} observation(s) takes {fixed} tokens of delimiters alone; "
                                "give it room for the contents and their truncation marks")
        self._layouts[k] = layout
        return layout

    def _cut(self, contents: list[list[int]], budget: int) -> list[list[int]]:
        """`contents` cut to `budget` tokens in all, marks included: each gets an equal share,
        and what a short one does not use goes to the others."""
        room = budget - self._mark_reserve * len(contents)
        shares = [0] * len(contents)
        order = sorted(range(len(contents)), key=lambda i: len(contents[i]))
        for n, i in enumerate(order):
            shares[i] = min(len(contents[i]), max(0, room) // (len(order) - n))
            room -= shares[i]
        out = []
        for content, share in zip(contents, shares):
            if share >= len(content):
                out.append(content)
                continue
            mark = self.plain_ids(_mark(share, len(content)))
            kept = max(0, share - max(0, len(mark) - self._mark_reserve))
            if kept != share:  # a mark longer than reserved takes its room from the content
                mark = self.plain_ids(_mark(kept, len(content)))
            out.append(content[:kept] + mark)
        return out


def _mark(kept: int, total: int) -> str:
    return f"\n[truncated: {kept} of {total} tokens shown]"


def render_prompt(tokenizer, messages: list[dict], schemas: Sequence[dict] = (),
                  **template_kwargs: Any) -> list[int]:
    """The prompt's token ids: `messages` with the tools' schemas (prompt_messages) and the
    assistant turn's opener."""
    messages, extra = prompt_messages(tokenizer, messages, schemas, **template_kwargs)
    text = render(tokenizer, messages, add_generation_prompt=True, **template_kwargs, **extra)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
