"""Fully asynchronous training on a rollout set (rollout.mode=fully_async, fully_async.py) on 4
gloo ranks: the actor on [0, 1] (DP=2), the rollout set on [2, 3] (TP_g=1: 2 replicas), the
quickstart's tiny model with responses long enough to be interrupted.

The reference, constructed explicitly: fully_async's production i samples with v_{max(i-2, 0)}
(fully_async.py's schedule), so its batches are those of the colocated partial-rollout run on
2 ranks (the same 2 generation replicas, prompts, seeds and pools, rollout.partial.enable)
whose step s samples with the actor's weights after max(s - 2, 0) steps (the weights swapped in
for the generation and back for training: test_rollout_set._lagged), with
rollout.partial.max_staleness = rollout.max_staleness. That run labels the tokens of its step s
with version s - 1, one above the weights that really sampled them from step 2 on; fully_async
labels them with the version that sampled them. So:

- fully_async's step s trains exactly the reference's batch s (tokens, finish reasons, and the
  same metrics of the update), each token's version the reference's less one (0 stays 0);
- its pool counts (rollout/partial/*) at step s are the reference's production of A_{s+1}
  (at step 1 those of A_1 and A_2);
- no trained token is more than rollout.max_staleness versions old, and rollout/staleness
  says how old the oldest is;
- a run stopped after step 2 and resumed, and one whose rollout rank got SIGTERM during step 2
  and was requeued, equal the uninterrupted run;
- a failure in the rollout set's pool and one in the actor set's step stop every rank with an
  error naming it, within the collective timeout (no hang).

The trained batches are recorded by wrapping Learner.train."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_placement import _assert_same, _rows
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
UPDATE = ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean",
          "rollout/tis_weight_mean", "rollout/engine_vs_trainer_logp_diff"]
COUNTS = ["rollout/partial/aborted", "rollout/partial/continued", "rollout/partial/resampled"]
PLACED = ["placement.actor=[0,1]", "placement.rollout=[2,3]"]
STALENESS = 2
ASYNC = [*PLACED, "rollout.mode=fully_async", f"rollout.max_staleness={STALENESS}"]
REFERENCE = ["rollout.partial.enable=true", f"rollout.partial.max_staleness={STALENESS}"]
SHORT_TIMEOUT = ["trainer.collective_timeout_s=20"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("fully_async") / "model"))


def _overrides(model, run_dir, *extra, steps=4):
    return [f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
            "trainer.val_every=0", "checkpoint.save_every=2", "checkpoint.keep_last=0",
            f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
            "data.val_files=[]", f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py",
            "reward.num_workers=0", "data.train_batch_size=4", "rollout.n=4",
            "actor.ppo_mini_batch_size=2", "actor.micro_batch_size_per_gpu=2",
            "rollout.tis_cap=2.0", "rollout.logprob_check.num_sequences=2",
            # Responses over several of the engine's rounds (16 decoding steps each) and fewer
            # slots than samples in flight: groups finish at different rounds, some wait.
            "data.max_response_length=40", "rollout.max_num_seqs=8",
            "rollout.partial.over_sampling=0.5", *extra]


def _train_recording(rank, world_size, overrides, lag=0, signal_at=None):
    """(fit's exit code, per trained step: (step, finish reasons, each sample's response tokens
    and their versions)) on this rank."""
    from tests.e2e.test_rollout_set import _lagged, _signalled
    from verl_mcore.config import Config
    from verl_mcore.learner import Learner
    from verl_mcore.trainer import Trainer

    trained = []
    original = Learner.train

    def train(self, step, rollout, phase, score=None):
        ends = rollout.response_lens.cumsum(0).tolist()
        cuts = [(e - int(n), e) for e, n in zip(ends, rollout.response_lens.tolist())]
        versions = rollout.token_field("versions").tolist()
        tokens = rollout.response_ids.tolist()
        trained.append((step, list(rollout.finish), [tokens[a:b] for a, b in cuts],
                        [versions[a:b] for a, b in cuts]))
        return original(self, step, rollout, phase, score)

    Learner.train = train
    try:
        cls = _lagged(Trainer, lag) if lag else Trainer
        if signal_at is not None:
            cls = _signalled(cls, *signal_at)
        code = cls(Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)).fit()
    finally:
        Learner.train = original
    return code, trained


def _run(overrides, world=4, lag=0, signal_at=None, code=0):
    """Rank 0's trained batches."""
    results = run_on_ranks(_train_recording, world, args=(overrides, lag, signal_at), timeout=900)
    assert [r[0] for r in results] == [code] * world, results
    return results[0][1]


def _check_bound(trained, rows):
    """No trained token older than STALENESS versions; rollout/staleness is the oldest's age."""
    for step, finish, _, versions in trained:
        assert "aborted" not in finish
        oldest = min(min(v) for v in versions if v)
        assert all(max(v) <= step - 1 for v in versions if v), step
        assert step - 1 - oldest <= STALENESS, (step, versions)
        assert rows[step]["rollout/staleness"] == step - 1 - oldest
        assert rows[step]["rollout/token_age/max"] <= STALENESS


@pytest.mark.distributed
@pytest.mark.slow
def test_fully_async_equals_the_lagged_partial_reference_and_resumes(model, tmp_path):
    reference, run, resumed = tmp_path / "reference", tmp_path / "run", tmp_path / "resumed"
    # One step more: its production A_5 is what fully_async makes during step 4.
    ref = _run(_overrides(model, reference, *REFERENCE, steps=5), world=2, lag=1)
    got = _run(_overrides(model, run, *ASYNC))
    a, b = _rows(reference), _rows(run)
    assert sorted(b) == [1, 2, 3, 4]
    assert [t[0] for t in got] == [1, 2, 3, 4]
    for (step, finish, tokens, versions), (_, ref_finish, ref_tokens, ref_versions) in zip(got, ref):
        assert finish == ref_finish and tokens == ref_tokens, f"step {step}: another batch"
        assert versions == [[max(v - 1, 0) for v in vs] for vs in ref_versions], f"step {step}"
        _assert_same(a[step], b[step], UPDATE, f"step {step}")
        made = {k: a[step + 1][k] + (a[1][k] if step == 1 else 0.0) for k in COUNTS}
        _assert_same(made, b[step], COUNTS, f"pool counts of step {step}")
    _check_bound(got, b)
    # Samples were interrupted and continued with newer weights, and the oldest tokens trained
    # lag by the bound itself.
    assert sum(b[s]["rollout/partial/continued"] for s in b) > 0
    assert any(len({x for x in v}) > 1 for _, _, _, vs in got for v in vs)
    assert max(b[s]["rollout/staleness"] for s in b) >= 1

    # Stopped after step 2 (the checkpoint holds the pools and the batch handed over for step
    # 3), resumed to 4.
    _run(_overrides(model, resumed, *ASYNC, steps=2))
    again = _run(_overrides(model, resumed, *ASYNC))
    c = _rows(resumed)
    assert [t[0] for t in again] == [3, 4] and again == got[2:]
    for step in (3, 4):
        _assert_same(b[step], c[step], UPDATE + COUNTS + ["rollout/staleness"],
                     f"resumed step {step}")

    # Preempted: SIGTERM reaches a rollout rank during step 2; every rank stops after it with a
    # checkpoint (EXIT_PREEMPTED), and the requeued run carries on as if never stopped.
    import signal

    from verl_mcore.distributed.preemption import EXIT_PREEMPTED

    preempted = tmp_path / "preempted"
    overrides = _overrides(model, preempted, *ASYNC, "checkpoint.save_every=0")
    _run(overrides, signal_at=(3, 2, signal.SIGTERM), code=EXIT_PREEMPTED)
    assert sorted(_rows(preempted)) == [1, 2]
    requeued = _run(overrides)
    d = _rows(preempted)
    assert requeued == got[2:]
    for step in (3, 4):
        _assert_same(b[step], d[step], UPDATE + COUNTS + ["rollout/staleness"],
                     f"requeued step {step}")


@pytest.mark.distributed
def test_a_short_fully_async_run_keeps_the_bound(model, tmp_path):
    """The default tier's case: two steps, every trained token within the bound (~2 s on ranks
    already started by another 4-rank test, as test_rollout_set's; ~50 s when it starts them)."""
    got = _run(_overrides(model, tmp_path / "run", *ASYNC, steps=2))
    rows = _rows(tmp_path / "run")
    assert [t[0] for t in got] == [1, 2]
    _check_bound(got, rows)
    assert rows[1]["rollout/staleness"] == 0.0
    assert rows[2]["rollout/partial/in_flight"] == 6  # 3 groups on each of the 2 replicas


@pytest.mark.distributed
@pytest.mark.slow
def test_one_replica_at_tp_g_2_keeps_the_bound_and_both_trainers_agree(model, tmp_path):
    """The rollout set as one replica of TP_g = 2 (its two ranks hold the same pool; the lead
    speaks for it): the batches reach both actor ranks alike, within the bound."""
    overrides = _overrides(model, tmp_path / "run", *ASYNC, "rollout.tensor_parallel_size=2",
                           steps=3)
    results = run_on_ranks(_train_recording, 4, args=(overrides,), timeout=900)
    assert [r[0] for r in results] == [0] * 4
    first, second = results[0][1], results[1][1]
    assert first == second and [t[0] for t in first] == [1, 2, 3]
    rows = _rows(tmp_path / "run")
    _check_bound(first, rows)
    assert rows[2]["rollout/partial/in_flight"] == 6  # ceil(4 x 1.5) on the one replica


# ---------------------------------------------------------------------------- hostile

def _failing(rank, world_size, overrides, inject):
    """Train with `inject` applied in this process; (error class, first line, seconds)."""
    undo = INJECT[inject](rank)
    t0 = time.monotonic()
    try:
        _train_recording(rank, world_size, overrides)
        return ("ok", "", time.monotonic() - t0)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return (type(e).__name__, str(e).strip().splitlines()[0][:400], time.monotonic() - t0)
    finally:
        undo()


def _pool_fails_on_rank_3(rank):
    """The rollout set's second replica fails in its pool's second production (step 1's A_2,
    made while the actor set trains)."""
    from verl_mcore.rollout.partial import PartialPool

    original, calls = PartialPool.run, []

    def run(self, server, need, version):
        calls.append(1)
        if rank == 3 and len(calls) == 2:
            raise RuntimeError("injected pool failure on rank 3")
        return original(self, server, need, version)

    PartialPool.run = run
    return lambda: setattr(PartialPool, "run", original)


def _update_fails_on_the_actor_set(rank):
    """Step 2's update fails on both actor ranks (as a reward function's error does, on every
    training rank alike: one failing alone would leave its DP peer in the update's collectives,
    whatever the rollout mode), while the rollout set makes the next batch."""
    from verl_mcore.learner import Learner

    original = Learner.train

    def train(self, step, rollout, phase, score=None):
        if rank in (0, 1) and step == 2:
            raise RuntimeError(f"injected update failure on rank {rank}")
        return original(self, step, rollout, phase, score)

    Learner.train = train
    return lambda: setattr(Learner, "train", original)


INJECT = {"pool": _pool_fails_on_rank_3, "update": _update_fails_on_the_actor_set}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("inject,failed", [("pool", {3}), ("update", {0, 1})])
def test_a_failure_on_either_set_stops_every_rank(model, tmp_path, inject, failed):
    """Every rank raises an error that carries the injected one (a failed rank its own, the
    others naming a failed rank), none waits for the collective timeout's watchdog."""
    overrides = _overrides(model, tmp_path / "run", *ASYNC, *SHORT_TIMEOUT, steps=3)
    outcomes = run_on_ranks(_failing, 4, args=(overrides, inject), timeout=300, fresh=True)
    for r, (kind, text, _) in enumerate(outcomes):
        assert kind != "ok", f"rank {r} finished the run: {outcomes}"
        assert "injected" in text, f"rank {r}: {kind}: {text} (all: {outcomes})"
        assert r in failed or any(f"rank {f}" in text for f in failed), \
            f"rank {r} does not name a failed rank {sorted(failed)}: {text}"


def test_fully_async_config_errors():
    from verl_mcore.config import Config, ConfigError
    from verl_mcore.config.validate import validate

    def errors(*overrides):
        cfg = Config.load(str(ROOT / "configs/quickstart.yaml"),
                          ["rollout.mode=fully_async", *overrides])
        with pytest.raises(ConfigError) as e:
            validate(cfg, 4, data_files=False)
        return str(e.value)

    assert "set placement.rollout to the generation ranks" in errors()
    assert "rollout.engine=native" in errors(*PLACED, "rollout.engine=vllm")
    assert "rollout.partial.enable=false" in errors(*PLACED, "rollout.partial.enable=true")
    assert "algorithm.filter_groups.enable cannot follow" in errors(
        *PLACED, "algorithm.filter_groups.enable=true")
    assert "remax" in errors(*PLACED, "algorithm.adv_estimator=remax")
    assert "rollout.max_staleness=0 must be" in errors(*PLACED, "rollout.max_staleness=0")
