"""Refactors without drift (issue 40): four short runs (runs.py: the quickstart, PPO with a
critic, roles placed on their own ranks, one_step_off with a rollout set) give, step by step,
exactly the metrics recorded in tests/e2e/drift/<run>.json at commit acba9e9 (record.py says
when re-recording is legitimate; compare.py what is compared and why exactly).

The comparison can fail: one ulp in one value, a missing or a new key, another config or another
learning rate each fail it, naming the run, the step, the key and both values."""
from __future__ import annotations

import math

import pytest

from tests.e2e.drift.compare import (assert_no_drift, differences, is_run_dependent, load,
                                     to_record)
from tests.e2e.drift.runs import RUNS, Models, make_models

DISTRIBUTED = {"placed", "one_step_off"}  # on 4 gloo ranks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("drift"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.distributed)
                                  if n in DISTRIBUTED else n for n in RUNS])
def test_metrics_equal_the_recorded_ones(models, tmp_path, name):
    run = RUNS[name]
    rows = run.launch(models, tmp_path / "run")
    assert_no_drift(name, rows, run.recorded_overrides(models, tmp_path / "run"))


# ---------------------------------------------------------------------------------------------
# The comparison fails where it should (on the recordings themselves: no run needed).

def _rows_of(name: str) -> list[dict]:
    """metrics.jsonl rows that are the recording of `name` (run-dependent values made up)."""
    rows = []
    for s in load(name)["steps"]:
        row = {"step": s["step"], **s["metrics"]}
        row.update({k: 12.5 for k in s["run_dependent"]})
        rows.append(row)
    return rows


@pytest.mark.parametrize("name", list(RUNS))
def test_one_ulp_in_one_value_fails_naming_run_step_key_and_values(name):
    rows = _rows_of(name)
    assert_no_drift(name, rows)  # unchanged, it passes: the failure below is the ulp's
    last = rows[-1]
    recorded = last["actor/pg_loss"]
    last["actor/pg_loss"] = math.nextafter(recorded, math.inf)
    with pytest.raises(AssertionError) as e:
        assert_no_drift(name, rows)
    assert (f"run {name!r} step {last['step']} 'actor/pg_loss': recorded {recorded!r}, "
            f"got {last['actor/pg_loss']!r}") in str(e.value)
    assert "1 difference(s)" in str(e.value)


def test_a_missing_or_new_key_and_a_missing_step_fail_naming_them():
    recorded = load("placed")["steps"]
    rows = _rows_of("placed")
    del rows[0]["critic/vf_loss"]
    rows[1]["actor/new_metric"] = 1.0
    del rows[2]["timing_s/critic/critic"]  # a run-dependent value, but its name is compared
    vf_loss = recorded[0]["metrics"]["critic/vf_loss"]
    assert differences("placed", recorded, rows) == [
        f"run 'placed' step 1: 'critic/vf_loss' recorded ({vf_loss!r}) but missing",
        "run 'placed' step 2: new key 'actor/new_metric' (got 1.0), not in the recording",
        ("run 'placed' step 3: run-dependent key 'timing_s/critic/critic' (value not compared) "
         "missing")]
    assert differences("placed", recorded, rows[:2])[0] == (
        "run 'placed': steps recorded [1, 2, 3], got [1, 2]")


def test_run_dependent_values_are_not_compared():
    rows = _rows_of("one_step_off")
    for row in rows:
        row.update({k: -1.0 for k in row if is_run_dependent(k)})
    assert differences("one_step_off", load("one_step_off")["steps"], rows) == []


def test_a_config_other_than_the_recorded_one_is_refused_before_any_metric(tmp_path):
    overrides = RUNS["ppo"].recorded_overrides(Models("/models/policy", "/models/rm"), tmp_path)
    assert_no_drift("ppo", _rows_of("ppo"), overrides)  # the recorded config passes
    with pytest.raises(AssertionError, match=r"config is not the one recorded[^\n]*\n  \+ "
                                             r"actor\.optim\.lr=1e-3"):
        assert_no_drift("ppo", _rows_of("ppo"), overrides + ["actor.optim.lr=1e-3"])


@pytest.mark.parametrize("key, run_dependent", [
    ("time", True), ("timing_s/gen", True), ("timing_s/actor+reference/old_logp", True),
    ("memory_gb/actor", True), ("memory/alloc_retries/actor", True), ("perf/throughput", True),
    ("perf/max_memory_allocated_gb", True), ("perf/utilisation/critic", True),
    ("actor/tokens_per_s", True), ("critic/mfu", True), ("rollout/transfer_seconds", True),
    ("rollout/kept_cache_gb", True),
    ("actor/pg_loss", False), ("actor/lr", False), ("critic/vf_explained_var", False),
    ("rollout/repartition_bytes_received", False), ("rollout/slot_occupancy", False),
    ("reward/timeouts", False), ("val/quickstart/repeat_digit/score/mean@1", False),
])
def test_only_timing_memory_and_speed_are_run_dependent(key, run_dependent):
    assert is_run_dependent(key) == run_dependent


def test_a_changed_learning_rate_is_drift(models, tmp_path):
    """The PPO run with the actor's learning rate doubled: what step 1 sampled (before any
    update) still agrees; the updates' numbers and what the updated actor computes later do not."""
    rows = RUNS["ppo"].launch(models, tmp_path / "run", "actor.optim.lr=6e-3")
    lines = differences("ppo", load("ppo")["steps"], rows)
    sampled = ("critic/score/", "response_length/", "prompt_length/", "reward/")
    assert not [line for line in lines if line.startswith(tuple(f"run 'ppo' step 1 '{k}"
                                                                 for k in sampled))], lines
    for step, key in ((1, "actor/lr"), (1, "actor/pg_loss"), (2, "actor/old_entropy"),
                      (3, "critic/values/mean")):
        prefix = f"run 'ppo' step {step} {key!r}: recorded "
        assert any(line.startswith(prefix) for line in lines), (step, key, lines)


def test_to_record_keeps_the_names_of_run_dependent_metrics_only():
    [step] = to_record([{"step": 4, "time": 1.0, "actor/pg_loss": 0.5, "timing_s/gen": 2.0}])
    assert step == {"step": 4, "metrics": {"actor/pg_loss": 0.5},
                    "run_dependent": ["time", "timing_s/gen"]}
