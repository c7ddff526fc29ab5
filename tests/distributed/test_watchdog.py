"""Watchdog: a hung collective ends every rank with its phase/operation/step within the timeout."""
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiproc import free_port
from verl_mcore.distributed.preemption import PreemptionGuard
from verl_mcore.distributed.watchdog import (EXIT_COLLECTIVE_TIMEOUT, Watchdog,
                                             process_group_timeout)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0
RANK1_EXTRA_S = 2.0


def _hang_main() -> None:
    """One rank of the hang program (run in a subprocess with RANK/WORLD_SIZE/MASTER_* set).

    Rank 0 enters an all_reduce; rank 1 is stuck in another phase and never joins it. Rank 1's
    phase times out RANK1_EXTRA_S later: had both fired together, rank 1's exit could close the
    gloo pair under rank 0's all_reduce first, and rank 0 would end by that RuntimeError (exit 1,
    still naming its phase) instead of by its own watchdog -- the race CI met at aa3b2cf.
    """
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    timeout_s = float(os.environ.get("WATCHDOG_TIMEOUT_S", TIMEOUT_S))
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=process_group_timeout(timeout_s))
    PreemptionGuard().install()  # SIGTERM sets a flag, as in the trainer
    wd = Watchdog(timeout_s, rank=rank).start(watch_signals=True)
    dist.barrier()  # both ranks are up: the clock starts now
    print(f"entering {time.time():.3f}", flush=True)
    with wd.phase("step", step=12):
        if rank == 0:
            with wd.phase("actor_update", op="all_reduce grads"):
                dist.all_reduce(torch.ones(4))
        else:
            with wd.phase("compute_rewards", op="reward function",
                          timeout_s=timeout_s + RANK1_EXTRA_S):
                time.sleep(120)
    print("finished without the watchdog", flush=True)


EXPECTED = {0: "phase 'actor_update', operation 'all_reduce grads', step 12",
            1: "phase 'compute_rewards', operation 'reward function', step 12"}


def _start_ranks(**env_extra):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env_extra)
    code = "from tests.distributed.test_watchdog import _hang_main; _hang_main()"
    return [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(env, RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(2)]


@pytest.mark.distributed
def test_hung_collective_reports_phase_on_every_rank():
    procs = _start_ranks()
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank outlived the watchdog by far (90 s)")
        outs.append((p.returncode, out, err, time.time()))
    for rank, (rc, out, err, ended) in enumerate(outs):
        assert rc == EXIT_COLLECTIVE_TIMEOUT, f"rank {rank}: exit {rc}\n{err}"
        assert f"[rank {rank}] WATCHDOG" in err and EXPECTED[rank] + " inside step" in err, err
        assert "finished without the watchdog" not in out
        entered = float(out.split("entering ")[1].split()[0])
        # Fires after its timeout, within a few polls of it (ended is an upper bound: rank 1 is
        # collected after rank 0).
        timeout = TIMEOUT_S + (RANK1_EXTRA_S if rank == 1 else 0.0)
        assert timeout <= ended - entered < timeout + 5, (rank, ended - entered)


@pytest.mark.distributed
def test_sigterm_during_a_hang_reports_where_each_rank_is():
    """srun --kill-on-bad-exit SIGTERMs the ranks; rank 0 is blocked inside gloo's all_reduce,
    where Python handlers cannot run, and still says where it was."""
    procs = _start_ranks(WATCHDOG_TIMEOUT_S="120")
    try:
        lines = [p.stdout.readline() for p in procs]  # "entering ..." once both passed the barrier
        assert all(line.startswith("entering") for line in lines), lines
        time.sleep(1.0)  # rank 0 is now inside the all_reduce
        for p in procs:
            p.send_signal(signal.SIGTERM)
        time.sleep(3.0)
        assert all(p.poll() is None for p in procs)  # the guard only recorded the signal
    finally:
        for p in procs:
            p.kill()
    for rank, p in enumerate(procs):
        err = p.stderr.read()
        assert f"[rank {rank}] SIGNAL SIGTERM" in err and f"in {EXPECTED[rank]}" in err, err


class _Clock:
    """A monotonic clock the test moves by hand (in binary fractions: sums are exact)."""

    def __init__(self):
        self.now = 1024.0

    def __call__(self) -> float:
        return self.now


def test_progress_resets_and_idle_outside_phases():
    fired, clock = [], _Clock()
    wd = Watchdog(0.5, rank=3, on_expire=fired.append, stream=io.StringIO(), dump_stacks=False,
                  clock=clock)
    clock.now += 10  # no phase: idle, however long
    assert not wd.check()
    with wd.phase("generate", step=4):
        for _ in range(8):  # 3 s in one phase, but beating
            clock.now += 0.375
            assert not wd.check()
            wd.beat()
        for op in ["a", "b", "c", "d", "e", "f"]:  # relabelling is progress too
            clock.now += 0.375
            assert not wd.check()
            wd.set_op(op)
        clock.now += 0.5  # exactly the timeout: not yet
        assert not wd.check()
    assert not fired
    with wd.phase("checkpoint", op="save", timeout_s=0.25):  # its own timeout
        clock.now += 0.25
        assert not wd.check()
        clock.now += 0.125
        assert wd.check()
    assert len(fired) == 1
    assert fired[0].startswith("[rank 3] WATCHDOG") and "no progress for 0.4 s (timeout 0.25 s)" in fired[0]
    assert "phase 'checkpoint', operation 'save', step" not in fired[0]  # no step given
    assert "phase 'checkpoint', operation 'save'" in fired[0]
    assert wd.expired_message == fired[0]


def test_the_thread_checks_every_poll():
    fired = []
    wd = Watchdog(0.2, rank=1, on_expire=fired.append, poll_s=0.05, stream=io.StringIO(),
                  dump_stacks=False).start()
    try:
        with wd.phase("score"):
            deadline = time.monotonic() + 30  # a bound for a loaded machine, not a measurement
            while not fired and time.monotonic() < deadline:
                time.sleep(0.05)
        assert len(fired) == 1 and "in phase 'score'" in fired[0]
    finally:
        wd.stop()


def test_stop_wakes_the_thread_watching_signals():
    """The thread waits in select() on the signal pipe for poll_s (10 s by default): stop()
    returns at once, and its wake-up is not reported as a signal (Trainer.finish waited 10 s)."""
    stream = io.StringIO()
    wd = Watchdog(100, rank=0, poll_s=10, stream=stream).start(watch_signals=True)
    time.sleep(0.2)  # the thread is in select()
    start = time.monotonic()
    wd.stop()
    assert time.monotonic() - start < 2
    assert stream.getvalue() == ""


def test_nested_phase_inherits_step_and_current():
    wd = Watchdog(10, rank=0)
    assert wd.current() is None
    with wd.phase("step", step=7):
        with wd.phase("actor_update", op="fwd_bwd"):
            assert wd.current() == "phase 'actor_update', operation 'fwd_bwd', step 7"
            wd.set_op("optimizer")
            assert wd.current() == "phase 'actor_update', operation 'optimizer', step 7"
        assert wd.current() == "phase 'step', step 7"
    assert wd.current() is None


def test_phase_left_by_exception_is_logged(caplog):
    wd = Watchdog(10, rank=5)
    with pytest.raises(RuntimeError):
        with wd.phase("score", step=2, op="ref log-probs"):
            raise RuntimeError("boom")
    assert "rank 5: phase 'score', operation 'ref log-probs', step 2 raised RuntimeError: boom" \
        in caplog.text
    assert wd.current() is None


def test_bad_timeout_and_pg_margin():
    with pytest.raises(ValueError, match="collective_timeout_s"):
        Watchdog(0)
    assert process_group_timeout(30).total_seconds() > 30


def test_the_report_says_what_the_rank_was_doing_and_ends_with_it(tmp_path):
    # The note names what no stack of this process shows (a file imported in a probe process);
    # the report's line comes after the stacks, as the last thing a user sees.
    from verl_mcore.utils.doing import doing

    fired, clock, stream = [], _Clock(), open(tmp_path / "stderr", "w+")  # faulthandler: an fd
    wd = Watchdog(5, rank=2, on_expire=fired.append, stream=stream, clock=clock)
    with wd.phase("check inputs"), doing("checking the inputs"), \
            doing("importing reward.custom_fn.path=/x/rewards.py in a probe process", 60,
                  "reward.import_timeout_s"):
        clock.now += 6
        assert wd.check()
    stream.seek(0)
    written = stream.read()
    stream.close()
    last = written.strip().splitlines()[-1]
    assert last == fired[0] and last.startswith("[rank 2] WATCHDOG on ")
    assert ("in phase 'check inputs'; this rank was importing reward.custom_fn.path=/x/rewards.py "
            "in a probe process (for at most 60 s, reward.import_timeout_s) (inside: checking the "
            "inputs). Its own limit (60 s, reward.import_timeout_s) is longer than this phase's "
            "watchdog timeout (5 s, trainer.collective_timeout_s)") in last, last
    assert "Current thread" in written  # the stacks came first


def test_the_report_names_other_threads_notes_and_no_limit_hint_without_one():
    import threading

    from verl_mcore.utils.doing import doing

    fired, clock, started, release = [], _Clock(), threading.Event(), threading.Event()

    def reader():
        with doing("reading data.custom_cls Mine's files"):
            started.set()
            release.wait(30)

    thread = threading.Thread(target=reader, name="dataset reader")
    thread.start()
    try:
        started.wait(30)
        wd = Watchdog(5, rank=0, on_expire=fired.append, stream=io.StringIO(),
                      dump_stacks=False, clock=clock)
        with wd.phase("check inputs"):
            clock.now += 6
            assert wd.check()
    finally:
        release.set()
        thread.join()
    assert "its thread 'dataset reader' was reading data.custom_cls Mine's files" in fired[0]
    assert "A collective in this phase is probably waiting" in fired[0]
