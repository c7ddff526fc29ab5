"""Group filters and DAPO's dynamic sampling (rollout/group_filter.py, prompt_group.py): verl's
keep rule and refill loop against a transcription of verl's, metrics from reward extras, the
refill limit both ways, the surplus, the user's filter, the start-up checks and the config keys.
CPU only, no model; about 5 s, most of it the import probes of the start-up tests."""
from __future__ import annotations

import logging
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.config.schema import RewardConfig, RewardSourceConfig
from verl_mcore.reward import RewardManager
from verl_mcore.reward.builtin import EXTRAS, default_compute_score
from verl_mcore.reward.scorers import check_result
from verl_mcore.rollout.group_filter import (FilterExhaustedError, GroupAccumulator,
                                             GroupFilterError, GroupFilters, GroupMetric,
                                             ZeroStdFilter, resolve_metric)
from verl_mcore.rollout.prompt_group import groups_from_batch
from verl_mcore.user_code import UserCodeError

ROOT = Path(__file__).resolve().parents[2]
ROW = {"data_source": "math_dapo", "reward_model": {"ground_truth": "1"}}


def batch(values, n, gen_batch=0, extras=None, finish=None):
    """One generation batch of len(values) // n groups of n consecutive samples."""
    size = len(values)
    return groups_from_batch(torch.arange(size) // n, torch.tensor(values, dtype=torch.float32),
                             [f"r{i}" for i in range(size)], [dict(ROW, index=i // n) for i in range(size)],
                             finish or ["stop"] * size, torch.full((size,), 5), extras, gen_batch)


def score_filter() -> GroupFilters:
    return GroupFilters((ZeroStdFilter(GroupMetric("score", None)),))


# ------------------------------------------------------------------ verl's rule and loop

def verl_dynamic_sampling(batches, target, n, max_num_gen_batches):
    """recipe/dapo/dapo_ray_trainer.py's loop, transcribed: batches of (uids [B], metric [B]);
    the (generation batch, sample) of each trajectory it trains on, or its ValueError."""
    kept_samples, num_prompt_in_batch, num_gen_batches = [], 0, 0
    for b, (uids, values) in enumerate(batches):
        num_gen_batches += 1
        metric_vals = defaultdict(list)
        for uid, value in zip(uids, values):
            metric_vals[uid].append(value)
        kept_uids = [uid for uid, vals in metric_vals.items()
                     if np.std(vals) > 0 or len(vals) == 1]
        num_prompt_in_batch += len(kept_uids)
        kept_samples += [(b, i) for i, uid in enumerate(uids) if uid in kept_uids]
        if num_prompt_in_batch < target:
            if max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches:
                continue
            raise ValueError(f"{num_gen_batches=} >= {max_num_gen_batches=}")
        return kept_samples[:target * n]
    raise AssertionError("the test ran out of batches")


def ours(batches, target, n, max_num_gen_batches):
    acc = GroupFilters((ZeroStdFilter(GroupMetric("score", None)),), max_num_gen_batches).accumulator(target)
    for b, (_, values) in enumerate(batches):
        acc.add(batch(values, n, gen_batch=b))
        if acc.done:
            return [(g.gen_batch, i) for g in acc.take() for i in g.samples]
    raise AssertionError("the test ran out of batches")


@pytest.mark.parametrize("seed", range(40))
def test_verl_keep_rule_and_refill_on_random_scores(seed):
    """Random 0/1, +-1 and mixed rewards, many of them uniform groups: the same trajectories
    in the same order as verl's loop, or the same exhaustion."""
    rng = random.Random(seed)
    n, prompts, target = rng.choice([1, 2, 4, 8]), rng.randint(1, 6), rng.randint(1, 8)
    levels = rng.choice([(0.0, 1.0), (-1.0, 1.0), (0.0, 0.25, 0.5, 1.0)])
    easy = rng.random()  # how often a whole group gets one value
    batches = []
    for _ in range(30):
        values = []
        for _ in range(prompts):
            one = rng.choice(levels)
            values += [one if rng.random() < easy else rng.choice(levels) for _ in range(n)]
        batches.append(([i // n for i in range(prompts * n)], values))
    limit = rng.choice([0, 1, 2, 5])
    try:
        expected = verl_dynamic_sampling(batches, target, n, limit)
    except ValueError:
        with pytest.raises(FilterExhaustedError):
            ours(batches, target, n, limit)
        return
    assert ours(batches, target, n, limit) == expected


def test_uniform_groups_are_dropped_and_one_sample_groups_kept():
    acc = score_filter().accumulator(10)
    acc.add(batch([1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, -1, -1, -1, 3], 4))
    assert [g.index for g in acc.kept] == [2, 3]
    assert acc.metrics()["rollout/filter/dropped/zero_std"] == 2
    single = score_filter().accumulator(10)
    single.add(batch([1.0, 1.0, 1.0], 1))
    assert len(single.kept) == 3  # a group of one sample: no spread to ask for (verl)


def test_equal_values_are_dropped_where_numpy_std_rounds_above_zero():
    """The one documented difference from verl's rule: np.std of three 0.1s is 1.4e-17 > 0."""
    assert np.std([0.1] * 3) > 0
    acc = GroupAccumulator(5, [ZeroStdFilter(GroupMetric("rule/x", "rule/x"))])
    acc.add(batch([0, 1, 2], 3, extras={"rule/x": [0.1] * 3}))
    assert acc.kept == [] and acc.dropped["zero_std"] == 1


# ------------------------------------------------------------------ the metric

def test_acc_resolves_to_the_one_source_and_falls_back_to_the_score():
    metric = resolve_metric("acc", {"rule": frozenset({"acc"})})
    assert (metric.key, metric.score_if_missing) == ("rule/acc", True)
    acc = GroupAccumulator(10, [ZeroStdFilter(metric)])
    # overlong-shaped scores differ, acc is uniform: dropped on acc
    acc.add(batch([1.0, 0.8, -1.0, -1.0], 2, extras={"rule/acc": [1.0, 1.0, 0.0, 1.0]}))
    assert [g.index for g in acc.kept] == [1]
    # a scorer that returned a number (GSM8K): no acc extra at all, its score is its acc (verl)
    acc.add(batch([1.0, 0.0, 1.0, 1.0], 2, gen_batch=1))
    assert [(g.gen_batch, g.index) for g in acc.kept] == [(0, 1), (1, 0)]
    # the same batches by score keep the shaped group too
    by_score = score_filter().accumulator(10)
    by_score.add(batch([1.0, 0.8, -1.0, -1.0], 2, extras={"rule/acc": [1.0, 1.0, 0.0, 1.0]}))
    assert [g.index for g in by_score.kept] == [0]


def test_a_reward_extra_missing_from_the_batch_is_named_with_the_keys_there():
    acc = GroupAccumulator(4, [ZeroStdFilter(resolve_metric("judge/format", {"judge": None, "rule": frozenset()}))])
    with pytest.raises(GroupFilterError) as e:
        acc.add(batch([1, 0], 2, extras={"judge/other": [1.0, 0.0]}))
    assert "algorithm.filter_groups.metric='judge/format'" in str(e.value)
    assert "'judge/format'" in str(e.value) and "['judge/other']" in str(e.value)


def test_samples_without_the_extra_count_as_their_own_value():
    acc = GroupAccumulator(10, [ZeroStdFilter(GroupMetric("j/f", "j/f"))])
    acc.add(batch([0] * 6, 2, extras={"j/f": [1.0, None, None, None, 1.0, 1.0]}))
    assert [g.index for g in acc.kept] == [0]
    assert acc.dropped == {"zero_std": 1, "missing_metric": 1}


@pytest.mark.parametrize("metric, sources, message", [
    ("acc", {"rule": frozenset(), "rm": frozenset()}, "no reward source can give an extra 'acc'"),
    ("format", {"rule": frozenset({"acc"})}, "'rule' gives acc"),
    ("acc", {"a": None, "b": None}, "several reward sources may give it (a, b)"),
    ("judge/acc", {"rule": frozenset({"acc"})}, "names no reward source (['rule'])"),
    ("rule/pred", {"rule": frozenset({"acc"})}, "source 'rule' cannot give the extra 'pred'"),
])
def test_a_metric_that_cannot_exist_fails_at_start_up(metric, sources, message):
    with pytest.raises(ConfigError) as e:
        resolve_metric(metric, sources)
    assert f"algorithm.filter_groups.metric={metric!r}" in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("metric, key", [("score", None), ("seq_reward", None),
                                         ("seq_final_reward", None), ("acc", "rm/acc"),
                                         ("format", "judge/format"), ("rule/acc", "rule/acc")])
def test_metrics_that_exist(metric, key):
    assert resolve_metric(metric, {"rule": frozenset({"acc"}), "judge": None,
                                   "rm": frozenset()} if metric != "acc" else
                          {"rm": frozenset()}).key == key


def test_the_reward_manager_says_which_extras_its_sources_give():
    builtin = RewardManager.from_config(RewardConfig(num_workers=0))
    assert builtin.extra_keys() == {"rule": EXTRAS}
    placed = RewardManager.from_config(RewardConfig(num_workers=0, sources=[
        RewardSourceConfig(name="rule"), RewardSourceConfig(name="rm", type="reward_model", path="x")]),
        scored_outside=["rm"])
    assert placed.extra_keys() == {"rule": EXTRAS, "rm": frozenset()}
    assert RewardManager.from_config(RewardConfig(num_workers=0), score_fn=lambda *a: 1.0).extra_keys() == {"rule": None}


def test_the_builtin_scorers_give_no_extra_beyond_EXTRAS():
    cases = [("math_dapo", "Answer: 3", "3"), ("aime24", "x", "3"), ("openai/gsm8k", "#### 3", "3"),
             ("lighteval/MATH", r"\boxed{3}", "3")]
    for source, response, truth in cases:
        _, extras = check_result(default_compute_score(source, response, truth, {}))
        assert set(extras) <= EXTRAS, (source, extras)
    assert check_result(default_compute_score("math_dapo", "Answer: 3", "3", {}))[1] == {"acc": 1.0}


# ------------------------------------------------------------------ refill, exhaustion, surplus

def test_the_surplus_is_dropped_not_carried():
    filters = GroupFilters((ZeroStdFilter(GroupMetric("score", None)),), max_gen_batches=3)
    acc = filters.accumulator(2)
    acc.add(batch([1, 1, 0, 1], 2))  # 1 kept
    assert not acc.done
    acc.add(batch([0, 1, 1, 0, 1, 0], 2, gen_batch=1))  # 3 more: full, 2 surplus
    taken = acc.take()
    assert [(g.gen_batch, g.index) for g in taken] == [(0, 1), (1, 0)]
    m = acc.metrics()
    assert m["rollout/filter/surplus_groups"] == 2 and m["rollout/filter/trained_groups"] == 2
    assert m["rollout/filter/gen_batches"] == 2 and m["rollout/filter/kept_groups"] == 4
    assert m["rollout/filter/groups"] == 5 and m["rollout/filter/kept_fraction"] == 0.8
    assert m["rollout/filter/short_batch"] == 0 and m["rollout/filter/dropped/zero_std"] == 1
    nxt = filters.accumulator(2)  # the next step starts empty
    assert nxt.kept == [] and nxt.metrics()["rollout/filter/gen_batches"] == 0
    with pytest.raises(RuntimeError, match="take"):
        acc.add(batch([0, 1], 2))


def test_exhaustion_with_on_max_error_names_the_counts():
    acc = GroupFilters((ZeroStdFilter(GroupMetric("score", None)),), 2, "error").accumulator(3)
    acc.add(batch([1, 1, 0, 1], 2))
    acc.add(batch([0, 0], 2, gen_batch=1))
    assert acc.exhausted and acc.done
    with pytest.raises(FilterExhaustedError) as e:
        acc.take()
    assert "1 of 3 prompt groups (data.train_batch_size) kept after 2 generation batches" in str(e.value)
    assert "max_num_gen_batches=2" in str(e.value) and "2 zero_std" in str(e.value)


def test_exhaustion_with_on_max_train_trains_on_fewer(caplog):
    acc = GroupFilters((ZeroStdFilter(GroupMetric("score", None)),), 2, "train").accumulator(3)
    acc.add(batch([1, 1, 0, 1], 2))
    acc.add(batch([0, 0, 1, 0], 2, gen_batch=1))
    with caplog.at_level(logging.WARNING, logger="verl_mcore.rollout.group_filter"):
        taken = acc.take()
    assert [(g.gen_batch, g.index) for g in taken] == [(0, 1), (1, 1)]
    assert acc.metrics()["rollout/filter/short_batch"] == 1.0
    assert "training on 2 groups" in caplog.text
    empty = GroupFilters((ZeroStdFilter(GroupMetric("score", None)),), 1, "train").accumulator(3)
    empty.add(batch([1, 1], 2))
    with pytest.raises(FilterExhaustedError, match="nothing to train on"):
        empty.take()


def test_decisions_made_elsewhere_are_taken_as_given():
    """The producer's other ranks add a batch with the first rank's decisions (decide), without
    running the filters themselves."""
    filters = GroupFilters((ZeroStdFilter(GroupMetric("score", None)),))
    groups = batch([1, 1, 0, 1, 0, 0], 2)
    assert filters.accumulator(3).decide(groups) == ["zero_std", None, "zero_std"]
    acc = filters.accumulator(3)
    acc.add(groups, [None, "zero_std", None])  # not what these filters would decide
    assert [g.index for g in acc.kept] == [0, 2]
    assert acc.metrics()["rollout/filter/dropped/zero_std"] == 1
    with pytest.raises(ValueError, match="2 decisions for 3 groups"):
        filters.accumulator(3).add(groups, [None, None])


def test_no_limit_keeps_sampling():
    acc = GroupFilters((ZeroStdFilter(GroupMetric("score", None)),), 0).accumulator(1)
    for b in range(50):
        acc.add(batch([1, 1], 2, gen_batch=b))
        assert not acc.done
    with pytest.raises(RuntimeError, match="add"):
        acc.take()


def test_groups_from_batch():
    groups = groups_from_batch(torch.tensor([7, 3, 7, 3, 5]), [1, 2, 3, 4, 5], list("abcde"),
                               [{"i": 0}, {"i": 1}, {"i": 0}, {"i": 1}, {"i": 2}],
                               ["stop", "length", "stop", "stop", "stop"], torch.tensor([1, 2, 3, 4, 5]),
                               {"rule/acc": [1.0, None, 0.0, 1.0, 1.0]}, gen_batch=4)
    assert [(g.index, g.samples, g.row) for g in groups] == [(0, (0, 2), {"i": 0}), (1, (1, 3), {"i": 1}),
                                                              (2, (4,), {"i": 2})]
    g = groups[1]
    assert g.scores == (2.0, 4.0) and g.responses == ("b", "d") and g.finish == ("length", "stop")
    assert g.response_lengths == (2, 4) and g.extras == {"rule/acc": (None, 1.0)} and g.gen_batch == 4
    with pytest.raises(ValueError, match=r"4 finish for 5 samples"):
        groups_from_batch([0, 0, 1, 1, 2], [0] * 5, ["x"] * 5, [{}] * 5, ["stop"] * 4, [1] * 5)
    with pytest.raises(ValueError, match=r"extras\['rule/acc'\]"):
        groups_from_batch([0, 0], [0] * 2, ["x"] * 2, [{}] * 2, ["stop"] * 2, [1] * 2, {"rule/acc": [1.0]})


# ------------------------------------------------------------------ the user's filter, the config

FILTERS = '''
import time

def plain(group, keep_index=0):
    return group.index == keep_index

def reasoned(group):
    if group.index == 0:
        return True, "ignored for a kept group"
    return (False, "odd one/out") if group.index % 2 else (False, None)

def calls_back(group, seen):
    seen.append(group.index)
    return True

def wrong_return(group):
    return 1

def raises(group):
    x = {}
    return x["missing"]

def two_args(group, step):
    return True

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def filter_file(tmp_path):
    path = tmp_path / "my_filters.py"
    path.write_text(FILTERS)
    return str(path)


def config(*overrides) -> Config:
    return Config.load(None, ["rollout.n=2", *overrides])


def user_filters(path, name, *overrides) -> GroupFilters:
    return GroupFilters.from_config(config(f"rollout.group_filter.path={path}",
                                           f"rollout.group_filter.name={name}", *overrides),
                                    {"rule": EXTRAS})


def test_user_filter_bool_with_kwargs(filter_file):
    acc = user_filters(filter_file, "plain", "rollout.group_filter.kwargs={keep_index: 1}").accumulator(5)
    acc.add(batch([0, 1, 0, 1, 0, 1], 2))
    assert [g.index for g in acc.kept] == [1] and acc.dropped == {"group_filter": 2}


def test_user_filter_bool_and_reason(filter_file):
    acc = user_filters(filter_file, "reasoned").accumulator(5)
    acc.add(batch([0, 1] * 4, 2))
    assert [g.index for g in acc.kept] == [0]
    # a reason that is not a safe metric name is made one (no "/" nesting the metric)
    (odd,) = [r for r in acc.dropped if r.startswith("odd_one_out-")]
    assert acc.dropped == {"group_filter": 1, odd: 2}
    assert set(acc.metrics()) >= {"rollout/filter/dropped/group_filter", f"rollout/filter/dropped/{odd}"}


def test_the_builtin_filter_runs_first(filter_file):
    seen = []
    filters = user_filters(filter_file, "calls_back", "algorithm.filter_groups.enable=true",
                           "algorithm.filter_groups.metric=score", "rollout.group_filter.kwargs={seen: []}")
    filters.filters[1].kwargs["seen"] = seen
    acc = filters.accumulator(5)
    acc.add(batch([1, 1, 0, 1, 0, 0, 1, 0], 2))
    assert seen == [1, 3] and [g.index for g in acc.kept] == [1, 3]


@pytest.mark.parametrize("name, message", [
    ("wrong_return", "returned int '1' on prompt group 0 of generation batch 0 (data_source="
                     "'math_dapo'); a group filter returns a bool (keep) or (bool, reason str)"),
    ("raises", "raised KeyError: 'missing' (at {path}, line 21, in raises), on prompt group 0"),
])
def test_errors_at_run_time_name_the_file_and_function(filter_file, name, message):
    acc = user_filters(filter_file, name).accumulator(5)
    with pytest.raises(GroupFilterError) as e:
        acc.add(batch([0, 1], 2))
    assert f"rollout.group_filter {filter_file}:{name} " in str(e.value)
    assert message.format(path=filter_file) in str(e.value)


@pytest.mark.parametrize("name, overrides, message", [
    ("two_args", (), "two_args(group, step) cannot be called as two_args(group)"),
    ("plain", ("rollout.group_filter.kwargs={nope: 1}",),
     "plain(group, keep_index=0) cannot be called as plain(group, nope=...)"),
    ("NOT_A_FUNCTION", (), "is an object of type int, not a function"),
    ("missing_fn", (), "rollout.group_filter.name='missing_fn': {path} defines no such name"),
])
def test_bad_user_filters_fail_at_start_up_naming_the_file(filter_file, name, overrides, message):
    with pytest.raises(UserCodeError) as e:
        user_filters(filter_file, name, *overrides)
    assert filter_file in str(e.value) and message.format(path=filter_file) in str(e.value)


def test_a_missing_file_fails_at_start_up(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.group_filter.path='.*nowhere.py': no such file"):
        user_filters(tmp_path / "nowhere.py", "plain")


def test_the_import_time_limit_is_read(tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(30)\n\ndef f(group):\n    return True\n")
    with pytest.raises(UserCodeError, match=r"rollout.group_filter.import_timeout_s=1"):
        user_filters(slow, "f", "rollout.group_filter.import_timeout_s=1")


def test_the_example_filter(tmp_path):
    filters = user_filters(ROOT / "examples/group_filter.py", "drop_uninformative",
                           "rollout.group_filter.kwargs={max_truncated_fraction: 0.5}")
    acc = filters.accumulator(5)
    acc.add(batch([0, 1, 0, 1, 0, 1], 2, finish=["length", "length", "length", "stop", "stop", "stop"]))
    assert [g.index for g in acc.kept] == [1, 2] and acc.dropped["truncated"] == 1


def test_the_filter_groups_keys_are_read():
    """Each algorithm.filter_groups key changes what from_config builds."""
    extras = {"rule": EXTRAS}
    assert not GroupFilters.from_config(config(), extras).enabled
    on = GroupFilters.from_config(config("algorithm.filter_groups.enable=true"), extras)
    (f,) = on.filters
    assert f.metric.key == "rule/acc" and (on.max_gen_batches, on.on_max) == (0, "error")
    by_score = GroupFilters.from_config(config("algorithm.filter_groups.enable=true",
                                               "algorithm.filter_groups.metric=score",
                                               "algorithm.filter_groups.max_num_gen_batches=4",
                                               "algorithm.filter_groups.on_max_gen_batches=train"), extras)
    assert by_score.filters[0].metric.key is None
    acc = by_score.accumulator(2)
    for b in range(4):
        acc.add(batch([1, 1], 2, gen_batch=b))
    assert acc.done and acc.max_gen_batches == 4 and acc.on_max == "train"


@pytest.mark.parametrize("overrides, message", [
    (("rollout.n=1", "algorithm.filter_groups.enable=true"),
     "algorithm.filter_groups.enable=true compares the samples of a prompt, but rollout.n=1"),
    (("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"), "algorithm.filter_groups.metric=seq_final_reward is the reward"),
    (("algorithm.filter_groups.enable=true", "algorithm.filter_groups.on_max_gen_batches=train"),
     "algorithm.filter_groups.on_max_gen_batches=train says what a step does after "
     "max_num_gen_batches generation batches, but max_num_gen_batches=0 sets no limit"),
    (("algorithm.filter_groups.on_max_gen_batches=sometimes",), "algorithm.filter_groups.on_max_gen_batches"),
    (("algorithm.filter_groups.max_num_gen_batches=-1",),
     "algorithm.filter_groups.max_num_gen_batches=-1 must be >= 0 (0: no limit)"),
    (("rollout.group_filter.import_timeout_s=0",), "rollout.group_filter.import_timeout_s=0.0 must be > 0"),
])
def test_config_errors_name_the_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(Config.load(None, ["rollout.n=2", *overrides]), 1)
    assert message in str(e.value)
