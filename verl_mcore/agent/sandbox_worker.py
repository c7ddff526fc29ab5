"""A sandbox worker's side: `serve(conn, init)`, started by sandbox.py through
distributed/worker_process.py (a fresh interpreter, the memory cap, signals, death with the
parent). Its stdout and stderr are /dev/null: what a tool prints through Python is captured per
call (up to max_output_chars), what native code or a child process writes there is dropped.

Protocol (pickled messages over the socket):
  parent -> (tools: [ToolSpec], environment: EnvSpec | None, max_output_chars, max_memory_mb)
  worker -> ("ready", None) | ("init_error", traceback)
  parent -> ("call", name, arguments)   worker -> ("ok", text) | ("error", message, traceback)
  parent -> ("reset", session, row)     worker -> ("ok", observation) | ("failure", message)
  parent -> ("step", session, action)   worker -> ("ok", (observation, reward, done))
                                                | ("error", message, traceback) | ("failure", message)
  parent -> ("close", session)          worker -> ("ok", None)
  parent -> None                        the worker exits
One request at a time; "failure" is a broken environment contract (environment.py).
"""
from __future__ import annotations

import contextlib
import io
import json
import traceback
from multiprocessing.connection import Connection
from typing import Any, Optional

from verl_mcore.agent.environment import EnvironmentFailure, checked_observation, checked_step
from verl_mcore.distributed.worker_process import requests


class _CappedText(io.TextIOBase):
    """A text stream that keeps the first `cap` characters written and counts the rest."""

    def __init__(self, cap: int):
        self.cap, self.parts, self.kept, self.total = cap, [], 0, 0

    def write(self, text: str) -> int:
        self.total += len(text)
        room = self.cap - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        return len(text)

    def value(self) -> tuple[str, int]:
        return "".join(self.parts), self.total


def capped(text: str, total: int, cap: int) -> str:
    """`text` (the first characters of `total`) cut to `cap`, saying so when anything is cut."""
    if total <= cap and len(text) <= cap:
        return text
    return text[:cap] + f"\n[output truncated: {min(cap, len(text))} of {total} characters shown]"


def as_text(value: Any, printed: str, printed_total: int, cap: int) -> str:
    """What the model reads of a tool's return value: a str as is, a dict or list as JSON,
    None as what the tool printed, anything else as str(); cut at `cap` characters."""
    if value is None:
        return capped(printed, printed_total, cap)
    if isinstance(value, str):
        text = value
    elif isinstance(value, (dict, list)):
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    else:
        text = str(value)
    return capped(text, len(text), cap)


def _error(e: BaseException, what: str, max_memory_mb: Optional[int]) -> tuple[str, str, str]:
    """("error", a one-line message for the model, the traceback for the logs)."""
    if isinstance(e, MemoryError):
        cap = f" (over the sandbox's max_memory_mb={max_memory_mb})" if max_memory_mb else ""
        message = f"{what} ran out of memory{cap}"
    elif isinstance(e, SystemExit):
        message = f"{what} called sys.exit({e.code!r})"
    else:
        message = f"{what} raised {type(e).__name__}: {e}"
    return "error", message, traceback.format_exc()


def serve(conn: Connection, init: tuple) -> None:
    try:
        tool_specs, env_spec, max_output_chars, max_memory_mb = init
        tools = {spec.name: spec.load() for spec in tool_specs}
        env_class = env_spec.load() if env_spec is not None else None
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    envs: dict[Any, Any] = {}  # session -> its environment instance
    for message in requests(conn):
        kind, *args = message
        if kind == "call":
            reply = _call(tools, *args, max_output_chars, max_memory_mb)
        else:
            reply = _env(kind, envs, env_class, env_spec, *args, max_output_chars, max_memory_mb)
        conn.send(reply)


def _call(tools: dict, name: str, arguments: dict, cap: int, max_memory_mb: Optional[int]):
    out = _CappedText(cap)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            value = tools[name](**arguments)
        return "ok", as_text(value, *out.value(), cap)
    except BaseException as e:  # noqa: BLE001 - SystemExit and MemoryError are results here too
        return _error(e, name, max_memory_mb)


def _env(kind: str, envs: dict, env_class, spec, session, payload, cap: int,
         max_memory_mb: Optional[int]):
    if kind == "close":
        env = envs.pop(session, None)
        if env is not None and callable(getattr(env, "close", None)):
            with contextlib.suppress(Exception):
                env.close()
        return "ok", None
    out = _CappedText(cap)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if kind == "reset":
                envs[session] = env = env_class(**spec.kwargs)
                observation = checked_observation(env.reset(payload), spec.label, "reset")
                return "ok", capped(observation, len(observation), cap)
            observation, reward, done = checked_step(envs[session].step(payload), spec.label)
            return "ok", (capped(observation, len(observation), cap), reward, done)
    except EnvironmentFailure as e:
        return "failure", str(e)
    except BaseException as e:  # noqa: BLE001
        if kind == "reset":
            return "failure", f"{spec.label}: reset raised {type(e).__name__}: {e}\n" + \
                traceback.format_exc()
        return _error(e, f"the environment ({spec.attr}.step)", max_memory_mb)
