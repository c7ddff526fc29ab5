"""rollout.agent_loop through the trainer: GRPO on the quickstart's tiny model with the toy loop
(tests/agent/toy_loop.py: 3 turns, fixed observations, asyncio waits between turns), on 1 rank
and at TP_g = 2 on 2 gloo ranks; the trained batch's response mask is 0 exactly on the
observation tokens, the agent metrics are logged, and the ranks of a replica return the same
trajectories. A bad agent loop fails at start-up naming its file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent.toy_loop import OBSERVATION
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
TOY = Path(__file__).resolve().parent / "toy_loop.py"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _overrides(model, run_dir, steps=2, extra=()):
    return [f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
            "trainer.val_every=0", "data.val_files=[]", "checkpoint.save_every=0",
            "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size_per_gpu=8", "reward.num_workers=0", "data.max_response_length=20",
            f"rollout.agent_loop.path={TOY}", "rollout.agent_loop.name=ToyLoop",
            "rollout.agent_loop.kwargs={turns: 3, per_turn: 4, sleep_s: 0.005}", *extra]


def _train_recording(rank, world_size, overrides, config=str(ROOT / "configs/quickstart.yaml")):
    """(fit's exit code or the error's first line, the trained response masks per step, the
    agent runtime's outputs on this rank per call) of a run of `config` with `overrides`."""
    from verl_mcore.agent.runtime import AgentRuntime
    from verl_mcore.config import Config, validate
    from verl_mcore.learner import Learner
    from verl_mcore.trainer import Trainer

    trained, served = [], []
    train, call = Learner.train, AgentRuntime.__call__

    def recording_train(self, step, rollout, phase, score=None):
        b = rollout.train
        trained.append([b.response_mask[i, :int(n)].tolist() for i, n in enumerate(b.response_lens)])
        return train(self, step, rollout, phase, score)

    def recording_call(self, phase, prompts, sampling):
        outputs = call(self, phase, prompts, sampling)
        served.append([(o.prompt_index, o.sample_index, o.token_ids, list(o.loss_mask), o.turns)
                       for o in outputs])
        return outputs

    Learner.train, AgentRuntime.__call__ = recording_train, recording_call
    try:
        cfg = Config.load(config, overrides)
        validate(cfg, world_size)
        outcome = Trainer(cfg).fit()
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    finally:
        Learner.train, AgentRuntime.__call__ = train, call
    return outcome, trained, served


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _zero_runs(mask):
    runs, n = [], 0
    for m in mask + [1.0]:
        if m == 0.0:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


@pytest.mark.distributed
def test_grpo_with_the_toy_agent_loop_on_one_rank(tiny_model, tmp_path):
    """About 15 s; validation at step 2 runs the loop too. The loop's run result (its reward:
    the turns it saw, 3) is a reward source of its own beside the rule."""
    val = [f"data.val_files=[{ROOT}/examples/data/quickstart_val.parquet]", "trainer.val_every=2",
           "reward.sources=[{name: rule, type: rule}, {name: env, type: environment, weight: 0.5}]"]
    [(outcome, trained, served)] = run_on_ranks(
        _train_recording, 1, args=(_overrides(tiny_model, tmp_path / "run", extra=val),), timeout=300)
    assert outcome == 0, outcome
    assert len(trained) == 2 and all(len(step) == 8 for step in trained)
    # validation ran the same loop: its 10 prompts, greedy, one sample each, after step 2
    assert len(served) == 3 and len(served[2]) == 10 and all(o[1] == 0 for o in served[2])
    for step in trained:
        for mask in step:  # two observations of 4 tokens between three model turns
            assert _zero_runs(mask) == [len(OBSERVATION)] * 2, mask
            assert mask[0] == 1.0 and mask[-1] == 1.0
    for call in served:
        assert all(turns == 3 for *_, turns in call)
    rows = _rows(tmp_path / "run")
    for row in rows:
        assert row["agent/turns_mean"] == 3.0
        assert row["agent/observation_tokens_mean"] == 2 * len(OBSERVATION)
        assert 0 < row["agent/masked_share"] < 1 and row["actor/pg_loss"] == row["actor/pg_loss"]
        assert "rollout/slot_occupancy" in row and "rollout/logprob_diff_max" in row
        assert row["reward/env/mean"] == 3.0 and row["reward/failed"] == 0.0
        assert row["critic/score/mean"] == pytest.approx(row["reward/rule/mean"] + 1.5)
        # The trajectory type's own view of the same batch (Rollout.trajectory_metrics).
        assert row["rollout/turns/mean"] == 3.0 and row["rollout/turns/max"] == 3.0
        assert row["rollout/masked_token_share"] == pytest.approx(row["agent/masked_share"])
    assert any(k.startswith("val/") for k in rows[-1])


@pytest.mark.slow  # ~22 s: two ranks build and train
@pytest.mark.distributed
def test_grpo_with_the_toy_agent_loop_at_tp_g_2(tiny_model, tmp_path):
    results = run_on_ranks(_train_recording, 2, args=(_overrides(
        tiny_model, tmp_path / "run", extra=["parallel.tensor_model_parallel_size=2",
                                             "rollout.tensor_parallel_size=2"]),), timeout=400)
    (first, trained0, served0), (second, trained1, served1) = results
    assert first == second == 0, (first, second)
    assert served0 == served1 and len(served0) == 2  # one replica: its two ranks alike
    assert trained0 == trained1
    for step in trained0:
        for mask in step:
            assert _zero_runs(mask) == [len(OBSERVATION)] * 2, mask


@pytest.mark.parametrize("name, error", [
    ("NotALoop", "does not subclass verl_mcore.agent.loop.AgentLoop"),
    ("Nowhere", "defines no such name"),
], ids=["not-a-loop", "missing"])
def test_a_bad_agent_loop_fails_at_start_naming_the_file(tiny_model, tmp_path, name, error):
    """Before any model is built (build.build_inputs): the file and the class named."""
    from verl_mcore import build
    from verl_mcore.config import Config, ConfigError

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), _overrides(
        tiny_model, tmp_path / "run", extra=[f"rollout.agent_loop.name={name}"]))
    with pytest.raises(ConfigError) as e:
        build.build_inputs(cfg, 1)
    assert error in str(e.value) and str(TOY) in str(e.value), str(e.value)


def test_an_environment_reward_needs_a_sampling_that_gives_one(tiny_model, tmp_path):
    from verl_mcore.config import Config, ConfigError, validate

    env = "reward.sources=[{name: env, type: environment}]"
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), _overrides(
        tiny_model, tmp_path / "run", extra=["rollout.agent_loop.path=null",
                                             "rollout.agent_loop.name=null",
                                             "rollout.agent_loop.kwargs={}", env]))
    with pytest.raises(ConfigError, match=r"reward.sources\[0\] \('env'\) is an environment "
                                          "reward.*rollout.agent_loop"):
        validate(cfg, 1)


def test_an_agent_loop_and_a_generate_fn_are_refused_together(tiny_model, tmp_path):
    from verl_mcore.config import Config, ConfigError, validate

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), _overrides(
        tiny_model, tmp_path / "run", extra=[f"rollout.generate_fn.path={TOY}", "rollout.generate_fn.name=x"]))
    with pytest.raises(ConfigError, match="rollout.agent_loop .* and rollout.generate_fn .* both sample"):
        validate(cfg, 1)
