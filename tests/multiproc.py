"""Run a test body on N gloo ranks in spawned processes.

    from tests.multiproc import run_on_ranks

    def _body(rank, world_size, scale):      # module-level: spawn pickles it by name
        ...
        return {"loss": 1.0}

    def test_x():
        results = run_on_ranks(_body, world_size=4, args=(2.0,), timeout=120)
        assert results[0]["loss"] == ...

Each rank is a spawned interpreter (as torchrun would give) with a gloo default process group
already initialised and the environment a torchrun launch sets (RANK, WORLD_SIZE, ...). Results
come back as a list ordered by rank. If any rank raises, the failing rank's traceback is shown in
the assertion; if the body does not finish in `timeout` seconds the test fails naming the ranks
still running. Either way the ranks are killed, so a failure never becomes a hang.

Importing torch + megatron-core costs ~8 s of CPU per process, which on a 2-core machine would
dominate the suite. So by default the ranks are a pool kept per world size and reused by later
calls: a body must seed its own RNGs and must not destroy the default process group (megatron's
parallel_state is torn down after every call). `fresh=True` gives a new set of processes that
is discarded afterwards (for bodies that kill ranks or change global state for good).
"""
from __future__ import annotations

import atexit
import itertools
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

STARTUP_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_after_task() -> bool:
    """Tear down per-test global state; return False if the process is no longer reusable."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if not dist.is_initialized():
        return False
    # Every gloo group keeps three threads alive until destroyed; megatron and our own group
    # builders make dozens per test, so a reused rank would otherwise collect thousands.
    default = c10d._get_default_group()
    for pg in list(c10d._world.pg_map):
        if pg is not default:
            dist.destroy_process_group(pg)
    return True


def _worker(rank, world_size, port, tasks, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        # Two cores shared by all ranks: one thread each keeps them from fighting.
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001 - the parent must see why a rank could not start
        results.put((None, rank, "error", traceback.format_exc(), False))
        return
    results.put((None, rank, "ready", None, True))
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, env = item
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            status, payload = "ok", fn(rank, world_size, *args)
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            status, payload = "error", traceback.format_exc()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            reusable = _reset_after_task()
        except BaseException:  # noqa: BLE001
            reusable = False
        results.put((task_id, rank, status, payload, reusable))
        if not reusable:
            break


class _Pool:
    _ids = itertools.count()

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            # Not daemonic: megatron's checkpoint writer starts a multiprocessing Manager, which a
            # daemonic process may not do. close() (and atexit) end them instead.
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results),
                        daemon=False)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._collect(None, STARTUP_TIMEOUT, "startup")

    def run(self, fn, args, env, timeout) -> tuple[list[Any], bool]:
        task_id = next(self._ids)
        for q in self.tasks:
            q.put((task_id, fn, tuple(args), dict(env)))
        return self._collect(task_id, timeout, fn.__name__)

    def _collect(self, task_id, timeout, what) -> tuple[list[Any], bool]:
        got: dict[int, Any] = {}
        reusable = True
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r for r in range(self.world_size) if r not in got]
                raise AssertionError(f"run_on_ranks({what}): timed out after {timeout:.0f}s; "
                                     f"ranks still running: {running}")
            try:
                tid, rank, status, payload, ok = self.results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in got and not p.is_alive()]
                if dead:
                    codes = {r: self.procs[r].exitcode for r in dead}
                    raise AssertionError(f"run_on_ranks({what}): rank(s) {dead} died without a "
                                         f"result (exit codes {codes})") from None
                continue
            if tid != task_id:
                continue  # a late message from an earlier, failed call
            if status == "error":
                raise AssertionError(f"rank {rank} of {self.world_size} failed in {what}:\n{payload}")
            got[rank] = payload
            reusable = reusable and ok
        return [got[r] for r in range(self.world_size)], reusable

    def close(self):
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools():
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results."""
    pool = _POOLS.pop(world_size, None) if not fresh else None
    if pool is None:
        pool = _Pool(world_size)
    try:
        results, reusable = pool.run(fn, args, env or {}, timeout)
    except BaseException:
        pool.close()  # some ranks may be stuck in a collective: never reuse them
        raise
    if fresh or not reusable:
        pool.close()
    else:
        _POOLS[world_size] = pool
    return results
