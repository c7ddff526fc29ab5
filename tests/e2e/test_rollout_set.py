"""The rollout engine on ranks of its own (placement.rollout) and one-step-off training (issue 23),
on 4 gloo ranks: the actor on [0, 1] (DP=2), the rollout set on [2, 3] (TP_g=1: 2 replicas).

- sync with a rollout set equals the colocated 2-rank run (actor and engine on [0, 1], the same
  2 generation replicas, prompts and seeds);
- one_step_off equals a reference built here explicitly: the colocated run whose batch s is
  sampled with the actor's weights after max(s - 2, 0) steps (the weights are swapped in for the
  generation and back for training), the actor's old log-probs recomputed, and the same
  truncated importance weights (rollout.tis_cap) against the engine's log-probs;
- a one_step_off run stopped after step 2 and resumed equals the uninterrupted run (the batch
  sampled ahead is in the checkpoint), and so does one whose rollout rank got SIGTERM during
  step 2 (both sets stop after the step with a checkpoint; the requeued run carries on);
- each rollout rank receives exactly its TP_g shard of the weights (the lower bound)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_placement import _assert_same, _rows
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
# Compared step by step (the weight-sync check's numbers differ by design: across sets the
# check samples on the rollout set, colocated on the actor's ranks).
COMPARED = ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean",
            "critic/advantages/mean", "response_length/mean", "rollout/tis_weight_mean",
            "rollout/engine_vs_trainer_logp_diff"]
PLACED = ["placement.actor=[0,1]", "placement.rollout=[2,3]"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("rollout_set") / "model"))


def _overrides(model, run_dir, *extra, steps=3):
    return [f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
            "trainer.val_every=0", "checkpoint.save_every=2", "checkpoint.keep_last=0",
            f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
            "data.val_files=[]", f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py",
            "reward.num_workers=0", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size_per_gpu=2", "algorithm.adv_estimator=grpo", "rollout.n=2",
            "actor.use_kl_loss=true", "rollout.tis_cap=1.5", "actor.optim.lr=1e-3",
            "rollout.logprob_check.num_sequences=2", *extra]


def _train(rank, world_size, overrides, lag, signal_at=None):
    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
    cls = _lagged(Trainer, lag) if lag else Trainer
    if signal_at is not None:
        cls = _signalled(cls, *signal_at)
    return cls(cfg).fit()


def _signalled(base, rank: int, step: int, signum):
    """`rank` receives `signum` (as from Slurm) while it runs step `step`."""
    import os

    class Signalled(base):
        def step(self, s):
            if s == step and self.rank == rank:
                os.kill(os.getpid(), signum)
            return super().step(s)

    return Signalled


def _lagged(base, lag: int):
    """The reference of one_step_off at staleness `lag`: a sync trainer whose batch s is sampled
    with the actor's weights after max(s - 1 - lag, 0) steps."""

    class Lagged(base):
        def _weights(self):
            return [p.detach().clone() for p in self.actor.engine.model[0].parameters()]

        def _load(self, weights):
            for p, w in zip(self.actor.engine.model[0].parameters(), weights):
                p.data.copy_(w)

        def __init__(self, cfg):
            super().__init__(cfg)
            begin, end = self.sampler.begin, self.sampler.end

            def lagged_begin(step, prompt_ids=None):  # the weights of step max(s - 1 - lag, 0)
                if not hasattr(self, "versions"):
                    self.versions = [self._weights()]  # v_0
                self.current = self._weights()
                self._load(self.versions[max(step - 1 - lag, 0)])
                return begin(step, prompt_ids)

            def restoring_end():
                end()
                self._load(self.current)

            self.sampler.begin, self.sampler.end = lagged_begin, restoring_end

        def step(self, step):
            metrics = super().step(step)
            self.versions.append(self._weights())  # v_step
            return metrics

    return Lagged


def _run(overrides, world, lag=0, signal_at=None, code=0):
    assert run_on_ranks(_train, world, args=(overrides, lag, signal_at), timeout=900) == [code] * world


@pytest.mark.distributed
def test_sync_rollout_set_equals_colocated_and_receives_its_shard_only(model, tmp_path):
    colocated, placed = tmp_path / "colocated", tmp_path / "placed"
    _run(_overrides(model, colocated), 2)
    _run(_overrides(model, placed, *PLACED), 4)
    a, b = _rows(colocated), _rows(placed)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in (1, 2, 3):
        _assert_same(a[step], b[step], COMPARED, f"step {step}")
        row = b[step]
        assert "rollout/staleness" not in row  # sync: no lag to report
        # The rollout rank received its TP_g shard of every tensor, no more.
        assert row["rollout/repartition_bytes_received"] == row["rollout/repartition_min_bytes_received"] > 0
        assert row["rollout/logprob_diff_max"] < 1e-4  # the check across the two sets
        assert 0.0 < row["perf/utilisation/rollout"] <= 1.0 and "timing_s/rollout/gen" in row
        for r in (row, a[step]):  # the engine's own stats, from the set that generates
            assert 0.0 < r["rollout/slot_occupancy"] <= 1.0 and r["rollout/peak_live_sequences"] >= 1
            assert r["rollout/preemptions"] == 0.0


@pytest.mark.distributed
def test_one_step_off_equals_the_lagged_reference_and_resumes(model, tmp_path):
    reference, off, resumed = tmp_path / "reference", tmp_path / "off", tmp_path / "resumed"
    mode = ["rollout.mode=one_step_off"]
    _run(_overrides(model, reference, steps=4), 2, lag=1)
    _run(_overrides(model, off, *PLACED, *mode, steps=4), 4)
    a, b = _rows(reference), _rows(off)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        _assert_same(a[step], b[step], COMPARED, f"step {step}")
        assert b[step]["rollout/staleness"] == (0.0 if step == 1 else 1.0)
    # Stale samples: the engine's log-probs are those of older weights from step 2 on.
    assert b[3]["rollout/engine_vs_trainer_logp_diff"] > 10 * b[1]["rollout/engine_vs_trainer_logp_diff"]

    # Stopped after step 2 (its checkpoint holds the batch sampled for step 3), resumed to 4.
    _run(_overrides(model, resumed, *PLACED, *mode, steps=2), 4)
    _run(_overrides(model, resumed, *PLACED, *mode, steps=4), 4)
    c = _rows(resumed)
    assert sorted(c) == [1, 2, 3, 4]
    for step in (3, 4):
        _assert_same(b[step], c[step], COMPARED + ["rollout/staleness"], f"resumed step {step}")

    # Preempted: SIGTERM reaches a rollout rank during step 2; both sets stop after it with a
    # checkpoint (EXIT_PREEMPTED), and the requeued run carries on as if never stopped.
    import signal

    from verl_mcore.distributed.preemption import EXIT_PREEMPTED

    preempted = tmp_path / "preempted"
    overrides = _overrides(model, preempted, *PLACED, *mode, "checkpoint.save_every=0", steps=4)
    _run(overrides, 4, signal_at=(3, 2, signal.SIGTERM), code=EXIT_PREEMPTED)
    assert sorted(_rows(preempted)) == [1, 2]
    _run(overrides, 4)
    d = _rows(preempted)
    assert sorted(d) == [1, 2, 3, 4]
    for step in (3, 4):
        _assert_same(b[step], d[step], COMPARED + ["rollout/staleness"], f"requeued step {step}")


def test_rollout_set_config_errors():
    from verl_mcore.config import Config, ConfigError
    from verl_mcore.config.validate import validate

    def errors(*overrides, world=4):
        cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), list(overrides))
        with pytest.raises(ConfigError) as e:
            validate(cfg, world, data_files=False)
        return str(e.value)

    assert "placement.rollout to the generation ranks" in errors("rollout.mode=one_step_off")
    assert "shares rank(s) 1" in errors("placement.actor=[0,1]", "placement.rollout=[1,2,3]")
    assert "holds rank 0" in errors("placement.actor=[2,3]", "placement.rollout=[0,1]")
    assert "do not divide into replicas" in errors(
        "placement.actor=[0]", "placement.rollout=[1,2,3]", "rollout.tensor_parallel_size=2",
        "parallel.tensor_model_parallel_size=1")
    assert "rollout.tensor_parallel_size (TP_g" in errors(
        "placement.actor=[0,1]", "placement.rollout={ranks: [2,3], tensor_model_parallel_size: 2}")
    assert "rollout.max_staleness=0 must be" in errors("rollout.max_staleness=0")
    assert "rollout.tis_cap=0.0 must be" in errors("rollout.tis_cap=0.0")
