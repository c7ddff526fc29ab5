"""Turn a hung collective into a short, readable failure on every rank.

A rank that never joins a collective (crashed, stuck, on a bad node) leaves the others waiting
until the process-group timeout, often 30 minutes or more, and the log then says nothing about
*where* the run was. The trainer instead names what it is doing:

    wd = Watchdog(cfg.trainer.collective_timeout_s, rank=info.rank).start()
    with wd.phase("step", step=step):
        with wd.phase("actor_update", step=step, op="forward_backward"):
            ...
            wd.set_op("all_reduce grads")      # a finer-grained label inside the phase
            ...
        for chunk in decode_loop:
            wd.beat()                          # progress inside one long phase

A background thread checks a few times per timeout. When the innermost phase has made no progress
(no phase entered or left, no set_op, no beat) for longer than its timeout, it writes the Python
stacks of all threads on this rank's stderr, then one line -- rank, host, phase, operation, step,
seconds waited, and what the rank was doing (utils/doing.py: importing which user file, starting
the scoring workers, waiting for the other ranks) -- and ends the process with
`os._exit(EXIT_COLLECTIVE_TIMEOUT)`. The line comes last so that it is the last thing the user
sees, not a stack frame; the note names what a stack cannot (a file imported in another process).
Every rank runs its own watchdog, so each rank reports where *it* was: the ones waiting in the
collective and the one that never arrived. `os._exit` because a thread blocked in a C++ collective can be neither
interrupted nor joined, and atexit handlers could block on the same hung communicator.

Outside any phase the watchdog is idle (start-up, model loading), so wrap the whole step.
A phase left by an exception logs its name too, so a rank that fails fast says where it was.

The process-group timeout is the backstop for the case where this thread cannot run at all:
`process_group_timeout(t)` is t plus a margin, so the readable message comes first.

Signals while stuck: when the first rank exits, `srun --kill-on-bad-exit` sends SIGTERM to the
others. A rank blocked inside a C++ collective cannot run its Python signal handler until the
collective returns, i.e. never; so `start(watch_signals=True)` (from the main thread, after the
PreemptionGuard installed its handlers) also registers a `signal.set_wakeup_fd` pipe, which the
C-level handler writes to at once, and this thread prints where the rank was when a signal came
("[rank 3] SIGNAL SIGTERM ... in phase ..."). It only reports; what to do about the signal stays
with the PreemptionGuard (or with Slurm's SIGKILL).
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from verl_mcore.utils.doing import notes

log = logging.getLogger(__name__)

# "A collective (or a phase) hung past trainer.collective_timeout_s." Distinct from Python's 1/2,
# train.py's 2/3, EXIT_PREEMPTED (75), `timeout`'s 124 and the shell's 126/127/128+N, so the
# launcher can tell a hang from a crash. The launcher does not requeue on it (a hang usually has a
# cause that a rerun would meet again); it prints where to look.
EXIT_COLLECTIVE_TIMEOUT = 86

# The process-group timeout exceeds the watchdog's by this much, so our message comes first.
PG_TIMEOUT_MARGIN_S = 60.0


def process_group_timeout(collective_timeout_s: float) -> datetime.timedelta:
    """Timeout to give torch.distributed / megatron process groups for a watchdog timeout."""
    return datetime.timedelta(seconds=collective_timeout_s + PG_TIMEOUT_MARGIN_S)


@dataclass(frozen=True)
class _Phase:
    name: str
    step: Optional[int]
    op: Optional[str]
    timeout_s: float


class Watchdog:
    """Per-rank phase tracker with a background timeout thread.

    `timeout_s`: default seconds a phase may go without progress (trainer.collective_timeout_s).
    `rank`: printed in every message. `on_expire(message)`: what to do after reporting; default
    exits the process with EXIT_COLLECTIVE_TIMEOUT (tests pass a recorder). `poll_s`: check
    interval, default timeout / 10 capped to [0.1 s, 10 s]. `clock`: seconds, monotonic (tests
    pass a fake one and call `check()` themselves, so a loaded machine cannot fail them).
    """

    def __init__(self, timeout_s: float, rank: int = 0, *,
                 on_expire: Optional[Callable[[str], None]] = None,
                 poll_s: Optional[float] = None, stream=None, dump_stacks: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 s (trainer.collective_timeout_s), got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.poll_s = poll_s if poll_s is not None else min(10.0, max(0.1, timeout_s / 10))
        self._on_expire = on_expire or _exit_process
        self._stream = stream
        self._dump_stacks = dump_stacks
        self._clock = clock  # tests pass a fake one and call check() themselves
        self._lock = threading.Lock()
        self._stack: list[_Phase] = []
        self._last_progress = clock()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._wakeup: Optional[tuple[int, int]] = None  # (read end, write end) of the signal pipe
        self.expired_message: Optional[str] = None

    # -- used by the trainer ------------------------------------------------------------------

    def start(self, watch_signals: bool = False) -> "Watchdog":
        """Start the thread. `watch_signals`: also report signals (main thread only; see above)."""
        if watch_signals and self._wakeup is None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            if previous != -1:  # someone else (an event loop) owns it: leave theirs in place
                signal.set_wakeup_fd(previous)
                os.close(r)
                os.close(w)
                log.warning("rank %d: signal wakeup fd already in use; the watchdog will not "
                            "report signals received during a hang", self.rank)
            else:
                self._wakeup = (r, w)
        if self._thread is None:
            self._stopped.clear()
            self._thread = threading.Thread(target=self._watch, name="verl_mcore-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._wakeup is not None:
            try:  # the thread sleeps in select() on the signal pipe for up to poll_s: wake it
                os.write(self._wakeup[1], b"\0")
            except OSError:  # a full pipe wakes it as well
                pass
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s * 2 + 1)
            self._thread = None
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    @contextlib.contextmanager
    def phase(self, name: str, step: Optional[int] = None, op: Optional[str] = None,
              timeout_s: Optional[float] = None) -> Iterator[None]:
        """Mark a phase; nested phases inherit `step` from the enclosing one when not given.

        `timeout_s` overrides the default for this phase (e.g. a checkpoint save on slow storage).
        """
        with self._lock:
            if step is None and self._stack:
                step = self._stack[-1].step
            self._stack.append(_Phase(name, step, op, timeout_s or self.timeout_s))
            self._last_progress = self._clock()
        try:
            yield
        except BaseException as e:
            # The rank that fails fast (and makes the others hang) says where it failed.
            log.error("rank %d: %s raised %s: %s", self.rank, self._describe(self._stack[-1]),
                      type(e).__name__, e)
            raise
        finally:
            with self._lock:
                self._stack.pop()
                self._last_progress = self._clock()

    def set_op(self, op: str) -> None:
        """Relabel the operation of the innermost phase (counts as progress)."""
        with self._lock:
            if self._stack:
                top = self._stack[-1]
                self._stack[-1] = _Phase(top.name, top.step, op, top.timeout_s)
            self._last_progress = self._clock()

    def beat(self) -> None:
        """Progress inside a long phase (e.g. every decode chunk)."""
        self._last_progress = self._clock()

    def current(self) -> Optional[str]:
        with self._lock:
            return self._describe(self._stack[-1]) if self._stack else None

    # -- the thread ---------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopped.is_set():
            if self._wakeup is not None:
                ready, _, _ = select.select([self._wakeup[0]], [], [], self.poll_s)
                if self._stopped.is_set():
                    return  # stop() woke us: its byte is not a signal
                if ready:
                    self._report_signals()
            elif self._stopped.wait(self.poll_s):
                return
            if self.check():
                return

    def check(self) -> bool:
        """One poll: when the innermost phase has gone without progress for longer than its
        timeout, report it and expire (True). The thread calls this every poll_s."""
        with self._lock:
            if not self._stack:
                return False
            top, outer = self._stack[-1], [p.name for p in self._stack[:-1]]
            waited = self._clock() - self._last_progress
        if waited <= top.timeout_s:
            return False
        self._report(top, outer, waited)
        return True

    def _report_signals(self) -> None:
        try:
            data = os.read(self._wakeup[0], 64)
        except (BlockingIOError, OSError):
            return
        with self._lock:
            top = self._stack[-1] if self._stack else None
            waited = self._clock() - self._last_progress
        where = f"in {self._describe(top)} (no progress for {waited:.1f} s)" if top else "outside any phase"
        where += "".join(f"; {line}" for line in _doing_lines())
        for signum in data:
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = f"signal {signum}"
            self._write(f"[rank {self.rank}] SIGNAL {name} on {socket.gethostname()} "
                        f"(pid {os.getpid()}) {where}")

    def _write(self, text: str) -> None:
        stream = self._stream or sys.stderr
        try:
            stream.write(text + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass

    def _describe(self, p: _Phase) -> str:
        parts = [f"phase '{p.name}'"]
        if p.op:
            parts.append(f"operation '{p.op}'")
        if p.step is not None:
            parts.append(f"step {p.step}")
        return ", ".join(parts)

    def _report(self, top: _Phase, outer: list[str], waited: float) -> None:
        where = f" inside {' > '.join(outer)}" if outer else ""
        doing = _doing_lines()
        longer = [n for _, stack in notes() for n in stack
                  if n.limit_s is not None and n.limit_s > top.timeout_s]
        if longer:  # the rank was within a limit of its own: say which limit to change
            why = (f"Its own limit ({longer[-1].limit()}) is longer than this phase's watchdog "
                   f"timeout ({top.timeout_s:g} s, trainer.collective_timeout_s), so the watchdog "
                   "stopped the rank first: lower the one or raise the other.")
        else:
            why = ("A collective in this phase is probably waiting for a rank that is elsewhere: "
                   "compare with the other ranks' WATCHDOG lines.")
        msg = (f"[rank {self.rank}] WATCHDOG on {socket.gethostname()} (pid {os.getpid()}): "
               f"no progress for {waited:.1f} s (timeout {top.timeout_s:g} s) in "
               f"{self._describe(top)}{where}"
               + "".join(f"; {line}" for line in doing)
               + f". {why} Exiting with code {EXIT_COLLECTIVE_TIMEOUT}.")
        self.expired_message = msg
        stream = self._stream or sys.stderr
        if self._dump_stacks:
            try:  # faulthandler needs a stream with a file descriptor
                stream.write(f"[rank {self.rank}] WATCHDOG: the Python stacks of this rank's "
                             "threads; what it was doing follows them\n")
                stream.flush()
                faulthandler.dump_traceback(file=stream, all_threads=True)
            except (OSError, ValueError):
                pass
        self._write(msg)  # a closed stream must not stop the exit below: _write ignores it
        self._on_expire(msg)


def _doing_lines() -> list[str]:
    """'this rank was importing ... (inside checking the inputs)' per thread with notes."""
    lines = []
    for thread, stack in notes():
        who = "this rank was" if thread == threading.main_thread().name else f"its thread {thread!r} was"
        inside = f" (inside: {' > '.join(map(str, stack[:-1]))})" if len(stack) > 1 else ""
        lines.append(f"{who} {stack[-1]}{inside}")
    return lines


def _exit_process(message: str) -> None:
    os._exit(EXIT_COLLECTIVE_TIMEOUT)
