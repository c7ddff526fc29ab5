"""Run a check on every rank, and stop every rank together when it fails on any of them.

A check that fails on one rank only (a file missing on one node, a flaky file system, a user
file that imports on some nodes and not others) would otherwise stop that rank alone, and let
the others walk into the next collective and wait there for the watchdog's timeout
(trainer.collective_timeout_s, 30 minutes by default) before anyone learns why.

    inputs = all_ranks_agree(check_inputs, "checking the inputs", cleanup=close_them)

Every rank runs `fn`; one all_gather says who failed. When nobody did, each rank gets its own
result. Otherwise the ranks that failed raise their own exception (its traceback intact), and the
others run `cleanup` on their result and raise AgreedFailure naming the first rank that failed
and its message, so rank 0 can print one line that explains the stop of every rank.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class AgreedFailure(RuntimeError):
    """Another rank failed the check this rank passed."""


def all_ranks_agree(fn: Callable[[], T], what: str,
                    cleanup: Optional[Callable[[T], Any]] = None) -> T:
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        error = e
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
    else:
        reports = [mine]
    failed = [(rank, message) for rank, message in enumerate(reports) if message is not None]
    if not failed:
        return result
    if error is not None:
        raise error
    if cleanup is not None:
        cleanup(result)
    rank, message = failed[0]
    others = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
    raise AgreedFailure(f"rank {rank}{others} failed while {what}: {message}")
