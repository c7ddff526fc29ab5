"""Checkpoint directory logic (no megatron): completeness, `latest`, fallback, rotation; RNG.

The checkpoints here are fakes with the files `is_complete` looks at; real saves and loads are in
test_checkpoint_layouts.py (gloo ranks) and test_checkpoint_resume.py (killed training runs).
"""
from __future__ import annotations

import io
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from verl_mcore.engine import checkpoint as ck
from verl_mcore.utils.rng import capture_rng_state, restore_rng_state


def _fake_checkpoint(root, step, complete=True, meta_format=ck.FORMAT):
    path = os.path.join(root, ck.checkpoint_name(step))
    os.makedirs(os.path.join(path, ck.DIST_DIR))
    open(os.path.join(path, ck.DIST_DIR, "metadata.json"), "w").write("{}")
    torch.save({"scheduler": None, "extra": {"step": step}}, os.path.join(path, ck.TRAINER_STATE))
    if complete:
        json.dump({"format": meta_format, "step": step}, open(os.path.join(path, ck.META), "w"))
    return path


def _point_latest(root, name):
    open(os.path.join(root, ck.LATEST), "w").write(name + "\n")


def test_no_checkpoint(tmp_path):
    assert ck.find_latest_checkpoint(str(tmp_path / "missing")) is None
    assert ck.find_latest_checkpoint(str(tmp_path)) is None
    assert ck.list_checkpoints(str(tmp_path)) == []


def test_latest_pointer_is_followed(tmp_path):
    root = str(tmp_path)
    for step in (3, 5, 7):
        _fake_checkpoint(root, step)
    _point_latest(root, ck.checkpoint_name(5))
    # `latest` wins over a higher step number (a resume from an older load_path wrote it last).
    assert ck.find_latest_checkpoint(root) == os.path.join(root, "step_00000005")


def test_incomplete_and_temporary_directories_are_ignored(tmp_path):
    root = str(tmp_path)
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4, complete=False)  # renamed but no meta.json (a hand-copied dir)
    _fake_checkpoint(root, 6, meta_format=ck.FORMAT + 1)  # a format this code cannot read
    os.makedirs(os.path.join(root, ck.TMP_PREFIX + ck.checkpoint_name(8), ck.DIST_DIR))
    assert [s for s, _ in ck.list_checkpoints(root)] == [2]
    assert ck.find_latest_checkpoint(root) == os.path.join(root, "step_00000002")


@pytest.mark.parametrize("pointer", ["step_00000009", "step_00000004", "garbage/../x", ""])
def test_broken_latest_falls_back_to_newest_complete(tmp_path, pointer):
    root = str(tmp_path)
    _fake_checkpoint(root, 1)
    _fake_checkpoint(root, 3)
    _fake_checkpoint(root, 4, complete=False)
    _point_latest(root, pointer)
    assert ck.find_latest_checkpoint(root) == os.path.join(root, "step_00000003")


def test_missing_dist_metadata_is_incomplete(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 1)
    assert ck.is_complete(path)
    os.remove(os.path.join(path, ck.DIST_DIR, "metadata.json"))
    assert not ck.is_complete(path)


def test_rotation_keeps_newest_and_removes_stale_temporaries(tmp_path):
    root = str(tmp_path)
    for step in range(1, 6):
        _fake_checkpoint(root, step)
    _fake_checkpoint(root, 6, complete=False)
    for step in (2, 7):
        os.makedirs(os.path.join(root, ck.TMP_PREFIX + ck.checkpoint_name(step)))
    ck._rotate([root], keep_last=2, current_step=5)
    assert [s for s, _ in ck.list_checkpoints(root)] == [4, 5]
    remaining = sorted(os.listdir(root))
    # The incomplete step 6 is not a checkpoint to rotate; a temporary of a later step may be
    # an async save still in flight; the temporary of step 2 is a killed save.
    assert remaining == [".tmp.step_00000007", "step_00000004", "step_00000005", "step_00000006"]


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    root = str(tmp_path)
    for step in (10, 11, 12):
        _fake_checkpoint(root, step)  # left over from a run that was abandoned at step 12
    _fake_checkpoint(root, 3)  # just written after resuming from an older checkpoint
    ck._rotate([root], keep_last=1, current_step=3)
    assert [s for s, _ in ck.list_checkpoints(root)] == [3, 12]


def test_keep_last_zero_keeps_everything(tmp_path):
    root = str(tmp_path)
    for step in range(1, 5):
        _fake_checkpoint(root, step)
    ck._rotate([root], keep_last=0, current_step=4)
    assert len(ck.list_checkpoints(root)) == 4


def _draw() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist(),
            np.random.randn(2).tolist())


def test_rng_round_trip_through_weights_only_load():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached Gaussian in numpy's state, which must survive too
    buffer = io.BytesIO()
    torch.save(capture_rng_state(), buffer)
    expected = _draw()
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    buffer.seek(0)
    restore_rng_state(torch.load(buffer, weights_only=True))
    assert _draw() == expected


def test_rng_rejects_unknown_format():
    state = capture_rng_state()
    state["format"] = 99
    with pytest.raises(ValueError, match="format"):
        restore_rng_state(state)


# ---------------------------------------------------------------- a run's checkpoints and load_path
# RunCheckpoints.resume on fake checkpoints; a fake load returns the step the checkpoint holds.


@pytest.fixture
def fake_loads(monkeypatch):
    """The paths RunCheckpoints.resume loads, in order (one process, no megatron)."""
    from verl_mcore import checkpoints

    loads = []

    def load(path, *parts, verified=False, role_ranks=None, base_weights=None):
        assert verified  # RunCheckpoints checks every role of a step before loading any
        loads.append(path)
        extra = torch.load(os.path.join(path, ck.TRAINER_STATE), weights_only=True)["extra"]
        return ck.LoadedCheckpoint(path, extra["step"], extra, True, True)

    def verify(path):  # a fake checkpoint is bad when it holds a file named BAD
        if os.path.exists(os.path.join(path, "BAD")):
            raise ck.BadCheckpointError(f"{path}/BAD: planted by the test")

    monkeypatch.setattr(checkpoints, "load_checkpoint", load)
    monkeypatch.setattr(checkpoints, "verify_checkpoint", verify)
    monkeypatch.setattr(ck, "verify_checkpoint", verify)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    return loads


def _run(run_dir, with_critic=True, keep_last=2):
    from verl_mcore.checkpoints import RunCheckpoints
    from verl_mcore.config.schema import CheckpointConfig

    return RunCheckpoints(CheckpointConfig(keep_last=keep_last), str(run_dir), with_critic)


def _resume(run, load_path=None):
    from types import SimpleNamespace

    from verl_mcore.config.schema import CheckpointConfig

    role = SimpleNamespace(engine=SimpleNamespace(model=None, optimizer=None, scheduler=None))
    return run.resume(CheckpointConfig(load_path=load_path and str(load_path)), role, role)


def _commit(run, step, roles=None):
    """Each role's commit of `step` as Checkpointer.save makes it (rename, `latest`, rotation),
    the critic's first; roles: only these (a save killed before the others committed)."""
    for ckpt in roles or [c for c in (run.critic, run.actor) if c is not None]:
        staging = os.path.join(ckpt.root, ".staging")
        tmp = os.path.join(ckpt.root, ck.TMP_PREFIX + ck.checkpoint_name(step))
        os.renames(_fake_checkpoint(staging, step), tmp)
        final = os.path.join(ckpt.root, ck.checkpoint_name(step))
        ckpt._commit_files(ck._PendingSave(step, tmp, final), {})


def _steps(root):
    return [s for s, _ in ck.list_checkpoints(root)]


def test_load_path_is_consumed_once_and_rolls_back_cleanly(tmp_path, fake_loads):
    run = _run(tmp_path / "run")
    actor = run.actor.root
    for step in (2, 4, 6):
        _commit(run, step)
    assert _steps(actor) == [4, 6]
    step4 = os.path.join(actor, ck.checkpoint_name(4))

    # Roll back to step 4: step 6 is an abandoned branch, set aside (not deleted) in both roles.
    assert _resume(run, step4)["step"] == 4
    assert fake_loads[-2:] == [step4, os.path.join(run.critic.root, ck.checkpoint_name(4))]
    for root in (actor, run.critic.root):
        assert _steps(root) == [4]
        assert os.path.isdir(os.path.join(root, "abandoned.step_00000006"))
    assert ck.find_latest_checkpoint(actor) == step4  # `latest` named step 6

    # The new branch rotates as usual: the checkpoint resumed from is not deleted while the
    # abandoned step 6 is kept.
    _commit(run, 5)
    assert _steps(actor) == [4, 5]

    # A requeue with the same command line continues from the run's newest checkpoint.
    assert _resume(run, step4)["step"] == 5
    assert fake_loads[-2] == os.path.join(actor, ck.checkpoint_name(5))
    _commit(run, 6)
    assert _steps(actor) == [5, 6]
    assert _resume(run, step4)["step"] == 6

    # Another load_path is a new request: honoured, and its later steps set aside in turn.
    step5 = os.path.join(actor, ck.checkpoint_name(5))
    assert _resume(run, step5)["step"] == 5
    assert _steps(actor) == [5]
    assert os.path.isdir(os.path.join(actor, "abandoned.step_00000006.1"))

    # Without load_path: the run's newest, as always.
    assert _resume(run)["step"] == 5


def test_load_path_from_another_run_takes_that_runs_critic(tmp_path, fake_loads):
    other, this = _run(tmp_path / "other"), _run(tmp_path / "this")
    _commit(other, 3)
    for step in (3, 10):  # this run's own, older history: neither role may be paired with other's
        _commit(this, step)
    load_path = os.path.join(other.actor.root, ck.checkpoint_name(3))

    assert _resume(this, load_path)["step"] == 3
    assert fake_loads == [load_path, os.path.join(other.critic.root, ck.checkpoint_name(3))]
    # This run's step 10 is later than the step resumed at: set aside, so a requeue before the
    # first save goes back to load_path rather than to that stale step.
    assert _steps(this.actor.root) == [3] and _steps(this.critic.root) == [3]
    assert _resume(this, load_path)["step"] == 3
    assert fake_loads[-2] == load_path

    shutil.rmtree(os.path.join(other.critic.root, ck.checkpoint_name(3)))
    with pytest.raises(FileNotFoundError, match=r"other/checkpoints/critic/step_00000003"):
        _resume(_run(tmp_path / "third"), load_path)


def _plant_bad(root, step):
    open(os.path.join(root, ck.checkpoint_name(step), "BAD"), "w").close()


def test_a_step_with_one_bad_role_is_set_aside_whole(tmp_path, fake_loads):
    run = _run(tmp_path / "run")
    for step in (4, 6):
        _commit(run, step)
    _plant_bad(run.critic.root, 6)
    assert _resume(run)["step"] == 4
    assert fake_loads == [os.path.join(root, "step_00000004")
                          for root in (run.actor.root, run.critic.root)]
    # The bad critic checkpoint is corrupt; the actor's of the same step is set aside with it
    # (it belongs to a continuation that cannot be resumed), and `latest` is repointed.
    assert sorted(os.listdir(run.critic.root)) == ["corrupt.step_00000006", ck.LATEST,
                                                   "step_00000004"]
    assert sorted(os.listdir(run.actor.root)) == ["abandoned.step_00000006", ck.LATEST,
                                                  "step_00000004"]
    for root in (run.actor.root, run.critic.root):
        assert open(os.path.join(root, ck.LATEST)).read().strip() == "step_00000004"


def test_no_good_checkpoint_left_is_an_error_listing_what_was_found(tmp_path, fake_loads):
    run = _run(tmp_path / "run", with_critic=False)
    for step in (4, 6):
        _commit(run, step)
        _plant_bad(run.actor.root, step)
    with pytest.raises(ck.BadCheckpointError, match=r"no usable checkpoint left .*"
                       r"step_00000006: .*step_00000006/BAD: planted by the test; .*"
                       r"step_00000004: .*checkpoint.resume=never"):
        _resume(run)
    assert fake_loads == []
    assert sorted(os.listdir(run.actor.root)) == ["corrupt.step_00000004",
                                                  "corrupt.step_00000006"]


def test_a_bad_load_path_is_refused_not_replaced(tmp_path, fake_loads):
    run = _run(tmp_path / "run")
    for step in (4, 6):
        _commit(run, step)
    _plant_bad(run.actor.root, 4)
    with pytest.raises(ck.BadCheckpointError, match=r"checkpoint.load_path=.*step_00000004: "
                       r"refused, nothing was loaded: .*step_00000004/BAD"):
        _resume(run, os.path.join(run.actor.root, ck.checkpoint_name(4)))
    assert fake_loads == []
    assert _steps(run.actor.root) == [4, 6]  # an explicit choice is never moved


def test_a_bad_step_after_a_consumed_load_path_goes_back_to_load_path(tmp_path, fake_loads):
    run = _run(tmp_path / "run")
    for step in (2, 4):
        _commit(run, step)
    step2 = os.path.join(run.actor.root, ck.checkpoint_name(2))
    assert _resume(run, step2)["step"] == 2  # step 4 set aside as abandoned
    _commit(run, 3)
    _plant_bad(run.actor.root, 3)
    # The requeue would continue from step 3, which is bad: set aside, back to load_path.
    assert _resume(run, step2)["step"] == 2
    assert os.path.isdir(os.path.join(run.actor.root, "corrupt.step_00000003"))


def test_a_role_without_any_checkpoint_is_refused_not_a_fresh_start(tmp_path, fake_loads):
    """A GRPO run resumed with adv_estimator=gae (or with its critic checkpoints deleted): the
    actor has steps, the critic none. Starting fresh trained the actor from scratch over the
    run's checkpoints and metrics (exit 0, a warning); now it is refused and nothing moves."""
    from verl_mcore.config import ConfigError

    grpo = _run(tmp_path / "run", with_critic=False)
    for step in (2, 3):
        _commit(grpo, step)
    ppo = _run(tmp_path / "run", with_critic=True)
    with pytest.raises(ConfigError, match=r"has steps \[2, 3\] but .*critic has none: .*"
                                          r"adv_estimator changed to gae"):
        _resume(ppo)
    assert fake_loads == [] and _steps(grpo.actor.root) == [2, 3]


def test_keep_last_1_a_kill_between_the_roles_commits_leaves_a_step_to_resume(tmp_path, fake_loads):
    """PPO with keep_last=1, killed during the actor's save of step 4 after the critic committed
    it: the critic's commit rotated its step 2 away, leaving actor [2], critic [4], and the run
    could never resume. Rotation now counts only steps every role has."""
    run = _run(tmp_path / "run", keep_last=1)
    _commit(run, 2)
    _commit(run, 4, roles=[run.critic])
    assert _steps(run.actor.root) == [2] and _steps(run.critic.root) == [2, 4]
    assert _resume(run)["step"] == 2
    assert fake_loads == [os.path.join(c.root, "step_00000002") for c in (run.actor, run.critic)]
    _commit(run, 4)  # the resumed run saves step 4 again: now step 2 goes, in both roles
    assert _steps(run.actor.root) == [4] and _steps(run.critic.root) == [4]
    _commit(run, 6)
    assert _steps(run.actor.root) == [6] and _steps(run.critic.root) == [6]


def test_roles_without_a_common_step_are_refused_naming_each_roles_steps(tmp_path, fake_loads):
    """What an earlier verl_mcore left after that kill: no step both roles have."""
    from verl_mcore.config import ConfigError

    run = _run(tmp_path / "run", keep_last=1)
    _commit(run, 2, roles=[run.actor])
    _commit(run, 4, roles=[run.critic])
    with pytest.raises(ConfigError, match=r"actor has steps \[2\] but .*critic has steps \[4\]: "
                                          r"no step has a checkpoint of every role"):
        _resume(run)
    assert fake_loads == []
