"""A failure on some ranks raised on every rank, so no rank waits for the ones that stopped.

    with raised_on_every_rank("committing step_8", RuntimeError):   # every rank enters
        if rank == 0:
            write_files()                                            # may fail on rank 0 only

A rank that raises inside a rank-0-only block (a full disk, a refused lock) would leave the others
blocked in the next collective until the collective timeout; here all ranks meet after the block
and, when any failed, all raise: a failing rank its own error, the others `error_type` (or
DiskFullError when the failure was a full disk) quoting the first failing rank's message.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist

from verl_mcore.utils.files import DiskFullError, is_disk_full


@contextlib.contextmanager
def raised_on_every_rank(what: str, error_type: type = RuntimeError, group=None):
    """Collective over `group` (default: all ranks); `what` names the block in the message."""
    failure = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        failure = e
    mine = None if failure is None else (is_disk_full(failure), f"{failure}")
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if failure is not None:
        raise failure
    first = next(((r, f) for r, f in enumerate(everyone) if f is not None), None)
    if first is not None:
        rank, (disk_full, message) = first
        raise (DiskFullError if disk_full else error_type)(f"rank {rank}, {what}: {message}")
