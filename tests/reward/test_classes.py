"""Reward classes (reward.custom_cls, and a custom source naming a class): constructed once per
scoring process with their kwargs; per-sample (score / __call__) and batch (compute_reward)
interfaces, in worker processes and in this one; a wrong signature or a constructor that raises
fails at RewardManager construction naming the file, the class and the signature expected."""
import os
import time

import pytest

from tests.reward import user_classes
from tests.reward.test_manager import row
from verl_mcore.config.schema import (CustomClassConfig, CustomClassKwargsConfig, RewardConfig,
                                      RewardSourceConfig)
from verl_mcore.reward import RewardManager
from verl_mcore.user_code import load_user_object


def _constructions(log) -> list[tuple[int, str]]:
    """(pid, kwarg) per construction the class logged."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [(int(pid), what) for pid, what in (line.split() for line in f)]


def _cls_manager(path, name, workers, **kw):
    return RewardManager.from_config(RewardConfig(
        custom_cls=CustomClassKwargsConfig(path=path, name=name, kwargs=kw), num_workers=workers))


def test_a_class_is_constructed_once_per_worker(tmp_path):
    log = str(tmp_path / "constructed.log")
    with _cls_manager(user_classes.write(tmp_path), "Scaled", 2, log=log, scale=0.5) as m:
        first = m.score(["ab" * i for i in range(20)], [row()] * 20)
        second = m.score(["abcd"] * 20, [row()] * 20)
    assert first.scores == [0.5 * 2 * i for i in range(20)] and not any(first.failed)
    assert second.scores == [2.0] * 20
    made = _constructions(log)
    # the import probe's instance, then one per worker, each with the kwargs; none here, and
    # none made again for the second batch
    assert len(made) == 3 and len({pid for pid, _ in made}) == 3
    assert all(what == "0.5" for _, what in made) and os.getpid() not in {p for p, _ in made}
    scorers = {int(p) for p in first.extras["rule/pid"] + second.extras["rule/pid"]}
    assert scorers <= {pid for pid, _ in made[1:]}
    # the instances kept their state: 40 calls in all, spread over the workers
    last_count = {}
    for pid, calls in zip(first.extras["rule/pid"] + second.extras["rule/pid"],
                          first.extras["rule/calls"] + second.extras["rule/calls"]):
        last_count[pid] = max(last_count.get(pid, 0), calls)
    assert sum(last_count.values()) == 40


def test_in_process_a_class_is_constructed_once_here(tmp_path):
    log = str(tmp_path / "constructed.log")
    with _cls_manager(user_classes.write(tmp_path), "Scaled", 0, log=log, scale=2.0) as m:
        assert m.score(["abc", ""], [row(), row()]).scores == [6.0, 0.0]
        assert m.score(["a"], [row()]).extras["rule/calls"] == [3.0]
    made = _constructions(log)
    assert [pid for pid, _ in made].count(os.getpid()) == 1 and len(made) == 2  # here, the probe


def test_a_class_with_call_and_no_constructor(tmp_path):
    cfg = RewardConfig(num_workers=0, sources=[RewardSourceConfig(
        name="chat", type="custom", path=user_classes.write(tmp_path), function="Called")])
    with RewardManager.from_config(cfg) as m:
        assert m.score(["x", "y"], [row("chat"), row("math")]).scores == [2.0, 0.0]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_class_reads_columns_and_prompts(tmp_path, workers):
    path, log = user_classes.write(tmp_path), str(tmp_path / "constructed.log")
    cfg = RewardConfig(num_workers=workers, sources=[
        RewardSourceConfig(name="judge", type="custom", path=path, function="ByCategory",
                           kwargs={"log": log, "bonus": 10.0}),
        RewardSourceConfig(name="prompt_len", type="custom", path=path, function="Lengths",
                           weight=0.5, kwargs={"name": "prompts"})])
    rows = [row("math"), row("chat"), row(None), row("math")]
    with RewardManager.from_config(cfg) as m:
        assert m.needs_prompts
        out = m.score(["#### 72", "hello", "hi", "x"], rows, prompts=["p", "pp", "ppp", "pppp"])
        again = m.score(["abc"], [row("chat")], prompts=["pp"])
    assert out.source_scores == {"judge": [10.0, 5.0, 2.0, 10.0], "prompt_len": [1.0, 2.0, 3.0, 4.0]}
    assert out.scores == [10.5, 6.0, 3.5, 12.0] and not any(out.failed)
    assert again.scores == [4.0]
    made = _constructions(log)
    assert len(made) == 2 and len({pid for pid, _ in made}) == 2  # the probe; the scorer
    assert (os.getpid() in {p for p, _ in made}) == (workers == 0)


def test_the_batch_has_every_column_and_names_the_missing_one():
    from verl_mcore.reward.custom import build_batch

    batch = build_batch(["p0", "p1"], ["r0", "r1"], [row("math"), row(None, ability="x")])
    assert batch["prompts"] == ["p0", "p1"] and batch["responses"] == ["r0", "r1"]
    assert batch["category"] == ["math", None] and batch["ability"] == [None, "x"]
    assert batch["data_source"] == ["openai/gsm8k"] * 2
    assert batch["reward_model"][0]["ground_truth"] == "72" and batch["extra_info"][1] == {"index": 7}
    with pytest.raises(KeyError, match=r"'categroy': the reward batch has no such column; it has "
                                       r"\['ability', 'category'"):
        batch["categroy"]


def test_a_batch_class_as_a_route_target_gets_only_its_samples(tmp_path):
    cfg = RewardConfig(num_workers=0, route_by="category", routes={"chat": "size"},
                       sources=[RewardSourceConfig(name="rule"),
                                RewardSourceConfig(name="size", type="custom",
                                                   path=user_classes.write(tmp_path),
                                                   function="BatchSize")])
    rows = [row("chat"), row("math"), row("chat"), row("chat"), row("math")]
    with RewardManager.from_config(cfg) as m:
        out = m.score(["a", "#### 72", "b", "c", "#### 1"], rows, prompts=["q"] * 5)
        with pytest.raises(ValueError, match=r"reward.sources\[1\] .*my_classes.py:BatchSize"
                                             r".compute_reward is a batch reward class: pass "
                                             r"prompts"):
            m.score(["a"], [row("chat")])
    assert out.scores == [3.0, 1.0, 3.0, 3.0, 0.0]  # one call of the 3 chat samples


@pytest.mark.parametrize("workers", [0, 1])
def test_batch_results_are_checked_like_scores(tmp_path, workers):
    cfg = RewardConfig(num_workers=workers, fallback_score=-1.0, timeout_s=0.5,
                       custom_cls=CustomClassKwargsConfig(path=user_classes.write(tmp_path),
                                                          name="Bad"))
    with RewardManager.from_config(cfg) as m:
        def run(first, n=3):
            return m.score([first] + ["x"] * (n - 1), [row()] * n, prompts=["q"] * n)

        short = run("short")
        assert short.scores == [-1.0] * 3 and short.metrics["reward/invalid"] == 3
        assert ("scorer reward.custom_cls " in short.first_failure[1]
                and ":Bad.compute_reward: invalid: " in short.first_failure[1]
                and "compute_reward(batch) returned 2 values for a batch of 3 samples"
                in short.first_failure[1])
        assert "returned float 1.0 for a batch of 3" in run("scalar").first_failure[1]
        values = run("values", 4)
        assert values.scores == [0.5, -1.0, -1.0, -1.0]
        assert values.failed == [False, True, True, True]
        assert run("bools").metrics["reward/invalid"] == 3
        raised = run("raise")
        assert raised.metrics["reward/errors"] == 3
        assert "KeyError: 'no judge for this batch'" in raised.first_failure[1]
        if workers:
            # the limit of one call is reward.timeout_s per sample of it: 0.5 s x 4 = 2 s (a 1 s
            # margin: a paused worker on a loaded 2-core machine must not fail this)
            assert run("sleep 1.0", 4).scores == [1.0] * 4
            start = time.monotonic()
            late = run("sleep 30", 4)
            assert late.metrics["reward/timeouts"] == 4 and time.monotonic() - start < 10
            assert ("no result from the batch call after reward.timeout_s=0.5 s x 4 samples = "
                    "2 s" in late.first_failure[1])
            assert run("ok", 2).scores == [1.0, 1.0]  # the replaced worker scores on


# ------------------------------------------------------------------ wrong signatures

SIGNATURES = [
    (dict(custom_cls=("NoKwargs", {"scale": 2})),
     r"reward.custom_cls.name='NoKwargs' in {path}: the constructor NoKwargs\(\) cannot be "
     r"called as NoKwargs\(scale=...\) \(the kwargs of reward.custom_cls.kwargs\)"),
    (dict(custom_cls=("WrongArity", {})),
     r"reward.custom_cls.name='WrongArity' in {path}: WrongArity.score\(self, response\) cannot "
     r"be called as score\(self, data_source, response, ground_truth, extra_info\)"),
    (dict(custom_cls=("Neither", {})),
     r"reward.custom_cls.name='Neither' in {path}: class Neither has neither "
     r"compute_reward\(self, batch\) .* nor score\(self, data_source, response, ground_truth, "
     r"extra_info\) or __call__"),
    (dict(source=("NoBatch", {})),
     r"reward.sources\[0\].function='NoBatch' in {path}: NoBatch.compute_reward\(self\) cannot "
     r"be called as compute_reward\(self, batch\)"),
    (dict(custom_cls=("Raises", {"url": "http://judge"})),
     # the user's frames first, the error last (user_code.check_import)
     r"(?s)my_classes.py\", line \d+, in __init__.*\nreward.custom_cls.name='Raises' in {path}: "
     r"constructing Raises\(\*\*reward.custom_cls.kwargs\) raised ConnectionError: cannot reach "
     r"the judge at http://judge$"),
    (dict(source=("Raises", {"site": "x"})),
     r"reward.sources\[0\].function='Raises' in {path}: the constructor Raises\(url\) cannot be "
     r"called as Raises\(site=...\) \(the kwargs of reward.sources\[0\].kwargs\)"),
    (dict(custom_fn=("two_args", {})),
     r"reward.custom_fn.name='two_args' in {path}: two_args\(response, ground_truth\) cannot be "
     r"called as two_args\(data_source, response, ground_truth, extra_info\)"),
    (dict(custom_fn=("plain", {"scale": 2})),
     r"plain\(data_source, response, ground_truth, extra_info\) cannot be called as "
     r"plain\(data_source, response, ground_truth, extra_info, scale=...\) "
     r"\(reward.custom_fn_kwargs go to each call\)"),
    (dict(custom_fn=("Scaled", {})),
     r"reward.custom_fn.name='Scaled' in {path} is a class; reward.custom_fn takes a function: "
     r"name the class in reward.custom_cls"),
    (dict(custom_cls=("plain", {})),
     r"reward.custom_cls.name='plain' in {path} is not a class; reward.custom_cls takes a class"),
    (dict(source=("NOT_CALLABLE", {})),
     r"reward.sources\[0\].function='NOT_CALLABLE' in {path} is a int, not a function or a class"),
]


def _config(path, workers, custom_cls=None, custom_fn=None, source=None) -> RewardConfig:
    if custom_cls:
        return RewardConfig(num_workers=workers, custom_cls=CustomClassKwargsConfig(
            path=path, name=custom_cls[0], kwargs=custom_cls[1]))
    if custom_fn:
        return RewardConfig(num_workers=workers, custom_fn_kwargs=custom_fn[1],
                            custom_fn=CustomClassConfig(path=path, name=custom_fn[0]))
    return RewardConfig(num_workers=workers, sources=[RewardSourceConfig(
        name="c", type="custom", path=path, function=source[0], kwargs=source[1])])


@pytest.mark.parametrize("case, problem", SIGNATURES)
def test_a_wrong_signature_fails_at_construction(tmp_path, case, problem):
    path = user_classes.write(tmp_path)
    with pytest.raises(ValueError, match=problem.format(path=path)):
        RewardManager.from_config(_config(path, 1, **case))  # no pool was started for it


def test_signatures_are_checked_when_the_file_is_imported_already(tmp_path):
    # This process has the file (a num_workers=0 manager loaded it): no probe, the same checks.
    path = user_classes.write(tmp_path)
    load_user_object(path, "Scaled", "test")
    for case, problem in SIGNATURES[:4]:
        with pytest.raises(ValueError, match=problem.format(path=path)):
            RewardManager.from_config(_config(path, 0, **case))


def test_custom_fn_and_custom_cls_together_are_refused(tmp_path):
    path = user_classes.write(tmp_path)
    cfg = RewardConfig(num_workers=0, custom_fn=CustomClassConfig(path=path, name="plain"),
                       custom_cls=CustomClassKwargsConfig(path=path, name="Scaled"))
    with pytest.raises(ValueError, match="reward.custom_fn .* and reward.custom_cls .* are both "
                                         "set"):
        RewardManager.from_config(cfg)
