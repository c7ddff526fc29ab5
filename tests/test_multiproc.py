"""The gloo-rank runner must report failures and hangs, never hang itself."""
import os
import time

import pytest

from tests.multiproc import run_on_ranks


def _sum_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item(), os.getpid(), os.environ.get("VM_TEST_FLAG")


def _rank1_raises(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever


def _rank0_hangs(rank, world_size):
    if rank == 0:
        time.sleep(60)


def test_results_ordered_and_pool_reused():
    first = run_on_ranks(_sum_ranks, 2, env={"VM_TEST_FLAG": "x"})
    assert [r[0] for r in first] == [1.0, 1.0] and [r[2] for r in first] == ["x", "x"]
    second = run_on_ranks(_sum_ranks, 2)
    assert [r[1] for r in second] == [r[1] for r in first]  # same processes
    assert [r[2] for r in second] == [None, None]  # env restored


def test_failing_rank_traceback_is_shown():
    with pytest.raises(AssertionError, match="(?s)rank 1 of 2 failed.*boom on rank one"):
        run_on_ranks(_rank1_raises, 2, timeout=60)
    # the pool was discarded; a new one works
    assert [r[0] for r in run_on_ranks(_sum_ranks, 2)] == [1.0, 1.0]


def test_hang_times_out_naming_ranks():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 3s; ranks still running: \[0\]"):
        run_on_ranks(_rank0_hangs, 2, timeout=3)
    assert time.monotonic() - start < 30
