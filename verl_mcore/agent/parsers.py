"""Tool calls from the model's text.

A parser reads one assistant turn's text and returns a ParsedTurn: the calls, in order, and a
ParseError for each thing that looked like a call and was not one. The agent loop answers a
ParseError with an observation (ToolResult status "parse_error", from `parse_error_result`) and
counts it; it never stops the run.

Built in (PARSERS):
  hermes   Hermes / Qwen2.5 / Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
           several per turn; "arguments" an object, or a string holding one (some models
           write it so); no "arguments" is a call without any. Malformed JSON, a missing or
           non-string name, arguments that are not an object, an unclosed <tool_call> and a
           stray </tool_call> are ParseErrors.

A user's parser is a function in a file, named in the config (agent.parser: path, name,
kwargs): fn(text, **kwargs) -> a list of ToolCall and ParseError, or a ParsedTurn. It runs in
the trainer (user_code.UserFunction: what it raises stops the run, naming it).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from verl_mcore.agent.tools import ToolCall, ToolResult
from verl_mcore.user_code import UserFunction, load_user_function

_SHOWN = 200  # characters of a bad call quoted back to the model


@dataclass(frozen=True)
class ParseError:
    """Why `text` (what the model wrote, cut to _SHOWN characters) is not a call."""

    message: str
    text: str = ""


@dataclass
class ParsedTurn:
    """One turn's calls and parse errors, each in the order the model wrote them; `content` is
    the text outside any call."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    content: str = ""


def parse_error_result(error: ParseError) -> ToolResult:
    """The observation a parse error becomes."""
    quoted = f" in: {error.text}" if error.text else ""
    return ToolResult(f"Error: the tool call could not be parsed: {error.message}{quoted}",
                      "parse_error", tool="")


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> ParsedTurn:
    turn = ParsedTurn()
    outside, end = [], 0
    for m in _HERMES.finditer(text):
        outside.append(text[end:m.start()])
        end = m.end()
        if "<tool_call>" in m.group(1):  # an opening tag left open before this call
            turn.errors.append(ParseError("a <tool_call> is not closed by </tool_call> before "
                                          "the next one", _cut(m.group(0))))
            continue
        call = _hermes_call(m.group(1))
        (turn.calls if isinstance(call, ToolCall) else turn.errors).append(call)
    rest = text[end:]
    opened = rest.find("<tool_call>")
    if opened >= 0:
        turn.errors.append(ParseError("a <tool_call> is not closed by </tool_call>",
                                      _cut(rest[opened:])))
        rest = rest[:opened]
    for piece in outside + [rest]:
        if "</tool_call>" in piece:
            turn.errors.append(ParseError("a </tool_call> closes no <tool_call>",
                                          _cut(piece)))
    turn.content = "".join(outside + [rest]).strip()
    return turn


def _hermes_call(body: str):
    raw = f"<tool_call>{body}</tool_call>"
    try:
        data = json.loads(body)
    except ValueError as e:
        return ParseError(f"the call is not valid JSON ({e})", _cut(raw))
    if not isinstance(data, dict):
        return ParseError('the call must be a JSON object {"name": ..., "arguments": {...}}',
                          _cut(raw))
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ParseError('the call has no "name" (a string)', _cut(raw))
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            return ParseError(f'"arguments" is a string that is not valid JSON ({e})', _cut(raw))
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ParseError('"arguments" must be a JSON object', _cut(raw))
    return ToolCall(name, arguments, raw)


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


class _UserParser:
    """A user's parser, called as fn(text, **kwargs); its result made a ParsedTurn."""

    def __init__(self, fn: UserFunction):
        self.fn = fn

    def __call__(self, text: str) -> ParsedTurn:
        out = self.fn.call(text, doing_what="on a model turn", returns="return ParseErrors",
                           error=RuntimeError)
        if isinstance(out, ParsedTurn):
            return out
        if not isinstance(out, (list, tuple)):
            raise TypeError(f"{self.fn.label} returned {type(out).__name__}: a parser returns a "
                            "list of ToolCall and ParseError (verl_mcore.agent), or a ParsedTurn")
        turn = ParsedTurn(content=text)
        for i, item in enumerate(out):
            if isinstance(item, ToolCall):
                turn.calls.append(item)
            elif isinstance(item, ParseError):
                turn.errors.append(item)
            else:
                raise TypeError(f"{self.fn.label} returned a list whose item {i} is "
                                f"{_type(item)}, not a ToolCall or a ParseError")
        return turn


def _type(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.80}"


def load_parser(cfg, key: str) -> Callable[[str], ParsedTurn]:
    """The parser of a UserFunctionConfig at `key` (agent.parser): a built-in by name when it
    has no path, else the user's function, probed at start-up like every user function."""
    if not cfg.path:
        if cfg.name not in PARSERS:
            raise ValueError(f"{key}.name={cfg.name!r} is not a built-in parser "
                             f"({sorted(PARSERS)}); to use your own, give {key}.path too")
        if cfg.kwargs:
            raise ValueError(f"{key}.kwargs={dict(cfg.kwargs)}: the built-in parser "
                             f"{cfg.name!r} takes none")
        return PARSERS[cfg.name]
    found: Optional[tuple] = load_user_function(
        cfg, key, ("text",), "fn(text, **kwargs) -> list[ToolCall | ParseError]")
    fn, path = found
    return _UserParser(UserFunction(key, fn, cfg.kwargs, path, cfg.name))
