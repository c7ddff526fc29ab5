"""Partial rollouts in real runs (rollout.partial, partial_rollouts.py): the quickstart's tiny
model on CPU.

- Two runs give identical metrics (the stop decision counts finished groups, not clocks), and
  their steps abort and continue samples: every trained token is at most
  rollout.partial.max_staleness versions old, and the metrics say so;
- a run stopped after step 2 and resumed equals the uninterrupted one (its checkpoint holds the
  samples in flight), on 1 rank and over 2 generation replicas (DP_g = 2), and so does one
  preempted by SIGTERM during step 2 and requeued;
- at TP_g = 2 both ranks of the generation group train on the same batches.

The trained batches are recorded by wrapping Learner.train."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_placement import _assert_same, _rows
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
COMPARED = ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean",
            "rollout/token_age/mean", "rollout/token_age/max", "rollout/partial/aborted",
            "rollout/partial/continued", "rollout/partial/resampled",
            "rollout/engine_vs_trainer_logp_diff"]
PARTIAL = ["rollout.partial.enable=true", "rollout.partial.over_sampling=0.5"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("partial") / "model"))


def _overrides(model, run_dir, *extra, steps=4):
    return [f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
            "trainer.val_every=0", "checkpoint.save_every=2", "checkpoint.keep_last=0",
            f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
            "data.val_files=[]", f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py",
            "reward.num_workers=0", "data.train_batch_size=4", "rollout.n=4",
            "actor.ppo_mini_batch_size=2", "actor.micro_batch_size_per_gpu=4",
            "rollout.tis_cap=2.0", "rollout.logprob_check.num_sequences=2",
            # Responses over several of the engine's rounds (16 decoding steps each) and fewer
            # slots than samples in flight: groups finish at different rounds, some wait.
            "data.max_response_length=40", "rollout.max_num_seqs=8", *PARTIAL, *extra]


def _train_recording(rank, world_size, overrides, signal_at=None):
    """(fit's exit code, per trained step: each sample's finish reason, its tokens' versions);
    signal_at (rank, step, signal): that rank receives it during that step."""
    from tests.e2e.test_rollout_set import _signalled
    from verl_mcore.config import Config
    from verl_mcore.learner import Learner
    from verl_mcore.trainer import Trainer

    trained = []
    original = Learner.train

    def train(self, step, rollout, phase, score=None):
        ends = rollout.response_lens.cumsum(0).tolist()
        versions = rollout.token_field("versions").tolist()
        trained.append((step, rollout.finish, [versions[e - int(n):e] for e, n in
                                               zip(ends, rollout.response_lens.tolist())]))
        return original(self, step, rollout, phase, score)

    Learner.train = train
    try:
        cls = Trainer if signal_at is None else _signalled(Trainer, *signal_at)
        code = cls(Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)).fit()
    finally:
        Learner.train = original
    return code, trained


def _run(overrides, world=1, signal_at=None, code=0):
    results = run_on_ranks(_train_recording, world, args=(overrides, signal_at), timeout=900)
    assert [r[0] for r in results] == [code] * world
    return [r[1] for r in results]


def test_partial_runs_are_reproducible_bounded_and_resume_exactly(model, tmp_path):
    a, b, resumed = tmp_path / "a", tmp_path / "b", tmp_path / "resumed"
    [trained] = _run(_overrides(model, a))
    _run(_overrides(model, b))
    ra, rb = _rows(a), _rows(b)
    assert sorted(ra) == [1, 2, 3, 4]
    for step in ra:
        _assert_same(ra[step], rb[step], COMPARED, f"second run, step {step}")
    # Samples were interrupted and continued with newer weights; none trained past the bound.
    assert sum(ra[s]["rollout/partial/aborted"] for s in ra) > 0
    assert sum(ra[s]["rollout/partial/continued"] for s in ra) > 0
    assert any(ra[s]["rollout/token_age/max"] >= 1 for s in ra)
    for step, finish, versions in trained:
        assert len(finish) == 16 and "aborted" not in finish
        # A sample finished at an earlier step may wait for its group: no token newer than the
        # step's weights, none older than max_staleness (1) versions.
        for v in versions:
            assert v and max(v) <= step - 1 and step - 1 - min(v) <= 1, (step, v)
        assert any(len(set(v)) > 1 for v in versions) or step == 1
    for row in ra.values():
        assert row["rollout/token_age/max"] <= 1
        assert row["rollout/partial/in_flight"] == 6  # ceil(4 x 1.5)
        assert 0 < row["rollout/slot_occupancy"] <= 1
    # Stopped after step 2 (the checkpoint holds the groups in flight), resumed to 4.
    _run(_overrides(model, resumed, steps=2))
    _run(_overrides(model, resumed))
    rc = _rows(resumed)
    for step in (3, 4):
        _assert_same(ra[step], rc[step], COMPARED, f"resumed step {step}")


@pytest.mark.distributed
@pytest.mark.slow
def test_two_replicas_resume_and_requeue_exactly_and_tp2_ranks_agree(model, tmp_path):
    dp = ["actor.micro_batch_size_per_gpu=2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(_overrides(model, full, *dp), world=2)
    _run(_overrides(model, resumed, *dp, steps=2), world=2)
    _run(_overrides(model, resumed, *dp), world=2)
    ra, rc = _rows(full), _rows(resumed)
    assert sum(ra[s]["rollout/partial/continued"] for s in ra) > 0
    for step in (3, 4):
        _assert_same(ra[step], rc[step], COMPARED, f"DP_g=2 resumed step {step}")

    # Preempted: SIGTERM reaches rank 1 during step 2; both ranks stop after it with a
    # checkpoint, and the requeued run carries on as if never stopped.
    import signal

    from verl_mcore.distributed.preemption import EXIT_PREEMPTED

    preempted = tmp_path / "preempted"
    overrides = _overrides(model, preempted, *dp, "checkpoint.save_every=0")
    _run(overrides, world=2, signal_at=(1, 2, signal.SIGTERM), code=EXIT_PREEMPTED)
    assert sorted(_rows(preempted)) == [1, 2]
    _run(overrides, world=2)
    rp = _rows(preempted)
    for step in (3, 4):
        _assert_same(ra[step], rp[step], COMPARED, f"DP_g=2 requeued step {step}")

    tp = ["parallel.tensor_model_parallel_size=2", "rollout.tensor_parallel_size=2"]
    first, second = _run(_overrides(model, tmp_path / "tp", *tp, steps=3), world=2)
    assert first == second and len(first) == 3


def test_partial_config_errors():
    from verl_mcore.config import Config, ConfigError, validate

    def errors(*overrides):
        cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), ["rollout.partial.enable=true",
                                                                  *overrides])
        with pytest.raises(ConfigError) as e:
            validate(cfg, 4)
        return str(e.value)

    assert "set rollout.mode=sync" in errors("rollout.mode=one_step_off", "placement.rollout=[2,3]",
                                              "placement.actor=[0,1]")
    assert "unset placement.actor, placement.rollout" in errors(
        "placement.rollout=[2,3]", "placement.actor=[0,1]")
    assert "rollout.engine=native" in errors("rollout.engine=vllm")
    assert "algorithm.filter_groups.enable cannot follow" in errors(
        "algorithm.filter_groups.enable=true")
    assert "remax" in errors("algorithm.adv_estimator=remax")
    assert "rollout.partial.max_staleness" in errors("rollout.partial.max_staleness=-1")


def test_max_staleness_zero_trains_no_older_token(model, tmp_path):
    """max_staleness=0: an unfinished sample starts over at each step (resampled), and every
    trained token is of the step's own weights."""
    [trained] = _run(_overrides(model, tmp_path / "run", "rollout.partial.max_staleness=0",
                                steps=3))
    rows = _rows(tmp_path / "run")
    assert sum(rows[s]["rollout/partial/resampled"] for s in rows) > 0
    assert all(rows[s]["rollout/token_age/max"] == 0 for s in rows)
    for step, _, versions in trained:
        assert all(set(v) == {step - 1} for v in versions)
