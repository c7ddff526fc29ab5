"""The run directory (verl_mcore/run_dir.py): one run at a time, no debris, every start recorded.

A second run on a run directory in use is refused on every rank, naming the holder's host, pid and
Slurm job id; a lock whose holder was SIGKILLed is taken over; checkpoint.resume=never in a used
directory is refused; what dead runs left half-written is removed at start, and what they wrote
completely (checkpoints, metrics) is left alone. The holder of a lock here is often this pytest
process itself (run_dir._lock), a different process from the pool ranks that try to take it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.engine.test_checkpoint import _fake_checkpoint
from tests.multiproc import run_on_ranks
from verl_mcore import run_dir as rd
from verl_mcore.engine import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]


def _cfg(**checkpoint):
    from verl_mcore.config.schema import CheckpointConfig, Config

    return Config(checkpoint=CheckpointConfig(**checkpoint))


def _open(rank, world_size, paths, cfg, local_world_size=None):
    """RunDir.open on each rank (paths[rank]: a different path per rank simulates node-local
    directories); returns the error text or the lock file's holder."""
    import logging

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("verl_mcore.run_dir").addHandler(handler)
    try:
        run = rd.RunDir.open(cfg, paths[rank], local_rank=0 if local_world_size == 1 else rank,
                             local_world_size=local_world_size or world_size)
        run.record_start(cfg)  # as the Trainer does once the inputs passed their checks
    except rd.RunDirError as e:
        return {"error": str(e), "warnings": warnings}
    finally:
        logging.getLogger("verl_mcore.run_dir").removeHandler(handler)
    holder, locked = open(os.path.join(paths[rank], rd.LOCK)).read(), run._fd is not None
    run.close()
    return {"holder": holder, "start": run.start, "warnings": warnings, "locked": locked}


@pytest.fixture
def held(monkeypatch):
    """Take a run directory's lock from this process, as a run of Slurm job 4242 would."""
    fds = []

    def hold(path):
        """Returns the release, as the holder's clean exit does it."""
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        fd, _ = rd._lock(str(path))
        fds.append(fd)

        def release():
            fds.remove(fd)
            rd._unlock(fd)
        return release

    yield hold
    for fd in fds:
        rd._unlock(fd)


def test_second_run_is_refused_naming_the_holder_then_allowed_after_it_ends(tmp_path, held):
    run_dir = tmp_path / "run"
    release = held(run_dir)
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], _cfg()))
    assert f"trainer.run_dir={run_dir} is in use by another run" in r["error"]
    assert f"host {socket.gethostname()}, pid {os.getpid()}, Slurm job 4242" in r["error"]
    assert "scancel 4242" in r["error"] and "its own trainer.run_dir" in r["error"]
    assert not (run_dir / "config.yaml").exists()  # refused before writing anything
    release()  # the holder ends cleanly
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], _cfg()))
    assert json.loads(r["holder"])["pid"] != os.getpid() and r["start"] == 1
    assert not r["warnings"]  # a clean release leaves nothing to report


def test_lock_of_a_sigkilled_job_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, json, os, sys, time
        fd = os.open({str(run_dir / rd.LOCK)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({{"host": "n1", "pid": os.getpid(), "slurm_job_id": "77"}}).encode())
        print("locked", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], _cfg()))
    assert "pid" in r["error"] and "Slurm job 77" in r["error"]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], _cfg()))
    assert "error" not in r, r
    assert any("ended without releasing it" in w and "Slurm job 77" in w for w in r["warnings"])


def test_an_unfinished_trainer_of_the_same_process_is_named(tmp_path):
    run_dir = str(tmp_path / "run")
    [r] = run_on_ranks(_open_twice, 1, args=(run_dir,))
    assert "this very process holds it" in r and "finish()" in r


def _open_twice(rank, world_size, path):
    first = rd.RunDir.open(_cfg(), path, 0, 1)
    try:
        rd.RunDir.open(_cfg(), path, 0, 1)
    except rd.RunDirError as e:
        return str(e)
    finally:
        first.close()
    return "not refused"


def test_resume_never_in_a_used_directory_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    actor = run_dir / "checkpoints" / "actor"
    actor.mkdir(parents=True)
    _fake_checkpoint(str(actor), 3)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], _cfg(resume="never")))
    assert "holds an earlier run" in r["error"] and "steps [3]" in r["error"]
    assert "2 metrics rows" in r["error"] and "checkpoint.resume=auto" in r["error"]
    # Refused: nothing was touched, and the lock was released (an auto resume may take it).
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert ck.list_checkpoints(str(actor))[0][0] == 3
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], _cfg(resume="auto")))
    assert "error" not in r
    # A load_path names where to start: allowed with resume=never.
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], _cfg(resume="never", load_path="/x")))
    assert "error" not in r


def test_debris_of_dead_runs_is_removed_and_every_start_recorded(tmp_path):
    run_dir = tmp_path / "run"
    actor, critic = run_dir / "checkpoints" / "actor", run_dir / "checkpoints" / "critic"
    for root in (actor, critic):
        root.mkdir(parents=True)
        _fake_checkpoint(str(root), 2)
        (root / ".tmp.step_00000004" / "dist").mkdir(parents=True)  # a save killed mid-way
        (root / ".tmp.step_00000004" / "dist" / "__0_0.distcp").write_bytes(b"x" * 1000)
        (root / "latest.tmp.999").write_text("step_00000004")
    (run_dir / "config.yaml.tmp.1234").write_text("cut")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "notes.txt").write_text("mine")
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], _cfg()))
    assert r["start"] == 1
    left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "step_00000002" not in str(p))
    assert left == [".lock", "checkpoints", "checkpoints/actor", "checkpoints/critic",
                    "config.yaml", "configs", "configs/start_0001.yaml", "metrics.jsonl", "notes.txt"]
    assert len([w for w in r["warnings"] if "removed" in w]) == 5
    assert ck.list_checkpoints(str(actor))[0][0] == 2 and ck.list_checkpoints(str(critic))[0][0] == 2
    # The next start gets its own record; config.yaml is the newest.
    cfg = _cfg(keep_last=5)
    [r] = run_on_ranks(_open, 1, args=([str(run_dir)], cfg))
    assert r["start"] == 2
    second = (run_dir / "configs" / "start_0002.yaml").read_text()
    assert second.startswith("# start 2 in this run directory") and "keep_last: 5" in second
    assert (run_dir / "config.yaml").read_text() == second
    assert "keep_last: 2" in (run_dir / "configs" / "start_0001.yaml").read_text()


@pytest.mark.distributed
def test_node_local_directories_are_locked_on_each_node_and_refusals_reach_every_rank(tmp_path, held):
    # Two "nodes" of one rank each: the same path names another directory on each (a, b).
    a, b = str(tmp_path / "node0"), str(tmp_path / "node1")
    r0, r1 = run_on_ranks(_open, 2, args=([a, b], _cfg(), 1))
    assert r0["locked"] and r1["locked"]  # each node locked its own copy
    assert any("node-local" in w and "cannot be resumed" in w for w in r0["warnings"])
    assert json.loads(r1["holder"])["pid"] != os.getpid()
    # Another job holds node 1's copy: both ranks refuse, none hangs.
    held(b)
    r0, r1 = run_on_ranks(_open, 2, args=([a, b], _cfg(), 1))
    assert f"pid {os.getpid()}, Slurm job 4242" in r1["error"]
    assert r0["error"].startswith("rank 1 failed while opening") and "Slurm job 4242" in r0["error"]
    # A directory both nodes share: rank 0's lock covers it, rank 1 finds rank 0's token.
    r0, r1 = run_on_ranks(_open, 2, args=([a, a], _cfg(), 1))
    assert "error" not in r0 and "error" not in r1 and not r0["warnings"]


def test_the_command_line_refuses_a_second_run_before_building_anything(tmp_path, held):
    from tests.e2e.test_trainer import ROOT, _overrides
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    held(run_dir)
    run = subprocess.run(
        [sys.executable, "-m", "verl_mcore.train", "--config", "configs/quickstart.yaml",
         *_overrides(model, run_dir, "grpo", (1, 1, 1))],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"run directory error: trainer.run_dir={run_dir} is in use by another run" in run.stderr
    assert f"pid {os.getpid()}, Slurm job 4242" in run.stderr
    assert "Traceback" not in run.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(os.listdir(run_dir)) == [".lock", "metrics.jsonl"]


def test_a_run_dir_that_is_a_file_is_refused_by_name(tmp_path, monkeypatch):
    from verl_mcore import run_dir as rd

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(rd.RunDirError, match=r"trainer.run_dir=.*afile cannot be used .*File exists"):
        rd._lock(str(afile))
    assert afile.read_text() == "x"


def _start_with_missing_data(rank, world_size, run_dir, model):
    """A Trainer whose train file does not exist, in `run_dir`: its error text."""
    from verl_mcore.config import Config, ConfigError
    from verl_mcore.trainer import Trainer

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={model}", f"trainer.run_dir={run_dir}",
        f"data.train_files=[{run_dir}/no_such.parquet]"])
    try:
        Trainer(cfg)
    except ConfigError as e:
        return str(e)
    return None


def test_a_start_refused_for_its_inputs_leaves_the_run_record_alone(tmp_path):
    """A mistyped data path on an existing run must not overwrite its config.yaml (nor add a
    start record): the record of the run that is there stays what it was."""
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    run_dir = tmp_path / "run"
    (run_dir / "configs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("# start 1: the earlier run\n")
    (run_dir / "configs" / "start_0001.yaml").write_text("# start 1: the earlier run\n")
    [error] = run_on_ranks(_start_with_missing_data, 1, args=(str(run_dir), model))
    assert error is not None and "no_such.parquet" in error
    assert (run_dir / "config.yaml").read_text() == "# start 1: the earlier run\n"
    assert sorted(p.name for p in (run_dir / "configs").iterdir()) == ["start_0001.yaml"]
