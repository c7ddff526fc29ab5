"""A full disk under the trainer (a small tmpfs as trainer.run_dir, 1 rank, the tiny model).

Each checkpoint of the tiny model is ~1.66 MB (the planner says 1.45 MB), so a 2600k tmpfs holds
one. The run saves every step:
  1. step 2's save is refused before it starts (the planner's estimate does not fit): a clear
     error with the path, the bytes free and the expected size; step 1 stays intact;
  2. the same command without that check: megatron's writer hits ENOSPC part-way; the same error,
     the unfinished save removed, step 1 intact, config.yaml whole;
  3. space freed (the tmpfs grown): the same command resumes from step 1 and finishes;
  4. a save killed part-way (what the kernel leaves of a dead job) filling the disk: the next
     start removes it and saves in the space it held.
"""
from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.e2e.test_trainer import ROOT, _overrides
from tests.multiproc import run_on_ranks
from tests.tmpfs import small_tmpfs


def _train(rank, world_size, overrides, precheck=True):
    from megatron.core import parallel_state

    from verl_mcore.checkpoints import RunCheckpoints
    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer
    from verl_mcore.utils.files import DiskFullError

    parallel_state.destroy_model_parallel()
    check = RunCheckpoints._check_space
    if not precheck:
        RunCheckpoints._check_space = lambda self, what: None
    try:
        trainer = Trainer(Config.load(str(ROOT / "configs/quickstart.yaml"), overrides))
        resumed_from = trainer.step_index
        return {"code": trainer.fit(), "resumed_from": resumed_from}
    except DiskFullError as e:
        return {"error": str(e)}
    finally:
        RunCheckpoints._check_space = check


def _steps(run_dir, role="actor"):
    root = os.path.join(run_dir, "checkpoints", role)
    return sorted(n for n in os.listdir(root) if not n.startswith("latest"))


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def test_disk_full_is_explained_and_the_same_command_resumes_once_space_is_freed(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    with small_tmpfs(str(tmp_path / "fs"), "2600k") as fs:
        run_dir = os.path.join(fs.path, "run")
        overrides = _overrides(model, run_dir, "grpo", (1, 1, 1)) + [
            "trainer.total_steps=2", "checkpoint.save_every=1", "trainer.val_every=0"]

        [r] = run_on_ranks(_train, 1, args=(overrides,))
        assert r["error"].startswith("disk full: the checkpoint of step 2 does not fit at "
                                     f"{run_dir}/checkpoints: "), r
        assert "bytes) free" in r["error"] and "needs about 1.4 MiB (1451008 bytes)" in r["error"]
        assert "run the same command again" in r["error"]
        assert _steps(run_dir) == ["step_00000001"] and _rows(run_dir) == [1, 2]

        [r] = run_on_ranks(_train, 1, args=(overrides, False))  # into megatron's writer
        assert r["error"].startswith("disk full: the checkpoint of step 2 does not fit"), r
        assert _steps(run_dir) == ["step_00000001"]  # the unfinished save was removed
        with open(os.path.join(run_dir, "config.yaml")) as f:  # whole, not cut at a page
            assert yaml.safe_load(f)["trainer"]["run_dir"] == run_dir

        fs.resize("6m")
        [r] = run_on_ranks(_train, 1, args=(overrides,))
        assert r == {"code": 0, "resumed_from": 1}
        assert _steps(run_dir) == ["step_00000001", "step_00000002"] and _rows(run_dir) == [1, 2]

        # A save of step 3 killed part-way, holding most of what is left.
        dead = os.path.join(run_dir, "checkpoints", "actor", ".tmp.step_00000003", "dist")
        os.makedirs(dead)
        with open(os.path.join(dead, "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * (os.statvfs(fs.path).f_bavail * os.statvfs(fs.path).f_frsize - 300_000))
        [r] = run_on_ranks(_train, 1, args=(overrides[:-3] + ["trainer.total_steps=3",
                                                            "checkpoint.save_every=1"],))
        assert r == {"code": 0, "resumed_from": 2}
        assert _steps(run_dir) == ["step_00000002", "step_00000003"] and _rows(run_dir) == [1, 2, 3]


def _save_with_rank1_full(rank, world_size, run_dir):
    """Step 1 saved; step 2's RNG file fails with ENOSPC on rank 1 only (a node-local quota)."""
    import errno
    from types import SimpleNamespace

    from tests.engine import checkpoint_trainer as ct
    from verl_mcore import checkpoints
    from verl_mcore.config.schema import CheckpointConfig
    from verl_mcore.engine import checkpoint as ck
    from verl_mcore.utils.files import DiskFullError

    chunks, optimizer, scheduler = ct.build()
    role = SimpleNamespace(engine=SimpleNamespace(model=chunks, optimizer=optimizer, scheduler=scheduler))
    run = checkpoints.RunCheckpoints(CheckpointConfig(), run_dir, with_critic=False)
    run.save(1, role, None, {"step": 1})
    real = ck.torch_save_synced

    def full(obj, path):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(obj, path)

    ck.torch_save_synced = full
    try:
        run.save(2, role, None, {"step": 2})
    except DiskFullError as e:
        return str(e)
    finally:
        ck.torch_save_synced = real
    return "saved"


@pytest.mark.slow  # ~18 s: megatron models on 2 fresh ranks
@pytest.mark.distributed
def test_a_full_disk_on_one_rank_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    run_dir = str(tmp_path / "run")
    r0, r1 = run_on_ranks(_save_with_rank1_full, 2, args=(run_dir,))
    assert r1.startswith("disk full: the checkpoint of step 2 does not fit at"), r1
    assert r0.startswith("disk full: the checkpoint of step 2"), r0  # no rank waits on another
    assert _steps(run_dir) == ["step_00000001"]  # step 2's unfinished save removed
