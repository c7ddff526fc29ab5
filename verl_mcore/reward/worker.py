"""The scoring worker process: `serve(conn, init)` in a fresh interpreter started by pool.py
through distributed/worker_process.py (which says why a fresh interpreter, and sets the process
up: signals, sys.path, the memory cap).

Protocol over the socket (multiprocessing Connection framing, pickled messages):
  parent -> ({key: ScorerSpec}, max_memory_mb or None)   once (init)
  worker -> ("ready", None) | ("init_error", traceback)
  parent -> [(item, key, args), ...] a chunk ; None to stop
  worker -> (item, Outcome | [Outcome] * B)  one message per item, in chunk order; a list for a
                                             batch scorer's item, whose args are (RewardBatch,)
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Optional

from verl_mcore.distributed.worker_process import requests
from verl_mcore.reward.custom import BatchScorer, RewardBatch
from verl_mcore.reward.scorers import InvalidScore, check_result


@dataclass
class Outcome:
    status: str  # "ok" | "error" (raised, or its worker died) | "timeout" | "invalid" (bad value)
    score: float = 0.0
    extras: dict = field(default_factory=dict)
    error: str = ""  # traceback (error) or explanation (timeout, invalid)
    exit_code: Optional[int] = None  # error: the worker process died with this code (pool.py)


def run_item(scorer, args: tuple, max_memory_mb: Optional[int] = None):
    """One pool item: a batch scorer's call -> [Outcome] per sample, else one sample's Outcome."""
    if isinstance(scorer, BatchScorer):
        return score_batch(scorer, *args, max_memory_mb=max_memory_mb)
    return score_one(scorer, args, max_memory_mb)


def score_one(fn, args: tuple, max_memory_mb: Optional[int] = None) -> Outcome:
    """Run one scorer call, turning any exception, and any return value that is not a finite
    number, into a failed outcome."""
    value, failure = _call(fn, args, max_memory_mb)
    return failure or checked(value)


def score_batch(scorer: BatchScorer, batch: RewardBatch,
                max_memory_mb: Optional[int] = None) -> list[Outcome]:
    """One compute_reward call -> one Outcome per sample of `batch`: each value checked like a
    per-sample score; an exception, or a result that is not B values, fails every sample."""
    n = len(batch["responses"])
    value, failure = _call(scorer.compute_reward, (batch,), max_memory_mb)
    if failure is not None:
        return [failure] * n
    values = value.tolist() if hasattr(value, "tolist") else value  # numpy array, tensor
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = (f"{len(values)} values" if isinstance(values, (list, tuple))
               else f"{type(value).__name__} {repr(value)[:80]}")
        return [Outcome("invalid", error=f"compute_reward(batch) returned {got} "
                                         f"for a batch of {n} samples: it must return one score "
                                         "per sample, in the batch's order")] * n
    return [checked(v) for v in values]


def checked(value) -> Outcome:
    """A returned score held to the rule of scorers.check_result."""
    try:
        score, extras = check_result(value)
    except InvalidScore as e:
        return Outcome("invalid", error=str(e))
    return Outcome("ok", score, extras)


def _call(fn, args: tuple, max_memory_mb: Optional[int]) -> tuple:
    """(fn(*args), None), or (None, a failed Outcome) when it raised. SystemExit too: with
    reward.num_workers=0 a `sys.exit` in the scorer would otherwise end the trainer."""
    try:
        return fn(*args), None
    except MemoryError:
        cap = f" over reward.max_memory_mb={max_memory_mb} MiB" if max_memory_mb else ""
        return None, Outcome("error", error=f"the scorer ran out of memory{cap} (MemoryError):\n"
                                            + traceback.format_exc())
    except SystemExit as e:  # said last: the line that messages quote
        return None, Outcome("error", error=traceback.format_exc() + (
            f"the scorer called sys.exit({e.code!r}): return a score instead"))
    except Exception:
        return None, Outcome("error", error=traceback.format_exc())


def serve(conn: Connection, init: tuple) -> None:
    try:
        specs, max_memory_mb = init
        scorers = {key: spec.load() for key, spec in specs.items()}
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    for message in requests(conn):
        for item, key, args in message:
            conn.send((item, run_item(scorers[key], args, max_memory_mb)))
