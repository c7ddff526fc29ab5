"""agent/loop.py without a model: the trajectory's context (turns appended as sampled,
observations masked, limits ending it with "length"), what run may return, and the start-up
check of a user's class. Milliseconds."""
from __future__ import annotations

import asyncio

import pytest

from verl_mcore.agent.loop import AgentContext, AgentLoop, Turn, TrajectoryEnded, check_agent_loop, split_result


def _ctx(max_turns=3, max_tokens=10):
    async def engine(ctx, budget):  # each turn: `budget` tokens of 1, or 2 ending on a stop
        n = min(budget, 2)
        return Turn((1,) * n, (-0.5,) * n, "stop" if n < budget else "length")

    return AgentContext([9, 9], {}, tokenizer=None, eos_token_ids=[0], max_turns=max_turns,
                        max_tokens=max_tokens, request=engine)


def test_turns_and_observations_build_the_response():
    ctx = _ctx()

    async def run():
        turn = await ctx.generate()
        assert turn.token_ids == (1, 1) and ctx.token_ids == [9, 9, 1, 1]
        assert ctx.append_observation([5, 6, 7]) == 3
        await ctx.generate(max_new_tokens=1)
        return ctx.close()

    assert asyncio.run(run()) == "length"  # the last turn's reason (its budget of 1)
    assert ctx.response == [1, 1, 5, 6, 7, 1] and ctx.loss_mask == [1, 1, 0, 0, 0, 1]
    assert ctx.logprobs == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5]
    assert ctx.turns == 2 and ctx.sampled == 3 and ctx.observation_tokens == 3


def test_limits_end_the_trajectory_with_length():
    ctx = _ctx(max_turns=1)

    async def one_more():
        await ctx.generate()
        await ctx.generate()

    with pytest.raises(TrajectoryEnded):
        asyncio.run(one_more())
    assert ctx.close() == "length" and ctx.turns == 1
    # an observation past the budget is cut, and ends it
    ctx = _ctx(max_tokens=5)
    asyncio.run(ctx.generate())
    assert ctx.append_observation([5] * 9) == 3 and ctx.observations_cut == 1 and ctx.ended
    with pytest.raises(RuntimeError, match="already ended"):
        ctx.append_observation([5])
    assert not isinstance(TrajectoryEnded(), Exception)  # `except Exception` lets it through


def test_what_run_returns():
    assert split_result(None, "w") == (None, {})
    assert split_result(2, "w") == (2.0, {})
    assert split_result({"reward": 0.5, "won": True}, "w") == (0.5, {"won": True})
    assert split_result({"steps": 3}, "w") == (None, {"steps": 3})
    for bad in (float("nan"), "1", True):
        with pytest.raises(ValueError, match="w returned reward"):
            split_result(bad, "w")


class Good(AgentLoop):
    def __init__(self, k=1):
        self.k = k

    async def run(self, ctx, row, prompt_ids):
        return None


class NotAsync(AgentLoop):
    def run(self, ctx, row, prompt_ids):
        return None


class TwoArgs(AgentLoop):
    async def run(self, ctx):
        return None


class NoRun(AgentLoop):
    pass


@pytest.mark.parametrize("obj, kwargs, error", [
    (Good, {"k": 2}, None),
    (Good, {"j": 2}, "cannot be built as Good(**rollout.agent_loop.kwargs)"),
    (NotAsync, {}, "run is not `async def`"),
    (TwoArgs, {}, "cannot be called as run(self, ctx, row, prompt_ids)"),
    (NoRun, {}, "does not implement run"),
    (len, {}, "does not subclass verl_mcore.agent.loop.AgentLoop"),
])
def test_the_start_up_check_names_the_class(obj, kwargs, error):
    name = getattr(obj, "__name__", "x")
    if error is None:
        assert check_agent_loop(obj, "rollout.agent_loop", "/a/loop.py", name, kwargs, construct=True) == "class"
        return
    with pytest.raises(ValueError) as e:
        check_agent_loop(obj, "rollout.agent_loop", "/a/loop.py", name, kwargs)
    assert error in str(e.value) and "/a/loop.py" in str(e.value)


def test_the_numbers_a_loop_reports_become_mean_metrics():
    from verl_mcore.agent.runtime import info_metrics

    got = info_metrics([{"tool_calls": 2, "note": "x"}, {"tool_calls": 4, "a/b": 1.0},
                        {"flag": True, "bad": float("nan")}, {}])
    assert got["agent/info/tool_calls_mean"] == 3.0
    assert len(got) == 2 and any(k.startswith("agent/info/a_b-") for k in got)  # no "/" nesting


def test_the_engines_per_token_extras_follow_the_response():
    """A turn's extras (the routed experts under routing replay) join the response with its
    tokens; an observation's tokens, which no forward produced, get the field's default (-1:
    the trainer's routers choose), and so do the tokens before the field first came."""
    import numpy as np
    import torch

    from verl_mcore.rollout import token_fields

    routed = [np.full((2, 2, 2), 3, dtype=np.int32), np.full((1, 2, 2), 4, dtype=np.int32)]

    async def engine(ctx, budget):
        n = min(budget, 2)
        return Turn((1,) * n, None, "stop", {"routed_experts": routed[ctx.turns][:n]})

    ctx = AgentContext([9], {}, tokenizer=None, eos_token_ids=[0], max_turns=3, max_tokens=10,
                       request=engine)
    token_fields.declare(token_fields.routing_field(2, 2))
    try:
        async def run():
            ctx.append_observation([5])  # before any turn
            await ctx.generate()
            ctx.append_observation([6, 7])
            await ctx.generate(max_new_tokens=1)

        asyncio.run(run())
        got = ctx.response_extras()["routed_experts"]
    finally:
        token_fields.retract("routed_experts")
    assert got.shape == (6, 2, 2) and got.dtype == torch.int32
    assert got[:, 0, 0].tolist() == [-1, 3, 3, -1, -1, 4]
