"""Tools and environments run in sandbox worker processes, called from the agent loop's asyncio
event loop.

Isolation is the scoring workers' (distributed/worker_process.py): fresh interpreters that load
the users' files themselves, an address-space cap (RLIMIT_AS, sandbox.max_memory_mb), no state
shared with the trainer, death with the trainer. On top of it:

- a call still running after sandbox.timeout_s is a "timeout": its worker is killed and a new
  one started in its place; a worker that dies (a segfault, os._exit, the memory cap's kill) is
  an "error" naming how it died, and is replaced too. A tool that raises is an "error" with the
  exception's line; its worker lives on. None of these stops the run.
- an unknown tool name or arguments that do not fit the schema are refused here, before any
  worker is asked ("unknown_tool", "bad_arguments").
- a result longer than sandbox.max_output_chars is cut in the worker and says so; Python output
  a tool prints is captured the same way (sandbox_worker.py), and nothing reaches the log.

Concurrency: each worker runs one request at a time; up to sandbox.num_workers calls run at
once, the rest wait for a free worker. The workers are driven from a private event loop in a
thread of its own, so `await sandbox.call(c)` works from any event loop (the agent runtime's)
and never blocks it, and `call_sync` from plain code.

Environments: `session()` gives a trajectory its environment instance, which lives in one worker
(its state stays there between steps). A worker holds the sessions of several trajectories; when
it is replaced after a timeout or a crash, the state of its other sessions is lost too, and their
next step ends them with an observation saying so (EnvStep status "error", done).
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from verl_mcore.agent.environment import EnvironmentFailure, EnvSpec, EnvStep, load_environment
from verl_mcore.agent.tools import ToolCall, ToolResult, ToolSpec, check_arguments, load_tools
from verl_mcore.distributed.worker_process import WorkerProcess
from verl_mcore.errors import ConfigError
from verl_mcore.user_code import UserCodeError, exit_description

_ENTRY = "verl_mcore.agent.sandbox_worker:serve"


class SandboxError(RuntimeError):
    """The sandbox cannot run anything: every worker failed to start again after a
    replacement, or it is closed."""


@dataclass
class _Slot:
    """One worker process and what the sandbox knows of it."""

    index: int
    worker: Optional[WorkerProcess] = None
    busy: bool = True  # starting, or running a request
    generation: int = 0  # +1 at each replacement: its sessions' state is gone
    sessions: int = 0  # live sessions pinned to it
    broken: Optional[str] = None  # a replacement could not start: why
    restarting: Optional[asyncio.Task] = field(default=None, repr=False)


class _Timeout(Exception):
    pass


class _Died(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class ToolSandbox:
    """Worker processes that run `tools` (ToolSpecs, tools.load_tools) and `environment` (an
    EnvSpec or None). `key` names the config section in messages ("agent.sandbox")."""

    def __init__(self, tools: list[ToolSpec], environment: Optional[EnvSpec] = None, *,
                 num_workers: int = 4, timeout_s: float = 30.0,
                 max_memory_mb: Optional[int] = 4096, max_output_chars: int = 16384,
                 startup_timeout_s: float = 120.0, key: str = "agent.sandbox"):
        for name, value in (("num_workers", num_workers), ("timeout_s", timeout_s),
                            ("max_output_chars", max_output_chars),
                            ("startup_timeout_s", startup_timeout_s)):
            if value <= 0:
                raise ConfigError(f"{key}.{name}={value}: must be positive")
        self.tools = {t.name: t for t in tools}
        self.environment = environment
        self.timeout_s, self.startup_timeout_s, self.key = timeout_s, startup_timeout_s, key
        self.max_memory_mb = max_memory_mb
        self.restarts = 0  # workers replaced after a timeout or a crash, over the sandbox's life
        self._init = (list(tools), environment, max_output_chars, max_memory_mb)
        self._sessions = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-sandbox",
                                        daemon=True)
        self._thread.start()
        self._slots = [_Slot(i) for i in range(num_workers)]
        self._closed = self._closing = False
        try:
            self._run(self._start_all())
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, cfg, key: str = "agent") -> Optional["ToolSandbox"]:
        """The sandbox of an AgentToolsConfig at `key`, its tools' and environment's files probed
        first (tools.load_tools, environment.load_environment); None when it names neither."""
        tools = load_tools(cfg.tools, f"{key}.tools")
        environment = load_environment(cfg.environment, f"{key}.environment")
        if not tools and environment is None:
            return None
        s = cfg.sandbox
        return cls(tools, environment, num_workers=s.num_workers, timeout_s=s.timeout_s,
                   max_memory_mb=s.max_memory_mb, max_output_chars=s.max_output_chars,
                   startup_timeout_s=s.startup_timeout_s, key=f"{key}.sandbox")

    @property
    def schemas(self) -> list[dict]:
        """The tools' OpenAI-style schemas, for the chat template (observation.py)."""
        return [t.schema for t in self.tools.values()]

    # ------------------------------------------------------------------ tool calls

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one tool call; never raises for what the tool or the model did."""
        refused = self._refused(call)
        if refused is not None:
            return refused
        return await asyncio.wrap_future(self._submit(self._call(call)))

    async def call_all(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Several calls (one turn's), concurrently, results in the calls' order."""
        return list(await asyncio.gather(*(self.call(c) for c in calls)))

    def call_sync(self, call: ToolCall) -> ToolResult:
        """`call` for code without an event loop."""
        refused = self._refused(call)
        return refused if refused is not None else self._submit(self._call(call)).result()

    def _refused(self, call: ToolCall) -> Optional[ToolResult]:
        spec = self.tools.get(call.name)
        if spec is None:
            names = ", ".join(self.tools) or "none"
            return ToolResult(f"Error: there is no tool named {call.name!r}; the tools are: "
                              f"{names}.", "unknown_tool", tool=call.name)
        problem = check_arguments(spec.schema, call.arguments)
        if problem is not None:
            return ToolResult(f"Error: bad arguments for {call.name}: {problem}.",
                              "bad_arguments", tool=call.name)
        return None

    async def _call(self, call: ToolCall) -> ToolResult:
        t0 = time.monotonic()
        slot = await self._acquire()
        try:
            reply = await self._request(slot, ("call", call.name, call.arguments))
        except _Timeout:
            return ToolResult(f"Error: {call.name} did not finish within {self.timeout_s:g} s "
                              "and was stopped.", "timeout", time.monotonic() - t0, call.name)
        except _Died as e:
            how = exit_description(e.code)
            return ToolResult(f"Error: the tool {call.name} crashed ({how}).", "error",
                              time.monotonic() - t0, call.name,
                              detail=f"{self.tools[call.name].label}: its worker died: {how}")
        seconds = time.monotonic() - t0
        if reply[0] == "ok":
            return ToolResult(reply[1], "ok", seconds, call.name)
        return ToolResult(f"Error: {reply[1]}", "error", seconds, call.name, detail=reply[2])

    # ------------------------------------------------------------------ environments

    def session(self) -> "EnvSession":
        """A trajectory's environment: `await s.reset(row)`, then `await s.step(text)` until
        done, then `await s.close()` (or `async with sandbox.session() as s`)."""
        if self.environment is None:
            raise ConfigError(f"{self.key.rsplit('.', 1)[0]}.environment: no environment is "
                              "configured (give its path and name)")
        return EnvSession(self, next(self._sessions))

    async def _env_request(self, session: "EnvSession", message: tuple, slot: _Slot) -> Any:
        """The reply of `session`'s worker (`slot`) to `message`, or "lost" when that worker was
        replaced since the session began, "timeout", or ("died", exit code)."""
        if slot.broken is not None or slot.generation != session.generation:
            return "lost"
        slot = await self._acquire(slot)
        if slot.generation != session.generation:  # replaced while this waited for it
            await self._release(slot)
            return "lost"
        try:
            return await self._request(slot, message)
        except _Timeout:
            return "timeout"
        except _Died as e:
            return ("died", e.code)

    # ------------------------------------------------------------------ workers

    def _submit(self, coro):
        if self._closed:
            coro.close()
            raise SandboxError(f"{self.key}: the sandbox is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro) -> Any:
        return self._submit(coro).result()

    async def _start_all(self) -> None:
        self._cond = asyncio.Condition()
        await asyncio.gather(*(self._start(s) for s in self._slots))

    def _files(self) -> str:
        files = [t.label for t in self.tools.values()]
        if self.environment is not None:
            files.append(self.environment.label)
        return ", ".join(files)

    async def _start(self, slot: _Slot) -> None:
        slot.worker = WorkerProcess(_ENTRY, self._init, self.max_memory_mb, quiet=True)
        try:
            tag, payload = await self._receive(slot.worker, self.startup_timeout_s)
        except _Timeout:
            raise UserCodeError(f"a sandbox worker did not load {self._files()} within "
                                f"{self.startup_timeout_s:g} s ({self.key}.startup_timeout_s): "
                                "does importing them block?") from None
        except _Died as e:
            cap = f", under {self.key}.max_memory_mb={self.max_memory_mb}" if self.max_memory_mb else ""
            raise UserCodeError(f"a sandbox worker ended while loading {self._files()}: "
                                f"{exit_description(e.code)}{cap}") from None
        if tag == "init_error":
            raise UserCodeError(f"{payload.rstrip()}\na sandbox worker could not load "
                                f"{self._files()}: {payload.strip().splitlines()[-1]}")
        await self._release(slot)

    async def _receive(self, worker: WorkerProcess, timeout_s: float) -> Any:
        """The worker's next message within `timeout_s`; _Timeout, or _Died with its exit code."""
        fd = worker.conn.fileno()
        readable = self._loop.create_future()
        self._loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout_s)
        except asyncio.TimeoutError:
            raise _Timeout() from None
        finally:
            self._loop.remove_reader(fd)
        try:
            return worker.conn.recv()
        except (EOFError, OSError):
            raise _Died(worker.proc.wait()) from None

    async def _request(self, slot: _Slot, message: tuple) -> tuple:
        """Send `message` to the acquired `slot`'s worker and return its reply, releasing the
        slot; past the timeout or at the worker's death the slot is replaced (and stays busy
        until its new worker is ready)."""
        try:
            try:
                slot.worker.conn.send(message)
            except OSError:
                raise _Died(slot.worker.proc.wait()) from None
            reply = await self._receive(slot.worker, self.timeout_s)
        except BaseException:  # a timeout, a death, or the caller cancelled mid-request: the
            self._replace(slot)  # worker is gone or in an unknown state
            raise
        await self._release(slot)
        return reply

    def _replace(self, slot: _Slot) -> None:
        slot.worker.kill()
        slot.generation += 1
        slot.sessions = 0
        if not self._closing:
            self.restarts += 1
            slot.restarting = self._loop.create_task(self._restart(slot))

    async def _restart(self, slot: _Slot) -> None:
        try:
            await self._start(slot)
        except UserCodeError as e:  # it loaded before: something outside changed (a file, memory)
            slot.broken = str(e)
            async with self._cond:
                self._cond.notify_all()

    async def _acquire(self, slot: Optional[_Slot] = None) -> _Slot:
        """A free worker: `slot` (a session's) when given, else the free one with the fewest
        sessions."""
        async with self._cond:
            while True:
                if slot is not None:
                    if slot.broken is not None:
                        raise SandboxError(f"{self.key}: a sandbox worker could not be started "
                                           f"again: {slot.broken}")
                    if not slot.busy:
                        break
                else:
                    free = [s for s in self._slots if not s.busy and s.broken is None]
                    if free:
                        slot = min(free, key=lambda s: s.sessions)
                        break
                    if all(s.broken is not None for s in self._slots):
                        raise SandboxError(f"{self.key}: no sandbox worker could be started "
                                           f"again: {self._slots[0].broken}")
                await self._cond.wait()
            slot.busy = True
            return slot

    async def _release(self, slot: _Slot) -> None:
        async with self._cond:
            slot.busy = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the workers and the sandbox's thread (idempotent)."""
        if self._closed:
            return
        self._closing = True

        async def stop() -> None:
            # Calls still waiting (for a worker, or on one) are cancelled: their callers get
            # CancelledError rather than waiting forever.
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.sleep(0)
            for slot in self._slots:
                if slot.worker is not None:
                    slot.worker.stop(timeout_s=0.5 if slot.busy else 2.0)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> "ToolSandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class EnvSession:
    """One trajectory's environment instance in a sandbox worker (ToolSandbox.session)."""

    def __init__(self, sandbox: ToolSandbox, session_id: int):
        self.sandbox, self.id = sandbox, session_id
        self.slot: Optional[_Slot] = None
        self.generation = 0
        self.done = False

    @property
    def _label(self) -> str:
        return self.sandbox.environment.label

    async def reset(self, row: Any) -> str:
        """The first observation for the dataset row `row`. Raises EnvironmentFailure when reset
        raises, returns anything but text, or does not finish within the timeout."""
        return await asyncio.wrap_future(self.sandbox._submit(self._reset(row)))

    async def _reset(self, row: Any) -> str:
        sandbox = self.sandbox
        slot = await sandbox._acquire(self.slot)
        if self.slot is None:
            self.slot, self.generation = slot, slot.generation
            slot.sessions += 1
        try:
            reply = await sandbox._request(slot, ("reset", self.id, row))
        except _Timeout:
            raise EnvironmentFailure(f"{self._label}: reset did not finish within "
                                     f"{sandbox.key}.timeout_s={sandbox.timeout_s:g} s") from None
        except _Died as e:
            raise EnvironmentFailure(f"{self._label}: reset killed its sandbox worker: "
                                     f"{exit_description(e.code)}") from None
        if reply[0] != "ok":
            raise EnvironmentFailure(reply[1])
        return reply[1]

    async def step(self, action_text: str) -> EnvStep:
        """The environment's answer to the model's turn; a step that raises, times out or
        kills its worker ends the trajectory (done) with an observation saying so."""
        return await asyncio.wrap_future(self.sandbox._submit(self._step(action_text)))

    async def _step(self, action_text: str) -> EnvStep:
        if self.slot is None:
            raise EnvironmentFailure(f"{self._label}: step before reset")
        t0 = time.monotonic()
        reply = await self.sandbox._env_request(self, ("step", self.id, action_text), self.slot)
        seconds = time.monotonic() - t0
        if reply == "lost":
            return self._ended("Error: the environment's state was lost (its sandbox worker was "
                               "replaced after another call failed).", "error", seconds)
        if reply == "timeout":
            return self._ended(f"Error: the environment did not answer within "
                               f"{self.sandbox.timeout_s:g} s.", "timeout", seconds)
        if reply[0] == "died":
            return self._ended(f"Error: the environment crashed ({exit_description(reply[1])}).",
                               "error", seconds)
        if reply[0] == "failure":
            raise EnvironmentFailure(reply[1])
        if reply[0] == "error":
            return self._ended(f"Error: {reply[1]}", "error", seconds)
        observation, reward, done = reply[1]
        self.done = done
        return EnvStep(observation, reward, done, "ok", seconds)

    def _ended(self, text: str, status: str, seconds: float) -> EnvStep:
        self.done = True
        return EnvStep(text, 0.0, True, status, seconds)

    async def close(self) -> None:
        """Drop the environment instance (its close() runs in the worker, if it has one)."""
        if self.slot is None:
            return
        slot, self.slot = self.slot, None
        if slot.generation == self.generation and slot.broken is None:
            await asyncio.wrap_future(self.sandbox._submit(self._close(slot)))

    async def _close(self, slot: _Slot) -> None:
        await self.sandbox._env_request(self, ("close", self.id, None), slot)
        if slot.generation == self.generation:
            slot.sessions -= 1

    async def __aenter__(self) -> "EnvSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
