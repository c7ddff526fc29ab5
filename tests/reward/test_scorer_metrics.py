"""Reward metrics of a batch scored in parts are the whole batch's (counts summed, an extra's mean
over the samples that have it, a reward model's std pooled):
- Scorer.score over ranks: each rank scores a strided slice of the batch, and a slice may have no
  sample with some extra;
- the producer's generation batches of one step (rollouts._merged, dynamic sampling).
2 gloo ranks, no model; about 2 s once the ranks are up (10 s to start them)."""
from types import SimpleNamespace

import pytest
import torch

from tests.multiproc import run_on_ranks
from tests.reward.test_manager import row
from verl_mcore.config.schema import CustomClassConfig, RewardConfig
from verl_mcore.reward import RewardManager

# A failure (reward/errors), a number, or a dict with the extra `big` from 3 on.
PARTIAL = '''
def partial(data_source, response, ground_truth, extra_info):
    if response.startswith("raise"):
        raise ZeroDivisionError("the scorer failed on " + response)
    value = float(response.split()[-1])
    return {"score": value, "big": value * 10} if value >= 3 else value
'''
# Rank 0 scores samples 0, 2, 4, 6 (two failures, both extras); rank 1 samples 1, 3, 5 (one
# failure, no extra).
RESPONSES = ["raise 1", "1", "raise 2", "2", "3", "raise 3", "4"]


def _config(path) -> RewardConfig:
    return RewardConfig(num_workers=0, max_failed_fraction=0.9,
                        custom_fn=CustomClassConfig(path=path, name="partial"))


def _score_body(rank, world_size, path, parts=((0, len(RESPONSES)),)):
    """(scores, metrics, extras) of Scorer.score of each part (a, b) of RESPONSES."""
    from verl_mcore.scoring import Scorer

    out = []
    with RewardManager.from_config(_config(path)) as manager:
        place = SimpleNamespace(training_ranks=tuple(range(world_size)), training=None)
        scorer = Scorer(None, manager, {}, [], place, None, torch.device("cpu"), rank)
        for a, b in parts:
            rollout = SimpleNamespace(responses=RESPONSES[a:b], rows=[row("math")] * (b - a),
                                      train=None)
            scores, metrics, extras = scorer.score(rollout)
            out.append((scores.tolist(), metrics, extras))
    return out if len(parts) > 1 else out[0][:2]


def test_reward_metrics_on_two_ranks_are_the_whole_batchs(tmp_path):
    path = tmp_path / "partial.py"
    path.write_text(PARTIAL)
    with RewardManager.from_config(_config(str(path))) as m:
        whole = m.score(RESPONSES, [row("math")] * len(RESPONSES))
    assert whole.metrics["reward/errors"] == 3 and whole.metrics["reward/rule/big/mean"] == 35.0
    results = run_on_ranks(_score_body, 2, args=(str(path),), timeout=180)
    for scores, metrics in results:
        assert scores == whole.scores
        for key in ("reward/errors", "reward/timeouts", "reward/invalid", "reward/failed",
                    "reward/score/mean", "reward/rule/mean", "reward/rule/big/mean"):
            assert metrics[key] == pytest.approx(whole.metrics.get(key, 3.0)), key


def test_the_generation_batches_of_a_step_merge_into_the_whole_batchs_metrics(tmp_path):
    """Three generation batches, the extra in the last only, two failures in the first: merged
    as the producer merges them, the metrics of the seven samples scored as one batch."""
    from verl_mcore.rollouts import _merged

    path = tmp_path / "partial.py"
    path.write_text(PARTIAL)
    parts = ((0, 3), (3, 5), (5, 7))
    whole, *pieces = run_on_ranks(_score_body, 2, args=(str(path), ((0, 7),) + parts),
                                  timeout=180)[0]
    merged = _merged([(metrics, len(scores), extras) for scores, metrics, extras in pieces])
    assert pieces[0][1]["reward/errors"] == 2 and "reward/rule/big/mean" not in pieces[0][1]
    assert set(merged) == set(whole[1])
    for key, value in whole[1].items():
        assert merged[key] == pytest.approx(value), key


def test_a_reward_models_std_is_pooled_over_the_batches():
    from verl_mcore.rollouts import _merged

    a, b = torch.tensor([0.0, 1.0, 5.0]), torch.tensor([2.0, 2.5])

    def stats(v):
        return {"reward/rm/mean": float(v.mean()), "reward/rm/std": float(v.std(unbiased=False)),
                "reward/rm/min": float(v.min()), "reward/rm/max": float(v.max())}

    merged = _merged([(stats(a), 3, {}), (stats(b), 2, {})])
    assert merged == pytest.approx(stats(torch.cat([a, b])))


def _rows_read_body(rank, world_size, path):
    """Scorer.score of a real rollout batch of 64 samples: (its scores, how often it built the
    batch's per-sample rows, Rollout.rows: a property laid out from the prompts' rows)."""
    import dataclasses

    from verl_mcore.rollout.batch import Rollout
    from verl_mcore.scoring import Scorer

    n = 64
    rollout = Rollout.from_samples([([1, 2], row("math", truth=str(i)), [3], "stop")
                                    for i in range(n)], vocab_size=16)
    rollout = dataclasses.replace(rollout, responses=[str(i % 5) for i in range(n)])
    reads, rows = [0], Rollout.rows

    def counted(self):
        reads[0] += 1
        return rows.fget(self)

    Rollout.rows = property(counted)
    try:
        with RewardManager.from_config(_config(path)) as manager:
            place = SimpleNamespace(training_ranks=tuple(range(world_size)), training=None)
            scores, _, _ = Scorer(None, manager, {}, [], place, None, torch.device("cpu"),
                                  rank).score(rollout)
    finally:
        Rollout.rows = rows  # the ranks are pooled processes
    return scores.tolist(), reads[0]


def test_the_scorer_reads_a_batchs_rows_once_not_once_per_sample(tmp_path):
    """Rollout.rows lays out [B] rows each time it is read: read per sample, a batch of B
    samples cost O(B^2) (4 s a step at B = 8192 on one scoring rank)."""
    path = tmp_path / "partial.py"
    path.write_text(PARTIAL)
    results = run_on_ranks(_rows_read_body, 2, args=(str(path),), timeout=180)
    for scores, reads in results:
        assert scores == [float(i % 5) for i in range(64)]
        assert reads == 1
