"""Score items in worker processes with a per-item timeout.

Why processes and not threads: a user's scorer may hang (a regex blow-up, a sandbox that never
returns) or crash the interpreter; only a process can be killed. The parent talks to each worker
over its own socket and hands it a small chunk of items; the worker answers item by item, so the
parent always knows which item a worker is on and since when. An item that raises, or whose
worker dies, is an "error"; one still running after `timeout_s` (times the item's size: a batch
scorer's call over B samples may take B times a sample's limit) is a "timeout": its worker is
killed and replaced (the replacement gets nothing until it has loaded the scorers), the rest of
its chunk goes back to the queue, and the other items go on. Results come back in input order,
so nothing is lost or shifted. A dead worker's outcome carries its exit code (the manager names
the sample). With `max_memory_mb` each worker's address space is capped (worker.limit_memory):
a scorer that goes over it gets a MemoryError, an "error" like any other.

Workers are fresh interpreters (distributed/worker_process.py says why not multiprocessing's fork
or spawn).
"""
from __future__ import annotations

import collections
import multiprocessing.connection as mp_connection
import signal
import subprocess
import time
from typing import Any, Optional, Union

from verl_mcore.distributed.worker_process import WorkerProcess
from verl_mcore.reward.scorers import ScorerSpec
from verl_mcore.reward.worker import Outcome
from verl_mcore.user_code import UserCodeError, exit_description
from verl_mcore.utils.doing import doing


_MAX_CHUNK = 16


class _Worker(WorkerProcess):
    def __init__(self, specs: dict[str, ScorerSpec], max_memory_mb: Optional[int]):
        super().__init__("verl_mcore.reward.worker:serve", (specs, max_memory_mb), max_memory_mb)
        self.state = "starting"  # -> "idle" <-> "busy"
        self.items: collections.deque = collections.deque()  # sent, not yet answered, in order
        self.since = time.monotonic()


def _why_it_died(code: int) -> str:
    if code >= 0:
        return "the scorer ended its process: os._exit, or an exit from native code"
    if code == -signal.SIGKILL:
        return ("killed from outside: the kernel's out-of-memory killer (see dmesg), or a kill; "
                "reward.max_memory_mb turns a scorer's excess memory into a MemoryError instead")
    return "a crash in native code"


class ScoringPool:
    """`map(items, sizes)` scores [(scorer_key, args)] -> [Outcome, or [Outcome] for a batch
    scorer's item], in order; `sizes` [items]: samples per item (default 1 each), which scale its
    time limit. A timeout or a dead worker is one Outcome for its item, whatever its size."""

    def __init__(self, specs: dict[str, ScorerSpec], num_workers: int, timeout_s: float,
                 startup_timeout_s: float = 120.0, max_memory_mb: Optional[int] = None):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers}: a pool needs at least one worker")
        self.specs, self.timeout_s, self.startup_timeout_s = specs, timeout_s, startup_timeout_s
        self.max_memory_mb = max_memory_mb
        self._workers = [_Worker(specs, max_memory_mb) for _ in range(num_workers)]
        self.restarts = 0  # workers replaced after a timeout or a crash, over the pool's life
        try:  # wait until every worker has loaded the scorers
            with doing(f"starting {num_workers} reward workers, which import {self._files()}",
                       startup_timeout_s, "reward.import_timeout_s plus start-up"):
                self._serve({}, [], [])
        except BaseException:
            self.close()
            raise

    def map(self, items: list[tuple[str, tuple]],
            sizes: Optional[list[int]] = None) -> list[Union[Outcome, list[Outcome]]]:
        results: dict[int, Outcome] = {}
        with doing(f"scoring {len(items)} reward items in {len(self._workers)} workers "
                   f"(each item within reward.timeout_s={self.timeout_s:g} s per sample)"):
            self._serve(results, items, sizes or [1] * len(items))
        return [results[i] for i in range(len(items))]

    def _serve(self, results: dict[int, Outcome], items: list[tuple[str, tuple]],
               sizes: list[int]) -> None:
        todo = collections.deque(range(len(items)))

        def limit_s(w: _Worker) -> float:  # for the item it is on, which restarted its clock
            return self.timeout_s * sizes[w.items[0]] if w.state == "busy" else self.startup_timeout_s

        while len(results) < len(items) or any(w.state == "starting" for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.state == "idle" and todo:
                    # Small chunks save round trips on large batches; a batch smaller than
                    # 2 items per worker still goes one by one, to spread it.
                    size = max(1, min(_MAX_CHUNK, len(todo) // (2 * len(self._workers))))
                    w.items = collections.deque(todo.popleft() for _ in range(size))
                    w.conn.send([(i, *items[i]) for i in w.items])
                    w.state, w.since = "busy", now
            waiting = [w for w in self._workers if w.state != "idle"]
            if not waiting:
                continue
            limit = min(w.since + limit_s(w) for w in waiting)
            ready = mp_connection.wait([w.conn for w in waiting], timeout=max(0.0, limit - now))
            for w in waiting:
                if w.conn in ready:
                    self._receive(w, results, todo)
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.state == "busy" and now - w.since >= limit_s(w):
                    late = w.items.popleft()
                    results[late] = Outcome("timeout", error=self._late(sizes[late]))
                    todo.extendleft(reversed(w.items))  # the rest of its chunk: to another worker
                    self._replace(i)
                elif w.state == "starting" and now - w.since >= self.startup_timeout_s:
                    raise UserCodeError(f"a reward worker did not load the scorers "
                                        f"({self._files()}) within {self.startup_timeout_s:g} s "
                                        "(reward.import_timeout_s plus start-up): does importing "
                                        "them block?")

    def _receive(self, w: _Worker, results: dict[int, Outcome], todo: collections.deque) -> None:
        # The worker sends one result at a time, so the timeout clock restarts per item.
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            code = w.proc.wait()
            cap = (f", under reward.max_memory_mb={self.max_memory_mb}" if self.max_memory_mb
                   else "")
            if w.state == "starting":
                raise UserCodeError(f"a reward worker ended while loading the scorers "
                                    f"({self._files()}): {exit_description(code)}{cap}") from None
            results[w.items.popleft()] = Outcome(
                "error", error=f"the reward worker died while scoring this sample: "
                               f"{exit_description(code)}{cap} ({_why_it_died(code)})",
                exit_code=code)
            todo.extendleft(reversed(w.items))
            self._replace(self._workers.index(w))
            return
        tag, payload = message
        if tag == "init_error":  # the traceback, then what failed: the last line a user sees
            cap = (f" (the workers' reward.max_memory_mb={self.max_memory_mb} applies to loading "
                   "them too; the import probe has no such cap)"
                   if self.max_memory_mb and "MemoryError" in payload else "")
            raise UserCodeError(f"{payload.rstrip()}\na reward worker could not load the scorers "
                                f"({self._files()}): {payload.strip().splitlines()[-1]}{cap}")
        if tag == "ready":
            w.state = "idle"
            return
        expected = w.items.popleft()
        assert tag == expected, f"worker answered item {tag}, expected {expected}"
        results[tag] = payload
        w.since = time.monotonic()
        if not w.items:
            w.state = "idle"

    def _late(self, size: int) -> str:
        if size == 1:
            return f"no result after reward.timeout_s={self.timeout_s} s"
        return (f"no result from the batch call after reward.timeout_s={self.timeout_s} s x "
                f"{size} samples = {self.timeout_s * size:g} s")

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = _Worker(self.specs, self.max_memory_mb)
        self.restarts += 1

    def _files(self) -> str:
        files = sorted({f"{s.key}.path={s.path}" for s in self.specs.values() if s.path})
        return ", ".join(files) or "the built-in scorers"

    def close(self) -> None:
        for w in self._workers:
            if w.state == "idle":
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 2
        for w in self._workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self._workers = []

    def __enter__(self) -> "ScoringPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
