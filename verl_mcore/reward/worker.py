"""The scoring worker process: `serve(Connection(fd))` in a fresh interpreter started by pool.py.

It is a fresh interpreter rather than a multiprocessing child: multiprocessing's spawn would
re-import the trainer's main module (torch, megatron-core: seconds per worker, and a hang for a
script without a main guard), and fork would copy CUDA and communication threads.

Protocol over the socket `fd` (multiprocessing Connection framing, pickled messages):
  parent -> (sys.path, {key: ScorerSpec})      once
  worker -> ("ready", None) | ("init_error", traceback)
  parent -> [(item, key, args), ...] a chunk ; None to stop
  worker -> (item, Outcome)                  one message per item, in chunk order
"""
from __future__ import annotations

import signal
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from verl_mcore.reward.scorers import check_result


@dataclass
class Outcome:
    status: str  # "ok" | "error" | "timeout"
    score: float = 0.0
    extras: dict = field(default_factory=dict)
    error: str = ""  # traceback (error) or explanation (timeout)


def score_one(fn, args: tuple) -> Outcome:
    """Run one scorer call, turning any exception into an error outcome."""
    try:
        score, extras = check_result(fn(*args))
        return Outcome("ok", score, extras)
    except Exception:
        return Outcome("error", error=traceback.format_exc())


def serve(conn: Connection) -> None:
    # Ctrl-C, Slurm's warning signal (USR1) and a preemption SIGTERM reach the whole process
    # group; the trainer decides what happens (finish the step, checkpoint), not the worker. A
    # worker whose trainer is gone sees its pipe close and exits.
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        path, specs = conn.recv()
        sys.path[:] = path  # the parent's, so a scorer file can import what the parent could
        scorers = {key: spec.load() for key, spec in specs.items()}
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        for item, key, args in message:
            conn.send((item, score_one(scorers[key], args)))
