"""What this process is doing now, in words, for whoever reports on it while it waits.

The watchdog (distributed/watchdog.py) knows the trainer's phase ('check inputs', 'build
models', 'score') but not what inside it is taking long: importing a user's reward file in a
probe process, starting the scoring workers, a user's scorer running in the trainer, waiting for
the other ranks. A rank stopped by it printed only the phase and a thread dump in which the
user's file appeared nowhere (the probe's stack is in another process). Code that may take long
says what it does:

    with doing("importing reward.custom_fn.path=/x/rewards.py in a probe process",
               limit_s=60, limit_key="reward.import_timeout_s"):
        ...

and the watchdog's report names it (`notes()`), with its own time limit when it has one, so a
limit longer than the watchdog's can be named as the reason the watchdog fired first.

It lives in the foundations because the code that knows what it is doing (user_code, reward,
data, models) is below the watchdog in the layers and must not import it. Notes are kept per
thread: a scorer's thread and the main thread each say what they do.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Optional


@dataclass(frozen=True)
class Note:
    what: str
    limit_s: Optional[float] = None  # its own time limit, when it has one
    limit_key: Optional[str] = None  # the config key that sets it

    def __str__(self) -> str:
        if self.limit_s is None:
            return self.what
        return f"{self.what} (for at most {self.limit()})"

    def limit(self) -> str:
        """'60 s, reward.import_timeout_s'"""
        return f"{self.limit_s:g} s" + (f", {self.limit_key}" if self.limit_key else "")


_lock = threading.Lock()
_notes: dict[int, list[Note]] = {}  # thread id -> its notes, outermost first


@contextlib.contextmanager
def doing(what: str, limit_s: Optional[float] = None,
          limit_key: Optional[str] = None) -> Iterator[None]:
    """Note `what` for this thread while the block runs (nested notes stack)."""
    note, ident = Note(what, limit_s, limit_key), threading.get_ident()
    with _lock:
        _notes.setdefault(ident, []).append(note)
    try:
        yield
    finally:
        with _lock:
            stack = _notes[ident]
            stack.remove(note)
            if not stack:
                del _notes[ident]


def notes() -> list[tuple[str, list[Note]]]:
    """(thread name, its notes outermost first) for every thread that has notes, the main thread
    first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    with _lock:
        current = [(ident, list(stack)) for ident, stack in _notes.items()]
    current.sort(key=lambda item: item[0] != main)
    return [(names.get(ident, f"thread {ident}"), stack) for ident, stack in current]
