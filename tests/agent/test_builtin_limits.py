"""The built-in loops (agent/builtin.py) at their limits, without a model: a scripted engine and
stand-in tools. A trajectory that a limit ends (max_turns with a call or an episode still open,
the token budget) gets finish reason "length", like one the runtime cuts (agent/loop.py), so the
overlong filter and the length metrics see it; the environment's reward is kept. Milliseconds."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from types import SimpleNamespace

from verl_mcore.agent.builtin import EnvironmentLoop, ToolLoop
from verl_mcore.agent.environment import EnvStep
from verl_mcore.agent.loop import AgentContext, Turn
from verl_mcore.agent.parsers import ParsedTurn
from verl_mcore.agent.tools import ToolCall, ToolResult

CALL, ANSWER, OBS = 7, 8, 5  # a turn of CALL tokens calls a tool; ANSWER is plain text


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class _Tools:
    """parse: a turn holding CALL calls "t"; call / observation / feedback count what ran."""

    specs = ["t"]

    def __init__(self, steps=()):
        self.calls, self.steps = 0, list(steps)

    def parse(self, text):
        return ParsedTurn(calls=[ToolCall("t", {})] if str(CALL) in text.split() else [])

    async def call(self, parsed):
        self.calls += len(parsed.calls)
        return [ToolResult("r", "ok", tool="t") for _ in parsed.calls]

    def observation(self, results, after_token=None):
        return [OBS, OBS]

    def feedback(self, text, after_token=None):
        return [OBS, OBS]

    @asynccontextmanager
    async def environment(self):
        steps = self.steps

        async def reset(row):
            return "first"

        async def step(text):
            return steps.pop(0)

        yield SimpleNamespace(reset=reset, step=step)


def _ctx(turns, tools, max_turns=2, max_tokens=100):
    turns = list(turns)

    async def engine(ctx, budget):
        ids = tuple(turns.pop(0))[:budget]
        return Turn(ids, (-0.1,) * len(ids), "stop")

    return AgentContext([1], {}, tokenizer=_Tokenizer(), eos_token_ids=[0], max_turns=max_turns,
                        max_tokens=max_tokens, request=engine, tools=tools)


def _run(loop, ctx):
    async def go():
        result = await loop.run(ctx, {}, [1])
        return result, ctx.close()

    return asyncio.run(go())


def test_tool_loop_cut_by_max_turns_with_a_call_pending_ends_with_length():
    """The last allowed turn calls a tool: the model wanted another turn, so the trajectory was
    cut ("length"), and the call whose result it would never read does not run."""
    tools = _Tools()
    ctx = _ctx([(CALL,), (CALL,)], tools, max_turns=2)
    result, reason = _run(ToolLoop(), ctx)
    assert reason == "length"
    assert tools.calls == 1 and result == {"tool_calls": 1}
    assert ctx.response[-1] == CALL  # nothing appended after the last turn


def test_tool_loop_answer_at_max_turns_ends_with_stop():
    tools = _Tools()
    ctx = _ctx([(CALL,), (ANSWER, 0)], tools, max_turns=2)
    _, reason = _run(ToolLoop(), ctx)
    assert reason == "stop" and tools.calls == 1


def test_environment_loop_cut_by_max_turns_keeps_the_reward_and_ends_with_length():
    tools = _Tools([EnvStep("lower", 0.25, False), EnvStep("higher", 0.5, False)])
    tools.specs = []
    ctx = _ctx([(ANSWER,), (ANSWER,)], tools, max_turns=2)
    result, reason = _run(EnvironmentLoop(), ctx)
    assert result["reward"] == 0.75 and result["env_steps"] == 2
    assert reason == "length"


def test_environment_loop_done_at_max_turns_ends_with_stop():
    tools = _Tools([EnvStep("lower", 0.0, False), EnvStep("found", 1.0, True)])
    tools.specs = []
    ctx = _ctx([(ANSWER,), (ANSWER,)], tools, max_turns=2)
    result, reason = _run(EnvironmentLoop(), ctx)
    assert result["reward"] == 1.0 and reason == "stop"


def test_environment_loop_tool_call_at_max_turns_keeps_the_reward_and_ends_with_length():
    tools = _Tools([EnvStep("lower", 0.5, False)])
    ctx = _ctx([(ANSWER,), (CALL,)], tools, max_turns=2)
    result, reason = _run(EnvironmentLoop(), ctx)
    assert result["reward"] == 0.5 and reason == "length" and tools.calls == 0


def test_environment_loop_feedback_cut_by_the_budget_keeps_the_reward():
    """The feedback does not fit the token budget: cut, the trajectory over, its reward kept."""
    tools = _Tools([EnvStep("lower", 0.5, False)])
    tools.specs = []
    ctx = _ctx([(ANSWER, ANSWER)], tools, max_turns=5, max_tokens=3)
    result, reason = _run(EnvironmentLoop(), ctx)
    assert result["reward"] == 0.5 and reason == "length" and ctx.observations_cut == 1


def test_environment_loop_turn_at_the_budget_keeps_the_reward():
    """The turn ends exactly at the budget: the environment still sees it, its reward kept."""
    tools = _Tools([EnvStep("lower", 0.5, False)])
    tools.specs = []
    ctx = _ctx([(ANSWER, ANSWER, ANSWER)], tools, max_turns=5, max_tokens=3)
    result, reason = _run(EnvironmentLoop(), ctx)
    assert result["reward"] == 0.5 and reason == "length" and result["env_steps"] == 1


def test_a_turn_that_stops_on_its_last_allowed_token_is_complete():
    """The model's EOS is the budget's last token: the response is complete ("stop"), as a
    one-turn generation of the same tokens is; only asking for more ends it with "length"."""
    tools = _Tools()
    ctx = _ctx([(ANSWER, ANSWER, 0)], tools, max_turns=5, max_tokens=3)
    _, reason = _run(ToolLoop(), ctx)
    assert reason == "stop" and ctx.response == [ANSWER, ANSWER, 0]


def test_asking_past_the_token_budget_ends_with_length():
    from verl_mcore.agent.loop import TrajectoryEnded

    ctx = _ctx([(ANSWER, 0)], _Tools(), max_turns=5, max_tokens=2)

    async def two():
        await ctx.generate()
        assert not ctx.ended  # it stopped by itself, on the budget's last token
        await ctx.generate()

    try:
        asyncio.run(two())
    except TrajectoryEnded:
        pass
    else:
        raise AssertionError("a turn past the budget ran")
    assert ctx.close() == "length" and ctx.turns == 1
