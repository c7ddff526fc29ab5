"""Run a test body on N gloo ranks in spawned processes.

    from tests.multiproc import run_on_ranks

    def _body(rank, world_size, scale):      # module-level: spawn pickles it by name
        ...
        return {"loss": 1.0}

    def test_x():
        results = run_on_ranks(_body, world_size=4, args=(2.0,), timeout=120)
        assert results[0]["loss"] == ...

Each rank gets a fresh interpreter (start method `spawn`, as torchrun would give), a process group
on gloo initialised from MASTER_ADDR/MASTER_PORT on a free port, and the environment variables a
torchrun launch sets (RANK, WORLD_SIZE, LOCAL_RANK, ...). The return values come back as a list
ordered by rank. If any rank raises, every rank is killed and the failing rank's traceback is shown
in the assertion; if the body does not finish in `timeout` seconds, all ranks are killed and the
test fails naming the ranks that were still running.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, fn, args, env, queue):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        # Two cores shared by all ranks: one thread each keeps them from fighting.
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown must not mask the result
            pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, fn, tuple(args), dict(env or {}), queue),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r for r in range(world_size) if r not in results]
                raise AssertionError(
                    f"run_on_ranks({fn.__name__}): timed out after {timeout:.0f}s; "
                    f"ranks still running: {running}"
                )
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [
                    r for r, p in enumerate(procs)
                    if r not in results and not p.is_alive() and p.exitcode not in (0, None)
                ]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise AssertionError(
                        f"run_on_ranks({fn.__name__}): rank(s) {dead} died without a result "
                        f"(exit codes {codes})"
                    ) from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
