"""Kill a training run with SIGKILL half-way through a save and resume it: the previous checkpoint
must be complete and chosen, and the losses must be bitwise those of a run never interrupted.

Runs of tests/engine/checkpoint_trainer.py (1 rank, dropout on, data drawn from the global
torch / Python / numpy generators, so every RNG state must be restored; checkpoint every step,
keep_last=2):

  reference   STEPS steps, uninterrupted (alongside the others: it only competes for CPU)
  run 1       pauses inside the save of step KILL_IN_SAVE, after every file of that checkpoint is
              written and before its commit; the test sends SIGKILL from outside
  run 2       must resume from step KILL_IN_SAVE - 1 and finishes, with asynchronous saves

Every logged loss of runs 1 and 2 must equal the reference loss of that step exactly.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from verl_mcore.engine import checkpoint as ck

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "engine", "checkpoint_trainer.py")
STEPS = 6
KILL_IN_SAVE = 3
TIMEOUT = 600


def _start(root, log, *extra):
    cmd = [sys.executable, SCRIPT, "--root", root, "--log", log, "--steps", str(STEPS),
           "--world", "1", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # Output to a file, not a pipe: helpers the run started (the checkpoint writer's Manager)
    # outlive a SIGKILLed run and would hold a pipe open. Own session: a kill of the group
    # reaches them.
    out = open(f"{log}.{len(_records(log))}.out", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, stdout=out,
                            stderr=subprocess.STDOUT, text=True)
    proc.output_file = out
    return proc


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _output(proc):
    proc.output_file.seek(0)
    return proc.output_file.read()[-3000:]


def _finish(proc, what):
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
        pytest.fail(f"{what} did not finish in {TIMEOUT}s:\n{_output(proc)}")
    _kill_group(proc)  # whatever a killed run left behind
    return proc.returncode, _output(proc)


def _records(log):
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def _losses(log):
    return {r["step"]: r["loss"] for r in _records(log) if "loss" in r}


def _resumed_from(log):
    return [r["resumed_from"] for r in _records(log) if "resumed_from" in r]


def _kill_when_paused(proc, log):
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(log + ".paused"):
        if proc.poll() is not None:
            pytest.fail(f"run 1 exited ({proc.returncode}) before pausing:\n{_output(proc)}")
        if time.monotonic() > deadline:
            _kill_group(proc)
            pytest.fail(f"run 1 did not reach the save of step {KILL_IN_SAVE} in {TIMEOUT}s")
        time.sleep(0.05)
    _kill_group(proc)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_sigkill_in_save_then_resume_bitwise(tmp_path):
    root, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    ref_root, ref_log = str(tmp_path / "ref_ckpt"), str(tmp_path / "ref_log.jsonl")
    reference = _start(ref_root, ref_log)

    _kill_when_paused(_start(root, log, "--pause-in-save-at", str(KILL_IN_SAVE)), log)
    # The killed save left only its temporary directory (with all its data files); the previous
    # checkpoint is complete, `latest` still names it, and it is the one chosen.
    tmp = os.path.join(root, ck.TMP_PREFIX + ck.checkpoint_name(KILL_IN_SAVE))
    assert os.path.exists(os.path.join(tmp, ck.TRAINER_STATE))
    assert not os.path.exists(os.path.join(root, ck.checkpoint_name(KILL_IN_SAVE)))
    previous = ck.checkpoint_name(KILL_IN_SAVE - 1)
    assert open(os.path.join(root, ck.LATEST)).read().strip() == previous
    assert ck.find_latest_checkpoint(root) == os.path.join(root, previous)

    code, out = _finish(_start(root, log, "--resume", "--async-save"), "run 2")
    assert code == 0, out
    assert _resumed_from(log) == [KILL_IN_SAVE - 1]

    code, out = _finish(reference, "reference run")
    assert code == 0, out
    expected = _losses(ref_log)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert len(set(expected.values())) == STEPS
    got = [r for r in _records(log) if "loss" in r]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r in got:
        assert r["loss"] == expected[r["step"]], (r, expected)
    # keep_last=2 rotation, nothing temporary left, `latest` names the last step.
    assert sorted(os.listdir(root)) == [ck.LATEST, ck.checkpoint_name(STEPS - 1),
                                        ck.checkpoint_name(STEPS)]
    assert ck.find_latest_checkpoint(root) == os.path.join(root, ck.checkpoint_name(STEPS))


def _save_before_first_step(rank, world_size, root):
    from tests.engine import checkpoint_trainer as ct
    from tests.engine.test_checkpoint_layouts import _batches, _children_allowed
    from verl_mcore.engine.checkpoint import Checkpointer

    batches = _batches()
    chunks, optimizer, scheduler = ct.build()
    never_saved = [ct.train_step(chunks, optimizer, scheduler, b) for b in batches[:2]]
    chunks, optimizer, scheduler = ct.build()
    with _children_allowed():
        # Adam has no state yet (PPO's actor during critic warmup, saved every step).
        Checkpointer(root).save(0, chunks, optimizer, scheduler, {"step": 0})
    uninterrupted = [ct.train_step(chunks, optimizer, scheduler, b) for b in batches[:2]]
    chunks, optimizer, scheduler = ct.build()
    with _children_allowed():
        Checkpointer(root).load(chunks, optimizer, scheduler)
    resumed = [ct.train_step(chunks, optimizer, scheduler, b) for b in batches[:2]]
    adam = optimizer.chained_optimizers[0].optimizer
    steps = sorted({float(state["step"]) for state in adam.state.values()})
    return {"never_saved": never_saved, "uninterrupted": uninterrupted, "resumed": resumed,
            "steps": steps}


@pytest.mark.slow
def test_checkpoint_before_the_first_optimizer_step_resumes_bitwise(tmp_path):
    from tests.multiproc import run_on_ranks

    for r in run_on_ranks(_save_before_first_step, 2, (str(tmp_path),), timeout=TIMEOUT):
        # The save leaves the optimizer as it was, and the resumed run is the same run.
        assert r["uninterrupted"] == r["never_saved"]
        assert r["resumed"] == r["uninterrupted"]
        assert r["steps"] == [2.0]


def _descendants(pid):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
def test_sigkill_in_save_leaves_no_helper_processes(tmp_path):
    """SIGKILL to the trainer alone (not its process group, as the OOM killer sends it): the
    checkpoint writer's helpers (its forked writer, the spawned Manager of its write results)
    must die with it. They outlived it before (2 processes, ~270 MB a kill)."""
    import psutil

    root, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    proc = _start(root, log, "--pause-in-save-at", "2")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(log + ".paused"):
            assert proc.poll() is None, _output(proc)
            assert time.monotonic() < deadline, "the run did not reach its save"
            time.sleep(0.05)
        helpers = _descendants(proc.pid)
        assert helpers, "the paused save has no helper processes: the check is void"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone, alive = psutil.wait_procs(helpers, timeout=20)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        _kill_group(proc)
