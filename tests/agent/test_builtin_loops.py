"""The built-in agent loops (agent/builtin.py) through the trainer on the quickstart's tiny model:
the `tools` loop with the calculator in the sandbox (a test parser makes every turn a call, so
each trajectory runs 3 calls: the tool's result is in the trajectory, masked out of the loss,
and counted per tool), the `environment` loop with the guess-the-number game trained on its
reward, and the three shipped recipes (examples/agent/*.yaml) for a step each."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent.test_agent_e2e import _train_recording, _zero_runs
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
ALWAYS = Path(__file__).resolve().parent / "always_call.py"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The quickstart's tiny model with room for prompts that describe tools."""
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), max_positions=4096)


def _tiny(model, run_dir, steps=1):
    return [f"model.path={model}", "trainer.device=cpu", "actor.dtype=fp32",
            "reference.dtype=fp32", f"trainer.total_steps={steps}", "trainer.val_every=0",
            "data.val_files=[]", "checkpoint.save_every=0", f"trainer.run_dir={run_dir}",
            "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size_per_gpu=4", "reward.num_workers=0",
            "rollout.agent_loop.sandbox.num_workers=1"]


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _fit(config, overrides):
    [(outcome, trained, served)] = run_on_ranks(
        _train_recording, 1, args=(overrides, str(ROOT / config)), timeout=300)
    return outcome, trained, served


@pytest.mark.distributed
def test_the_tools_loop_calls_the_calculator_in_the_sandbox(tiny_model, tmp_path):
    """~15 s. Three turns of at most 8 tokens, each a call of calculator("6*7"): the first two
    calls run and the response holds their results "42", masked; the third turn's call, which
    no turn is left to read, does not run and the trajectory ends with "length"; the metrics
    count the calls."""
    run = tmp_path / "run"
    outcome, trained, served = _fit("examples/agent/calculator.yaml", _tiny(tiny_model, run, 2) + [
        f"rollout.agent_loop.parser={{path: {ALWAYS}, name: always}}",
        "rollout.agent_loop.max_turns=3", "rollout.agent_loop.kwargs={max_tokens_per_turn: 8}",
        "data.max_response_length=64"])
    assert outcome == 0, outcome
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for call in served:
        for _, _, ids, mask, turns in call:
            assert turns == 3
            observed = [t for t, m in zip(ids, mask) if not m]
            assert tok.decode(observed) == "4242", tok.decode(observed)
    for step in trained:
        for mask in step:
            assert len(_zero_runs(mask)) == 2
    for row in _rows(run):
        assert row["agent/tool/calculator/calls"] == 2 * 4  # 4 trajectories a step
        assert row["agent/info/tool_calls_mean"] == 2  # the loop's run result
        assert row["agent/tool/calculator/errors"] == 0 and row["agent/turns_mean"] == 3
        assert row["agent/length_ended_share"] == 1.0
        assert row["rollout/turns/mean"] == 3 and row["rollout/masked_token_share"] > 0


@pytest.mark.distributed
def test_the_environment_loop_trains_on_the_games_reward(tiny_model, tmp_path):
    """~15 s. Guess-the-number for two steps: every trajectory ends with the environment's
    reward (0 or 1: the tiny model guesses at random), the env steps are counted, and a
    trajectory's feedback turns are masked."""
    run = tmp_path / "run"
    outcome, trained, served = _fit("examples/agent/guess_number.yaml", _tiny(tiny_model, run, 2) + [
        "rollout.agent_loop.max_turns=3", "rollout.agent_loop.kwargs={max_tokens_per_turn: 4}",
        "data.max_response_length=200"])
    assert outcome == 0, outcome
    for row in _rows(run):
        assert row["reward/failed"] == 0.0  # every trajectory returned its reward
        assert 0.0 <= row["reward/env/mean"] <= 1.0
        assert row["agent/env/steps"] >= 4 and row["agent/env/errors"] == 0
    for call in served:
        for _, _, ids, mask, turns in call:
            assert 1 <= turns <= 3 and (turns == 1 or 0 in mask)


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["calculator", "guess_number", "search"])
def test_a_shipped_agent_recipe_runs_a_step(tiny_model, tmp_path, config):
    """~10 s each: the recipe as shipped (its tools, environment, parser, reward and data), on
    the tiny model for one step."""
    outcome, _, served = _fit(f"examples/agent/{config}.yaml", _tiny(tiny_model, tmp_path / "run") + [
        "data.max_response_length=48", "rollout.agent_loop.kwargs={max_tokens_per_turn: 16}"])
    assert outcome == 0, outcome
    assert served and all(len(call) == 4 for call in served)

