"""The producer's group filters in real runs (rollouts.py, rollout/group_filter.py): DAPO's
dynamic sampling refills each step's batch to data.train_batch_size prompt groups, every rank
takes the same decisions, max_num_gen_batches stops or shortens the step as configured, and a
user's group filter and generate function (the examples') run end to end.

The quickstart's tiny model on CPU; the trained batches are recorded by wrapping Learner.train
(the rollout it receives, with the scores the producer computed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]

# Even digits: every sample of the prompt scores 1 (a uniform group, which the filter drops);
# odd digits: by the response's length, which differs between the samples of a group.
HALF_UNIFORM = '''
def score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2 == 0:
        return {"score": 1.0, "acc": 1.0}
    return {"score": float(len(solution_str) % 2), "acc": float(len(solution_str) % 2)}


def constant(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5
'''

ODD_DIGITS = '''
def odd_digits(group, parity=1):
    return int(group.row["reward_model"]["ground_truth"]) % 2 == parity, "even_digit"
'''

# Step 1 (two generation batches of 4 groups, 2 kept of each on rank 0): a decision that differs
# between the ranks, as a random or rank-local one would; then it raises on rank 0 only, as a
# file missing on one node would.
RANK_DEPENDENT = '''
import torch.distributed as dist

calls = 0


def rank_dependent(group):
    global calls
    calls += 1
    if calls > 8:
        if dist.get_rank() == 0:
            raise OSError("judge cache missing on this node")
        return True
    return (group.index + dist.get_rank()) % 2 == 0, "odd_index"
'''


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    d = tmp_path_factory.mktemp("code")
    (d / "rewards.py").write_text(HALF_UNIFORM)
    (d / "filters.py").write_text(ODD_DIGITS)
    return d


def _overrides(model, run_dir, code, reward="score", steps=2, extra=()):
    return [f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
            "trainer.val_every=0", "data.val_files=[]", "checkpoint.save_every=0",
            "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size_per_gpu=4", "reward.num_workers=0",
            f"reward.custom_fn.path={code}/rewards.py", f"reward.custom_fn.name={reward}",
            *extra]


def _train_recording(rank, world_size, overrides):
    """(fit's exit code or the error's first line, the trained batches: per step the groups'
    (ground truth, scores) in order and each sample's response mask as lists)."""
    from verl_mcore.config import Config, validate
    from verl_mcore.learner import Learner
    from verl_mcore.trainer import Trainer

    trained = []
    original = Learner.train

    def train(self, step, rollout, phase, score=None):
        if rollout.scores is None:  # scored when the learner asks (no filter)
            scores, metrics, baseline = score()
            score = lambda: (scores, metrics, baseline)  # noqa: E731 - the same, once
        else:  # scored by the producer to filter its groups
            scores = rollout.scores
        ids = rollout.group_ids.tolist()
        groups: dict = {}
        for i, g in enumerate(ids):
            groups.setdefault(g, (rollout.rows[i]["reward_model"]["ground_truth"], []))[1].append(
                float(scores[i]))
        b = rollout.train
        trained.append({"groups": list(groups.values()), "samples": len(ids),
                        "mask": [b.response_mask[i, :int(n)].tolist()
                                 for i, n in enumerate(b.response_lens)]})
        return original(self, step, rollout, phase, score)

    Learner.train = train
    try:
        cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
        validate(cfg, world_size)
        outcome = Trainer(cfg).fit()
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    finally:
        Learner.train = original
    return outcome, trained


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


DAPO = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]


def test_dynamic_sampling_drops_uniform_groups_and_refills_the_batch(tiny_model, code, tmp_path):
    [(outcome, trained)] = run_on_ranks(
        _train_recording, 1, args=(_overrides(tiny_model, tmp_path / "run", code, extra=DAPO),),
        timeout=300)
    assert outcome == 0
    for batch in trained:  # full, and no group whose samples all score the same
        assert len(batch["groups"]) == 4 and batch["samples"] == 16
        assert all(len(set(scores)) > 1 for _, scores in batch["groups"]), batch["groups"]
        assert all(int(truth) % 2 == 1 for truth, _ in batch["groups"])  # even digits: uniform
    rows = _rows(tmp_path / "run")
    for row in rows:
        assert row["rollout/filter/trained_groups"] == 4 and row["rollout/filter/short_batch"] == 0
        assert row["rollout/filter/kept_groups"] >= 4
        assert row["rollout/filter/dropped/zero_std"] == (
            row["rollout/filter/groups"] - row["rollout/filter/kept_groups"])
    # The quickstart's prompts have even digits half the time: more than one batch was needed.
    assert sum(r["rollout/filter/gen_batches"] for r in rows) > len(rows)
    assert sum(r["rollout/filter/dropped/zero_std"] for r in rows) > 0


@pytest.mark.distributed
def test_four_ranks_take_the_same_decisions(tiny_model, code, tmp_path):
    """4 gloo ranks, 4 generation replicas each sampling its share: every rank trains on the
    same filtered batch."""
    results = run_on_ranks(
        _train_recording, 4,
        args=(_overrides(tiny_model, tmp_path / "run", code, extra=DAPO + [
            "actor.micro_batch_size_per_gpu=1", "critic.micro_batch_size_per_gpu=1"]),),
        timeout=600)
    outcomes = [r[0] for r in results]
    assert outcomes == [0] * 4, outcomes
    first = results[0][1]
    assert all(r[1] == first for r in results[1:])
    for batch in first:
        assert len(batch["groups"]) == 4
        assert all(len(set(scores)) > 1 for _, scores in batch["groups"])
    assert sum(r["rollout/filter/dropped/zero_std"] for r in _rows(tmp_path / "run")) > 0


def test_max_num_gen_batches_stops_the_run_when_configured_so(tiny_model, code, tmp_path):
    """Every group uniform: after max_num_gen_batches the run stops naming the counts."""
    [(outcome, trained)] = run_on_ranks(_train_recording, 1, args=(_overrides(
        tiny_model, tmp_path / "run", code, reward="constant", steps=1,
        extra=DAPO + ["algorithm.filter_groups.max_num_gen_batches=2"]),), timeout=300)
    assert outcome.startswith("FilterExhaustedError: 0 of 4 prompt groups"), outcome
    assert "after 2 generation batches" in outcome and trained == []


def test_without_a_limit_a_filter_that_keeps_nothing_stops_after_a_pass_over_the_data(
        tiny_model, code, tmp_path):
    """max_num_gen_batches=0 (no limit) and every group uniform: the run stops once a whole pass
    over the data (512 prompts / 16 a batch) kept nothing, instead of sampling forever."""
    [(outcome, trained)] = run_on_ranks(_train_recording, 1, args=(_overrides(
        tiny_model, tmp_path / "run", code, reward="constant", steps=1,
        extra=DAPO + ["data.train_batch_size=16", "rollout.n=2", "actor.ppo_mini_batch_size=16"]),),
        timeout=300)
    assert outcome.startswith("FilterExhaustedError: no prompt group passed the group filters in "
                              "32 generation batches"), outcome
    assert "64 zero_std" not in outcome and "512 zero_std" in outcome and trained == []


def test_max_num_gen_batches_trains_on_fewer_groups_when_configured_so(tiny_model, code, tmp_path):
    """A user's filter keeps the odd digits; one generation batch allowed, on_max=train: the step
    trains on the kept groups, cut to whole mini-batches (2 prompts), and says so."""
    [(outcome, trained)] = run_on_ranks(_train_recording, 1, args=(_overrides(
        tiny_model, tmp_path / "run", code, steps=2,
        extra=[f"rollout.group_filter.path={code}/filters.py", "rollout.group_filter.name=odd_digits",
               "algorithm.filter_groups.max_num_gen_batches=1",
               "algorithm.filter_groups.on_max_gen_batches=train"]),), timeout=300)
    assert outcome == 0
    rows = _rows(tmp_path / "run")
    assert len(rows) == len(trained) == 2
    assert any(r["rollout/filter/short_batch"] == 1 for r in rows)  # seed 1: 2 odd digits of 4
    for row, batch in zip(rows, trained):
        kept = int(row["rollout/filter/kept_groups"])
        assert row["rollout/filter/gen_batches"] == 1
        assert row.get("rollout/filter/dropped/even_digit", 0) == 4 - kept
        assert len(batch["groups"]) == row["rollout/filter/trained_groups"] == kept // 2 * 2
        assert row["rollout/filter/short_batch"] == float(kept < 4)
        assert all(int(truth) % 2 == 1 for truth, _ in batch["groups"])


def test_the_example_group_filter_runs(tiny_model, code, tmp_path):
    """examples/group_filter.py beside the built-in filter: its reasons are counted."""
    [(outcome, trained)] = run_on_ranks(_train_recording, 1, args=(_overrides(
        tiny_model, tmp_path / "run", code, steps=1, extra=DAPO + [
            f"rollout.group_filter.path={ROOT}/examples/group_filter.py",
            "rollout.group_filter.name=drop_uninformative",
            "rollout.group_filter.kwargs={max_truncated_fraction: 0.5}"]),), timeout=300)
    assert outcome == 0 and len(trained[0]["groups"]) == 4
    [row] = _rows(tmp_path / "run")
    # The tiny model runs most responses to the 8-token limit: the example drops many groups.
    assert row["rollout/filter/dropped/truncated"] > 0 and row["rollout/filter/dropped/zero_std"] > 0
    assert row["rollout/filter/trained_groups"] == 4


def test_the_example_generate_fn_trains_the_answer_only(tiny_model, code, tmp_path):
    """examples/self_check_generate.py: each response is the answer, then the check instruction
    and the model's check; the response mask is 1 on the answer and 0 on the rest."""
    check = "x y"
    [(outcome, trained)] = run_on_ranks(_train_recording, 1, args=(_overrides(
        tiny_model, tmp_path / "run", code, steps=1, extra=[
            "data.max_response_length=16",
            f"rollout.generate_fn.path={ROOT}/examples/self_check_generate.py",
            "rollout.generate_fn.name=answer_then_check",
            f"rollout.generate_fn.kwargs={{check: '{check}', check_tokens: 3}}"]),), timeout=300)
    assert outcome == 0
    masks = trained[0]["mask"]
    assert len(masks) == 16
    holed = [m for m in masks if 0.0 in m]
    assert holed, "no response got a second pass"
    for m in holed:  # ones (the answer) then zeros (instruction + check), nothing after
        first_zero = m.index(0.0)
        assert first_zero > 0 and set(m[first_zero:]) == {0.0}, m
    [row] = _rows(tmp_path / "run")
    assert row["actor/pg_loss"] == row["actor/pg_loss"]  # finite: the update ran


@pytest.mark.parametrize("source, error", [
    ("def answer(engine, prompts):\n    return []\n", "cannot be called as answer(engine, prompts, sampling"),
    ("class answer:\n    pass\n", "is a class, not a function"),
    ("import nothing_here\n", "No module named 'nothing_here'"),
], ids=["signature", "class", "import"])
def test_a_bad_generate_fn_fails_at_start_naming_the_file(tiny_model, code, tmp_path, source, error):
    """Before any model is built (build.build_inputs): the file and the function named."""
    from verl_mcore import build
    from verl_mcore.config import Config, ConfigError

    path = tmp_path / "gen.py"
    path.write_text(source)
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), _overrides(
        tiny_model, tmp_path / "run", code, extra=[f"rollout.generate_fn.path={path}",
                                                 "rollout.generate_fn.name=answer"]))
    with pytest.raises(ConfigError) as e:
        build.build_inputs(cfg, 1)
    assert error in str(e.value) and str(path) in str(e.value)


@pytest.mark.distributed
def test_a_user_filter_decides_once_for_every_rank(tiny_model, code, tmp_path):
    """2 gloo ranks, a user filter that decides differently on each rank, then raises on rank 0
    only: the first rank's decisions bind every rank (the same batch trained everywhere), and its
    error stops every rank at once, naming it, instead of leaving the others waiting in the next
    collective until the watchdog's timeout. About 11 s."""
    (tmp_path / "rank_filter.py").write_text(RANK_DEPENDENT)
    results = run_on_ranks(_train_recording, 2, args=(_overrides(
        tiny_model, tmp_path / "run", code, steps=2, extra=[
            f"rollout.group_filter.path={tmp_path}/rank_filter.py",
            "rollout.group_filter.name=rank_dependent",
            "actor.micro_batch_size_per_gpu=2", "trainer.collective_timeout_s=60"]),), timeout=240)
    (first, trained0), (second, trained1) = results
    assert first.startswith("GroupFilterError: rollout.group_filter") and "judge cache" in first, first
    assert second.startswith("GroupFilterError: rank 0 failed") and "judge cache" in second, second
    assert len(trained0) == len(trained1) == 1 and trained0 == trained1
    assert len(trained0[0]["groups"]) == 4


EMPTY_FIRST = '''
import dataclasses


def empty_first(engine, prompts, sampling):
    """Sample 0 of each prompt: an empty response (the model stopped before any token)."""
    return [dataclasses.replace(o, token_ids=[], logprobs=None if o.logprobs is None else [],
                                finish_reason="stop") if o.sample_index == 0 else o
            for o in engine.generate(prompts.input_ids, sampling)]


def has_empty(group):
    return min(group.response_lengths) == 0 and group.responses[0] == "", "no_empty_response"
'''


def test_a_group_filter_sees_an_empty_response_as_zero_tokens(tiny_model, code, tmp_path):
    """PromptGroup.response_lengths are the responses' tokens: 0 for an empty one, not the one
    masked token the batch holds in its place. About 5 s."""
    (tmp_path / "empty.py").write_text(EMPTY_FIRST)
    [(outcome, trained)] = run_on_ranks(_train_recording, 1, args=(_overrides(
        tiny_model, tmp_path / "run", code, steps=1, extra=[
            f"rollout.generate_fn.path={tmp_path}/empty.py", "rollout.generate_fn.name=empty_first",
            f"rollout.group_filter.path={tmp_path}/empty.py", "rollout.group_filter.name=has_empty",
            "algorithm.filter_groups.max_num_gen_batches=1"]),), timeout=300)
    assert outcome == 0, outcome
    assert len(trained[0]["groups"]) == 4

RAISES_AT_STEP_2 = '''
calls = 0


def raises_later(group):
    global calls
    calls += 1
    if calls > 4:  # step 2's first group (step 1: one generation batch of 4 groups, all kept)
        raise KeyError("a judge's answer")
    return True
'''


def test_a_group_filters_error_commits_the_pending_saves(tiny_model, code, tmp_path):
    """A group filter's error comes on every rank alike (the first training rank decides): like a
    non-finite loss, it stops the run after committing the good steps' async saves. About 6 s."""
    (tmp_path / "later.py").write_text(RAISES_AT_STEP_2)
    run_dir = tmp_path / "run"
    [(outcome, trained)] = run_on_ranks(_train_recording, 1, args=(_overrides(
        tiny_model, run_dir, code, steps=2, extra=[
            f"rollout.group_filter.path={tmp_path}/later.py", "rollout.group_filter.name=raises_later",
            "checkpoint.save_every=1", "checkpoint.async_save=true"]),), timeout=300)
    assert outcome.startswith("GroupFilterError") and "a judge's answer" in outcome, outcome
    ckpts = run_dir / "checkpoints" / "actor"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000001"]
    assert (ckpts / "latest").exists() and not list(ckpts.glob(".tmp*"))

CANNED_ON_RANK_1 = '''
import torch.distributed as dist

from verl_mcore.rollout.base import SampleOutput


def canned_on_rank_1(engine, prompts, sampling):
    """Rank 1 (the second generation replica) answers from a cache: no engine call there."""
    if dist.get_rank() == 1:
        return [SampleOutput(p, s, [5, 6], [0.0, 0.0] if sampling.logprobs else None, "stop")
                for p in range(len(prompts.input_ids)) for s in range(sampling.n)]
    return engine.generate(prompts.input_ids, sampling)
'''


@pytest.mark.distributed
def test_a_replica_whose_generate_fn_calls_no_engine_joins_the_weight_sync_check(
        tiny_model, code, tmp_path):
    """The weight-sync check reads the first engine call after a weight update and is collective
    over the actor's ranks: a replica whose generate function made no engine call (a cache, an
    early exit) takes part without samples, instead of leaving the others in the check's
    collectives until the watchdog. 2 gloo ranks, about 9 s."""
    (tmp_path / "canned.py").write_text(CANNED_ON_RANK_1)
    results = run_on_ranks(_train_recording, 2, args=(_overrides(
        tiny_model, tmp_path / "run", code, steps=2, extra=[
            f"rollout.generate_fn.path={tmp_path}/canned.py",
            "rollout.generate_fn.name=canned_on_rank_1", "actor.micro_batch_size_per_gpu=2",
            "trainer.collective_timeout_s=60"]),), timeout=240)
    assert [r[0] for r in results] == [0, 0], [r[0] for r in results]
    rows = _rows(tmp_path / "run")
    assert all(row["rollout/logprob_diff_max"] < 1e-3 for row in rows)  # rank 0's samples checked

def _count_retained_batches(rank, world_size, overrides):
    """(fit's exit code, per generation batch after a step's first: how many of the step's
    earlier generation batches' whole rollouts were still alive when it started sampling)."""
    import gc
    import weakref

    from verl_mcore import rollouts
    from verl_mcore.config import Config
    from verl_mcore.rollout.batch import Rollout
    from verl_mcore.trainer import Trainer

    made, alive = [], []
    original_part, original_sample = Rollout.for_learner, rollouts.Producer._sample_filtered

    def recording_part(self, *args, **kwargs):
        rollout = original_part(self, *args, **kwargs)
        made.append(weakref.ref(rollout.train.input_ids))
        return rollout

    def sample(self, *args, **kwargs):
        made.clear()  # a step's generation batches
        return original_sample(self, *args, **kwargs)

    original_prompts = rollouts.Producer._next_prompts

    def next_prompts(self):
        if made:
            gc.collect()
            alive.append(sum(r() is not None for r in made))
        return original_prompts(self)

    Rollout.for_learner, rollouts.Producer._sample_filtered = recording_part, sample
    rollouts.Producer._next_prompts = next_prompts
    try:
        code = Trainer(Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)).fit()
    finally:
        Rollout.for_learner, rollouts.Producer._sample_filtered = original_part, original_sample
        rollouts.Producer._next_prompts = original_prompts
    return code, alive


def test_a_steps_generation_batches_are_not_all_kept_whole(tiny_model, code, tmp_path):
    """Dynamic sampling may sample many generation batches a step (max_num_gen_batches=0: no
    limit). Only their kept groups' samples stay, on the host: whole batches held on the
    training device until the step's batch is full would take the engine's memory from the
    next ones. (At most the one just scored is alive, as the loop's variable, when the next
    starts.) About 6 s."""
    [(outcome, alive)] = run_on_ranks(_count_retained_batches, 1, args=(_overrides(
        tiny_model, tmp_path / "run", code, steps=2, extra=DAPO),), timeout=300)
    assert outcome == 0
    assert len(alive) >= 2, alive  # steps of several generation batches
    assert max(alive) <= 1, alive

# ---------------------------------------------------------------------------------------------
# The producer's pieces, without a run (well under a second)

def _producer(**cfg):
    from types import SimpleNamespace

    from verl_mcore.rollouts import Producer

    seeds = []
    sampler = SimpleNamespace(sampling=lambda n, t, batch, seed_offset=0: seeds.append(
        (batch, seed_offset)) or (batch, seed_offset))
    config = SimpleNamespace(
        rollout=SimpleNamespace(n=2, temperature=1.0),
        algorithm=SimpleNamespace(adv_estimator=cfg.get("adv", "grpo")),
        actor=SimpleNamespace(ppo_mini_batch_size=2),
        critic=SimpleNamespace(ppo_mini_batch_size=cfg.get("critic_mini")),
        uses_critic=cfg.get("adv") == "gae")
    loader = SimpleNamespace(load_state_dict=lambda state: None)
    return Producer(sampler, loader, SimpleNamespace(trains=True), config, dict, 0), seeds


def test_a_critics_default_mini_batch_is_the_actors_when_a_short_batch_is_cut():
    """critic.ppo_mini_batch_size null (the actor's): math.lcm(2, None) raised TypeError at the
    first step of every filtered gae run."""
    producer, _ = _producer(adv="gae")
    assert producer._whole_mini_batches(list(range(5))) == [0, 1, 2, 3]
    producer, _ = _producer(adv="gae", critic_mini=3)
    assert producer._whole_mini_batches(list(range(7))) == [0, 1, 2, 3, 4, 5]


def test_every_generation_batch_samples_with_seeds_of_its_own():
    """Seeds count generation batches, with a filter or without: a filtered run resumed without
    its filter (its checkpoint: 7 generation batches for 3 steps) samples step 4 with the 8th
    batch's seeds, not the 4th's, which it sampled already."""
    producer, seeds = _producer()
    producer.load_state_dict({"loader": None, "queue": [], "gen_batches": 7}, 3)
    producer._samplings(4)
    assert seeds == [(7, 0)]
