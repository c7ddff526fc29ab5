"""PreemptionGuard: a signal on one rank stops every rank after the same step."""
import os
import signal

import pytest

from tests.multiproc import run_on_ranks
from verl_mcore.distributed.preemption import EXIT_PREEMPTED, MARKER_ENV, PreemptionGuard


def _run_steps(rank, world_size, signal_rank, signal_step, signum, total_steps):
    """Each rank runs steps; `signal_rank` signals itself during `signal_step`."""
    guard = PreemptionGuard().install()
    try:
        stopped_at = code = None
        for step in range(total_steps):
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signum)  # delivered like Slurm's: the process keeps running
            if guard.should_stop():
                stopped_at = step
                code = guard.preempted_exit(step, rank)  # collective: rank 0 writes the marker first
                marker = os.environ[MARKER_ENV]
                seen = open(marker).read() if os.path.exists(marker) else None
                break
        return {"stopped_at": stopped_at, "received": guard.received, "code": code,
                "marker": seen if stopped_at is not None else None}
    finally:
        guard.uninstall()


@pytest.mark.distributed
@pytest.mark.parametrize("signal_rank, signum", [(2, signal.SIGUSR1), (0, signal.SIGTERM)])
def test_one_signalled_rank_stops_all_at_same_step(signal_rank, signum, tmp_path):
    marker = str(tmp_path / "preempted")
    results = run_on_ranks(_run_steps, 4, args=(signal_rank, 3, signum, 10), timeout=60,
                           env={MARKER_ENV: marker})
    assert [r["stopped_at"] for r in results] == [3, 3, 3, 3]
    for rank, r in enumerate(results):
        assert r["received"] == (signum if rank == signal_rank else None)
        # After preempted_exit returns, every rank sees the marker rank 0 wrote.
        assert r["code"] == EXIT_PREEMPTED and r["marker"] == "3\n"


def _run_with_request_file(rank, world_size, path, create_at, total_steps):
    """Only rank 0 (the batch host) can see the launcher's file; it appears during `create_at`."""
    guard = PreemptionGuard(request_file=path if rank == 0 else path + ".not-on-this-node")
    for step in range(total_steps):
        if rank == 0 and step == create_at:
            open(path, "w").close()
        if guard.should_stop():
            return step
    return None


@pytest.mark.distributed
def test_stop_request_file_on_one_rank_stops_all(tmp_path):
    steps = run_on_ranks(_run_with_request_file, 4, args=(str(tmp_path / "stop"), 2, 10), timeout=60)
    assert steps == [2, 2, 2, 2]


@pytest.mark.distributed
def test_no_signal_never_stops():
    results = run_on_ranks(_run_steps, 4, args=(-1, 0, signal.SIGUSR1, 5), timeout=60,
                           env={MARKER_ENV: "/nonexistent/marker"})
    assert [r["stopped_at"] for r in results] == [None] * 4


def test_single_process_flag_and_marker(tmp_path, monkeypatch):
    marker = tmp_path / "preempted"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    guard = PreemptionGuard().install()
    try:
        assert not guard.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.requested and guard.should_stop() and guard.should_stop()
    finally:
        guard.uninstall()
    assert guard.preempted_exit(step=7) == EXIT_PREEMPTED
    assert marker.read_text() == "7\n"
    # Handlers restored: SIGUSR1 is back to its previous disposition.
    assert signal.getsignal(signal.SIGUSR1) is not guard._handle


def test_exit_code_is_not_a_common_one():
    # 1/2: Python, 3: train.py without trainer, 124: timeout, 126/127: shell, >128: signals.
    assert EXIT_PREEMPTED not in {0, 1, 2, 3, 124, 126, 127, 255} and EXIT_PREEMPTED < 126


def test_a_signal_before_the_loop_ends_the_process_at_once(tmp_path):
    """The trainer's guard is unarmed until its training loop starts: a SIGTERM while user code
    blocks during the build (a dataset reader that never returns) ends the process with
    128 + SIGTERM instead of being recorded for a step boundary that never comes."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "blocked.py"
    script.write_text(
        "import time\n"
        "from verl_mcore.distributed.preemption import PreemptionGuard\n"
        "guard = PreemptionGuard(armed=False).install()\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n")
    # Started with SIGTERM blocked, as under a supervisor that blocks it: install() unblocks.
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]))
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with open(f"/proc/{proc.pid}/status") as f:
            masks = [line.strip() for line in f if line.startswith(("SigPnd", "ShdPnd", "SigBlk",
                                                                     "SigIgn", "SigCgt"))]
        proc.kill()
        raise AssertionError(f"SIGTERM did not end the process; its signal masks: {masks}")
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 10
