"""The rollout set (placement.rollout) under the layouts and options a verl / NeMo-RL user would
combine with it, on at most 4 gloo ranks, 2-3 steps each (tests/e2e/test_rollout_set.py has the
basic layout: actor [0, 1] TP=1, rollout [2, 3] TP_g=1, GRPO).

Where an equality holds it is checked step by step against a colocated run with the same number
of generation replicas (the same prompts and sampling seeds), or, in one_step_off, against the
colocated run that samples each batch with explicitly lagged weights (test_rollout_set._lagged):
- actor TP=2 into TP_g=1 (two replicas, each merging both shards) and TP_g=2 (one replica);
  actor TP=1 into TP_g=2 (each rollout rank a piece of the actor's tensors);
- actor PP=2 (each stage sends its own layers), also with tied embeddings (held by the first
  and the last stage);
- uneven sets: actor [0, 1] + rollout [2]; actor [0] + rollout [1, 2, 3];
- PPO with the critic on a set of its own, one_step_off; rollout.max_staleness=2; ReMax
  one_step_off (its greedy baseline is sampled ahead too); a LoRA actor;
- validation in one_step_off leaves the training trajectory alone;
- resumes: one_step_off at staleness 2, with ReMax's baselines, with a placed critic; across
  the two layouts, in both directions and both modes.
Hostile: a reward that raises, a weight transfer that corrupts one rollout rank's weights (with
and without a training rank outside the transfer's group), a generation that fails on a rollout
rank that is not the set's first: every rank must stop with an error naming the cause, instead
of waiting in a collective. Those bodies return each rank's error rather than raise it, so a
rank left waiting shows up as a timeout, or as a rank the watchdog ended (exit 86), naming it.

The runs score with a reward that varies from sample to sample (VARIED_REWARD), so that every
step updates the weights the comparisons depend on.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from tests.e2e.test_placement import _resume_from
from tests.e2e.test_rollout_set import (COMPARED, _assert_same, _overrides, _rows, _train,
                                        model)  # noqa: F401 - model: the fixture
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
PLACED = ["placement.actor=[0,1]", "placement.rollout=[2,3]"]
OFF = ["rollout.mode=one_step_off"]
# PPO as tests/e2e/test_placement.py runs it (the placed critic's values pass, colocated too).
PPO = ["algorithm.adv_estimator=gae", "rollout.n=1", "algorithm.lam=0.95",
       "actor.micro_batch_size_per_gpu=1", "critic.micro_batch_size_per_gpu=1",
       "critic.recompute_values=always"]
WITH_CRITIC = ["critic/vf_loss", "critic/grad_norm", "critic/values/mean"]
# The hostile runs: a hang must end well inside the test's own timeout.
SHORT_TIMEOUT = ["trainer.collective_timeout_s=20"]
# The quickstart reward is near 0 for the random tiny model, so most GRPO groups would have zero
# advantages and the updates little to compare; this one varies from sample to sample.
VARIED_REWARD = """def repeat_digit_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 4) / 3.0
"""


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "varied_reward.py"
    path.write_text(VARIED_REWARD)
    return str(path)


def _ov(model, reward, run_dir, *extra, steps=3):
    """test_rollout_set._overrides with the varied reward (`extra` may name another)."""
    return _overrides(model, run_dir, f"reward.custom_fn.path={reward}", *extra, steps=steps)


def _run(overrides, world, lag=0, timeout=600):
    assert run_on_ranks(_train, world, args=(overrides, lag), timeout=timeout) == [0] * world


def _assert_finite(rows: dict):
    for step, row in rows.items():
        for k, v in row.items():
            if isinstance(v, (int, float)):
                assert math.isfinite(v), f"step {step}: {k}={v}"


def _resumed_step_3(overrides, source: Path, target: Path, keys=COMPARED):
    """`source` (3 steps) stopped after step 2 and resumed: its step 3 again."""
    _resume_from(source, target, 2)
    _run(overrides, 4)
    rows = _rows(target)
    assert sorted(rows) == [3], "resumed at step 2"
    _assert_same(_rows(source)[3], rows[3], keys + ["rollout/staleness"], "resumed step 3")


def _compare(a: dict, b: dict, steps, keys=COMPARED):
    assert sorted(a) == sorted(b) == list(steps)
    assert any(b[s]["actor/grad_norm"] > 1e-6 for s in steps), "no update to compare"
    for step in steps:
        _assert_same(a[step], b[step], keys, f"step {step}")


def _placed_equals_colocated(model, reward, tmp_path, colocated_world: int, common, placed):
    """Steps 1-2 of the colocated run on `colocated_world` ranks equal those of the run with
    `placed` added on 4 ranks, each of whose rollout ranks received exactly its shard."""
    colocated, run = tmp_path / "colocated", tmp_path / "placed"
    _run(_ov(model, reward, colocated, *common, steps=2), colocated_world)
    _run(_ov(model, reward, run, *common, *placed, steps=2), 4)
    b = _rows(run)
    _compare(_rows(colocated), b, (1, 2))
    _shard_only(b)


def _shard_only(rows: dict):
    """Each rollout rank received exactly its TP_g shard, and the check across the sets held."""
    for step, row in rows.items():
        got, least = (row[f"rollout/repartition_{k}bytes_received"] for k in ("", "min_"))
        assert got == least > 0, f"step {step}: received {got} bytes, its shard is {least}"
        assert row["rollout/logprob_diff_max"] < 1e-4, step


# ---------------------------------------------------------------------------- layouts (sync)

@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tp_g", [1, 2])
def test_actor_tp2_to_rollout_set_equals_colocated(model, reward, tmp_path, tp_g):
    """TP=2 actor on [0, 1]; TP_g=1: two replicas, each receiving both TP shards of a tensor and
    merging them; TP_g=2: one replica, each rank its own shard. Colocated on 2 ranks at the same
    TP and TP_g has the same replicas."""
    layout = ["parallel.tensor_model_parallel_size=2", f"rollout.tensor_parallel_size={tp_g}"]
    _placed_equals_colocated(model, reward, tmp_path, 2, layout, PLACED)


@pytest.mark.slow
@pytest.mark.distributed
def test_rollout_tp_above_the_actors_equals_colocated(model, reward, tmp_path):
    """Actor [0, 1] at TP=1, rollout [2, 3] at TP_g=2 (one replica): each rollout rank receives
    its piece of the actor's whole tensors (tp_slice on the sender). Colocated TP_g must divide
    TP, so the reference is the 1-rank run (one replica, the same prompts and seeds)."""
    _placed_equals_colocated(model, reward, tmp_path, 1, [],
                             PLACED + ["rollout.tensor_parallel_size=2"])


@pytest.mark.slow
@pytest.mark.distributed
def test_actor_pp2_to_rollout_set_equals_colocated(model, reward, tmp_path):
    """PP=2 actor on [0, 1]: each stage sends the layers it owns to both replicas."""
    layout = ["parallel.pipeline_model_parallel_size=2", "rollout.tensor_parallel_size=1"]
    _placed_equals_colocated(model, reward, tmp_path, 2, layout, PLACED)


def _tied_copy(model: str, out: Path) -> str:
    """The tiny model with tie_word_embeddings (no lm_head.weight in its safetensors)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config))
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        tensors.pop("lm_head.weight", None)
        save_file(tensors, f, metadata={"format": "pt"})
    return str(out)


@pytest.mark.slow
@pytest.mark.distributed
def test_tied_embeddings_pp2_to_rollout_set_equals_colocated(model, reward, tmp_path):
    """Tied embeddings at PP=2: the first and the last stage each hold the word embeddings; the
    rollout model's single copy comes from the first stage, which must equal the last's after
    every update (megatron all-reduces their gradients)."""
    tied = _tied_copy(model, tmp_path / "tied")
    layout = ["parallel.pipeline_model_parallel_size=2", "rollout.tensor_parallel_size=1"]
    colocated, placed = tmp_path / "colocated", tmp_path / "placed"
    _run(_ov(tied, reward, colocated, *layout, steps=3), 2)
    _run(_ov(tied, reward, placed, *layout, *PLACED, steps=3), 4)
    b = _rows(placed)
    _compare(_rows(colocated), b, (1, 2, 3))
    _shard_only(b)


@pytest.mark.slow
@pytest.mark.distributed
def test_uneven_sets_equal_colocated(model, reward, tmp_path):
    """Actor [0, 1] with one rollout rank [2] (one replica: the 1-rank colocated run), and actor
    [0] with three rollout ranks [1, 2, 3] (three replicas: the 3-rank colocated run; 6 prompts
    a step so that each replica gets 2, mini-batches of 3 prompts so that DP=3 splits them)."""
    one, one_placed = tmp_path / "one", tmp_path / "one_placed"
    _run(_ov(model, reward, one, steps=2), 1)
    _run(_ov(model, reward, one_placed, "placement.actor=[0,1]", "placement.rollout=[2]",
             steps=2), 3)
    _compare(_rows(one), _rows(one_placed), (1, 2))
    _shard_only(_rows(one_placed))

    batch = ["data.train_batch_size=6", "actor.ppo_mini_batch_size=3"]
    three, three_placed = tmp_path / "three", tmp_path / "three_placed"
    _run(_ov(model, reward, three, *batch, steps=2), 3)
    _run(_ov(model, reward, three_placed, *batch, "placement.actor=[0]",
                    "placement.rollout=[1,2,3]", steps=2), 4)
    _compare(_rows(three), _rows(three_placed), (1, 2))
    _shard_only(_rows(three_placed))


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_actor_with_rollout_set_equals_colocated(model, reward, tmp_path):
    """LoRA adapters merged on the sending side: the rollout set samples from W + (alpha/r)·B·A,
    in sync (= colocated) and in one_step_off (= the lagged reference)."""
    lora = ["actor.lora.enable=true"]
    _placed_equals_colocated(model, reward, tmp_path, 2, lora, PLACED)

    # one_step_off: the adapters of step s - 1 merged into what the rollout set samples with.
    reference, off = tmp_path / "reference", tmp_path / "off"
    _run(_ov(model, reward, reference, *lora, steps=3), 2, lag=1)
    _run(_ov(model, reward, off, *lora, *PLACED, *OFF, steps=3), 4)
    _compare(_rows(reference), _rows(off), (1, 2, 3))


# ---------------------------------------------------------------------------- one_step_off

@pytest.mark.slow
@pytest.mark.distributed
def test_ppo_with_placed_critic_one_step_off_equals_lagged_reference(model, reward, tmp_path):
    """Actor [0], critic [1], rollout [2, 3] (two replicas), one_step_off: the colocated 2-rank
    PPO run sampling each batch with the weights one step older."""
    reference, off = tmp_path / "reference", tmp_path / "off"
    _run(_ov(model, reward, reference, *PPO, steps=3), 2, lag=1)
    layout = [*PPO, *OFF, "placement.actor=[0]", "placement.critic=[1]", "placement.rollout=[2,3]"]
    _run(_ov(model, reward, off, *layout, steps=3), 4)
    b = _rows(off)
    _compare(_rows(reference), b, (1, 2, 3), COMPARED + WITH_CRITIC)
    _assert_finite(b)
    assert [b[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    resumed = tmp_path / "resumed"
    _resumed_step_3(_ov(model, reward, resumed, *layout, steps=3), off, resumed,
                    COMPARED + WITH_CRITIC)


@pytest.mark.slow
@pytest.mark.distributed
def test_max_staleness_2_equals_lagged_reference(model, reward, tmp_path):
    """rollout.max_staleness=2: step 1 samples B1..B3 with v0, step s samples B_{s+2} with
    v_{s-1}, so step 3 trains B3 of v0 (staleness 2). Resumed after step 2, whose checkpoint
    holds two batches sampled ahead (B3 of v0, B4 of v1), step 3 is the same."""
    reference, off = tmp_path / "reference", tmp_path / "off"
    layout = [*PLACED, *OFF, "rollout.max_staleness=2"]
    _run(_ov(model, reward, reference, steps=3), 2, lag=2)
    _run(_ov(model, reward, off, *layout, steps=3), 4)
    b = _rows(off)
    _compare(_rows(reference), b, (1, 2, 3))
    assert [b[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 2.0]
    resumed = tmp_path / "resumed"
    _resumed_step_3(_ov(model, reward, resumed, *layout, steps=3), off, resumed)


@pytest.mark.slow
@pytest.mark.distributed
def test_remax_one_step_off_equals_lagged_reference(model, reward, tmp_path):
    """ReMax: the greedy baseline of each batch is sampled ahead with the same weights as its
    samples, and saved with them in the checkpoint (a resumed step 3 is the same)."""
    remax = ["algorithm.adv_estimator=remax"]
    reference, off = tmp_path / "reference", tmp_path / "off"
    _run(_ov(model, reward, reference, *remax, steps=3), 2, lag=1)
    _run(_ov(model, reward, off, *remax, *PLACED, *OFF, steps=3), 4)
    b = _rows(off)
    _compare(_rows(reference), b, (1, 2, 3))
    _assert_finite(b)
    resumed = tmp_path / "resumed"
    _resumed_step_3(_ov(model, reward, resumed, *remax, *PLACED, *OFF, steps=3), off, resumed)


@pytest.mark.slow
@pytest.mark.distributed
def test_validation_in_one_step_off_leaves_training_alone(model, reward, tmp_path):
    """trainer.val_every=1 (and val_before_train) in one_step_off: the validation's weight
    transfer and sampling on the rollout set between steps changes nothing of the training (the
    lagged reference has no validation), and the val metrics are logged, finite."""
    val = ["trainer.val_every=1", "trainer.val_before_train=true",
           f"data.val_files=[{ROOT}/examples/data/quickstart_val.parquet]"]
    reference, off = tmp_path / "reference", tmp_path / "off"
    _run(_ov(model, reward, reference, steps=3), 2, lag=1)
    _run(_ov(model, reward, off, *PLACED, *OFF, *val, steps=3), 4)
    b = _rows(off)
    _assert_finite(b)
    assert any(k.startswith("val/") for k in b.pop(0, {})), "no val/ metrics before training"
    _compare(_rows(reference), b, (1, 2, 3))
    for step in (1, 2, 3):
        assert any(k.startswith("val/") for k in b[step]), f"step {step}: no val/ metrics"


@pytest.mark.slow
@pytest.mark.distributed
def test_one_step_off_across_an_epoch_boundary(model, reward, tmp_path):
    """8 prompts, 4 a step: the batch sampled ahead at step 2 (B3) is the next epoch's first
    (reshuffled), and the step-2 checkpoint's loader position is the end of epoch 1."""
    import pandas as pd

    small = tmp_path / "small.parquet"
    pd.read_parquet(ROOT / "examples/data/quickstart_train.parquet").head(8).to_parquet(small)
    data = [f"data.train_files=[{small}]"]
    reference, off, resumed = tmp_path / "reference", tmp_path / "off", tmp_path / "resumed"
    _run(_ov(model, reward, reference, *data, steps=3), 2, lag=1)
    layout = [*data, *PLACED, *OFF]
    _run(_ov(model, reward, off, *layout, steps=3), 4)
    _compare(_rows(reference), _rows(off), (1, 2, 3))
    _resumed_step_3(_ov(model, reward, resumed, *layout, steps=3), off, resumed)


# ---------------------------------------------------------------------------- resume across layouts

@pytest.mark.slow
@pytest.mark.distributed
def test_rollout_set_resumes_from_a_colocated_checkpoint(model, reward, tmp_path):
    """From a colocated sync checkpoint (step 2) to a rollout set: sync, and one_step_off (no
    batch was sampled ahead: step 3 samples B3 with v2, staleness 0), both equal the colocated
    step 3."""
    colocated = tmp_path / "colocated"
    _run(_ov(model, reward, colocated, steps=3), 2)
    a = _rows(colocated)
    for name, mode in (("placed_sync", []), ("placed_off", OFF)):
        target = tmp_path / name
        _resume_from(colocated, target, 2)
        _run(_ov(model, reward, target, *PLACED, *mode, steps=3), 4)
        rows = _rows(target)
        assert sorted(rows) == [3], f"{name}: resumed at step 2"
        _assert_same(a[3], rows[3], COMPARED, f"{name} step 3")
        assert rows[3].get("rollout/staleness", 0.0) == 0.0


@pytest.mark.slow
@pytest.mark.distributed
def test_colocated_resumes_from_a_one_step_off_checkpoint(model, reward, tmp_path):
    """From a one_step_off checkpoint (B3, sampled with v1, is in it) to the colocated 2-rank sync
    run (2 replicas): step 3 trains the saved B3 with v2, as the uninterrupted run did."""
    off, target = tmp_path / "off", tmp_path / "colocated_from_off"
    _run(_ov(model, reward, off, *PLACED, *OFF, steps=3), 4)
    _resume_from(off, target, 2)
    _run(_ov(model, reward, target, steps=3), 2)
    rows = _rows(target)
    assert sorted(rows) == [3]
    _assert_same(_rows(off)[3], rows[3], COMPARED, "colocated from one_step_off, step 3")


# ---------------------------------------------------------------------------- hostile

def _failing(rank, world_size, overrides, inject):
    """Train with `inject` applied in this process; return (error class, first line, seconds)
    instead of raising, so that every rank's outcome reaches the test (a rank that stops
    alone would otherwise hide the ones left waiting)."""
    undo = INJECT[inject](rank) if inject else (lambda: None)
    t0 = time.monotonic()
    try:
        _train(rank, world_size, overrides, 0)
        return ("ok", "", time.monotonic() - t0)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return (type(e).__name__, str(e).strip().splitlines()[0][:400], time.monotonic() - t0)
    finally:
        undo()


def _corrupt_transfer_on_rank_3(rank):
    """The cross-set transfer writes wrong weights on rollout rank 3 (the second replica, not
    the set's first rank) after every transfer."""
    import torch

    from verl_mcore.rollout.cross_set import CrossSetTransfer

    original = CrossSetTransfer.run

    def run(self):
        stats = original(self)
        if self.receives and self.rank == 3:
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in self.gen_params.values():
                    p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        return stats

    CrossSetTransfer.run = run
    return lambda: setattr(CrossSetTransfer, "run", original)


def _generation_fails_on_rank_3(rank):
    """Sampling (not the weight-sync check) raises on rollout rank 3."""
    from verl_mcore.generation import GenerationPhase

    original = GenerationPhase.generate

    def generate(self, prompt_ids, sampling):
        if rank == 3:
            raise RuntimeError("injected generation failure on rank 3")
        return original(self, prompt_ids, sampling)

    GenerationPhase.generate = generate
    return lambda: setattr(GenerationPhase, "generate", original)


def _check_fails_on_rank_3(rank):
    """The engine raises on rollout rank 3 in its first call, which is the weight-sync check's
    sampling (begin runs it before the batch is sampled)."""
    from verl_mcore.rollout.native import NativeEngine

    original, calls = NativeEngine.generate, []

    def generate(self, prompt_ids, sampling):
        calls.append(1)
        if rank == 3 and len(calls) == 1:
            raise RuntimeError("injected failure in the check's sampling on rank 3")
        return original(self, prompt_ids, sampling)

    NativeEngine.generate = generate
    return lambda: setattr(NativeEngine, "generate", original)


INJECT = {"corrupt_transfer": _corrupt_transfer_on_rank_3,
          "generation_fails": _generation_fails_on_rank_3,
          "check_fails": _check_fails_on_rank_3}


def _outcomes(overrides, inject=None, timeout=120):
    """Each rank's (error class, message, seconds); a rank still waiting after `timeout` fails
    the test naming it (run_on_ranks)."""
    return run_on_ranks(_failing, 4, args=(overrides, inject), timeout=timeout, fresh=True)


def _assert_every_rank_stopped(outcomes, names, words):
    for rank, (kind, text, _) in enumerate(outcomes):
        assert kind != "ok", f"rank {rank} finished the run: {outcomes}"
        assert kind in names or any(w in text.lower() for w in words), \
            f"rank {rank}: {kind}: {text} (all: {outcomes})"


@pytest.mark.slow
@pytest.mark.distributed
def test_reward_failure_in_one_step_off_stops_every_rank(model, reward, tmp_path):
    reward = tmp_path / "raising_reward.py"
    reward.write_text("def repeat_digit_score(data_source, solution_str, ground_truth, "
                      "extra_info=None):\n    raise ValueError('injected reward failure')\n")
    overrides = _ov(model, reward, tmp_path / "run", *PLACED, *OFF, *SHORT_TIMEOUT,
                           f"reward.custom_fn.path={reward}", steps=2)
    _assert_every_rank_stopped(_outcomes(overrides), {"RewardFailureError"}, ["reward"])


@pytest.mark.slow
@pytest.mark.distributed
def test_corrupted_weight_transfer_stops_every_rank(model, reward, tmp_path):
    """The check across the sets catches a replica that is not the set's first, and every rank
    of both sets raises WeightSyncError."""
    overrides = _ov(model, reward, tmp_path / "run", *PLACED, *OFF, *SHORT_TIMEOUT, steps=2)
    _assert_every_rank_stopped(_outcomes(overrides, "corrupt_transfer"), {"WeightSyncError"},
                               ["weight sync"])


@pytest.mark.slow
@pytest.mark.distributed
def test_corrupted_weight_transfer_stops_the_critic_set_too(model, reward, tmp_path):
    overrides = _ov(model, reward, tmp_path / "run", *PPO, *OFF, *SHORT_TIMEOUT,
                           "placement.actor=[0]", "placement.critic=[1]",
                           "placement.rollout=[2,3]", steps=2)
    _assert_every_rank_stopped(_outcomes(overrides, "corrupt_transfer"), {"WeightSyncError"},
                               ["weight sync"])


@pytest.mark.slow
@pytest.mark.distributed
def test_generation_failure_on_a_second_rollout_rank_stops_every_rank(model, reward, tmp_path):
    overrides = _ov(model, reward, tmp_path / "run", *PLACED, *OFF, *SHORT_TIMEOUT, steps=2)
    _assert_every_rank_stopped(_outcomes(overrides, "generation_fails"),
                               {"GenerationFailure", "RuntimeError"}, ["generat"])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failure_inside_the_cross_set_check_stops_every_rank(model, reward, tmp_path):
    """The check's own sampling fails on one rollout rank: the other rollout rank (in the
    set's gather), the actor set (waiting for the check's sequences) and then every rank (at the
    batch's hand-over) stop naming it."""
    overrides = _ov(model, reward, tmp_path / "run", *PLACED, *OFF, *SHORT_TIMEOUT, steps=2)
    outcomes = _outcomes(overrides, "check_fails")
    _assert_every_rank_stopped(outcomes, {"RuntimeError", "GenerationFailure"}, ["check"])
    assert all("rank 3" in text for _, text, _ in outcomes), outcomes
