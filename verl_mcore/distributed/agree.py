"""A failure on some ranks raised on every rank, so no rank waits for the ones that stopped.

A check or a rank-0-only block that fails on some ranks (a file missing on one node, a full disk,
a refused lock, a user file that imports on some nodes and not others) would otherwise stop
those ranks alone and leave the others blocked in the next collective until the watchdog's
timeout (trainer.collective_timeout_s, 30 minutes by default) before anyone learns why. Here
all ranks meet after the block (one all_gather) and, when any failed, all raise: a failing rank
its own exception (traceback intact), the others `error_type` (DiskFullError when the failure
was a full disk) naming the first failing rank and its message, so rank 0 can print one line
that explains the stop of every rank.

    with raised_on_every_rank("committing step_8", RuntimeError):   # every rank enters
        if rank == 0:
            write_files()                                            # may fail on rank 0 only

    inputs = all_ranks_agree(check_inputs, "checking the inputs", cleanup=close_them)

A decision every rank must take alike, made by code that need not decide alike on every rank (a
user's function: unseeded randomness, a file on one node), is made once and sent to the others:

    reasons = decided_on_one_rank(lambda: decide(groups), "filtering", GroupFilterError, group)
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from verl_mcore.utils.doing import doing
from verl_mcore.utils.files import DiskFullError, is_disk_full

T = TypeVar("T")


class AgreedFailure(RuntimeError):
    """Another rank failed the check this rank passed."""


@contextlib.contextmanager
def raised_on_every_rank(what: str, error_type: type = AgreedFailure, group=None):
    """Collective over `group` (default: all ranks); `what` names the block in the message."""
    failure = None
    try:
        with doing(what):
            yield
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        failure = e
    mine = None if failure is None else (is_disk_full(failure), f"{type(failure).__name__}: {failure}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        # A rank that waits here long waits for one still inside the block: the watchdog's
        # report says so, beside that rank's report of what it is doing.
        with doing(f"done {what}, waiting for the other ranks to finish it"):
            dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    if failure is not None:
        raise failure
    failed = [(rank, report) for rank, report in enumerate(everyone) if report is not None]
    if failed:
        rank, (disk_full, message) = failed[0]
        others = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise (DiskFullError if disk_full else error_type)(
            f"rank {rank}{others} failed while {what}: {message}")


def all_ranks_agree(fn: Callable[[], T], what: str,
                    cleanup: Optional[Callable[[T], Any]] = None) -> T:
    """`fn()` on every rank; its result when it passed everywhere. A rank that passed while
    another failed runs `cleanup` on its result before raising (see the module docstring)."""
    done: list = []
    try:
        with raised_on_every_rank(what):
            done.append(fn())
    except Exception:
        if done and cleanup is not None:
            cleanup(done[0])
        raise
    return done[0]


def decided_on_one_rank(fn: Callable[[], T], what: str, error_type: type = AgreedFailure,
                        group=None) -> T:
    """`fn()` on the first rank of `group` (default: all ranks) only, its result (a picklable
    object) on every rank of it, so they all go on alike (one broadcast). When `fn` raises there,
    that rank raises its own exception and the others `error_type` naming it and its message."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        with doing(what):
            return fn()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    failure, box = None, [None]
    if dist.get_rank() == src:
        try:
            with doing(what):
                box[0] = (True, fn())
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            failure, box[0] = e, (False, f"{type(e).__name__}: {e}")
    with doing(f"{what} (on rank {src}): receiving its result"):
        dist.broadcast_object_list(box, src=src, group=group)
    if failure is not None:
        raise failure
    passed, value = box[0]
    if not passed:
        raise error_type(f"rank {src} failed while {what}: {value}")
    return value
