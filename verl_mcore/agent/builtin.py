"""The agent loops shipped with verl_mcore, named by `rollout.agent_loop.name` without a path:

    tools         the model calls the configured tools (rollout.agent_loop.tools) in the chat
                  format the parser reads (hermes: <tool_call>{"name", "arguments"}</tool_call>);
                  each turn's calls run in the sandbox and their results come back as one tool
                  turn; a turn without a call is the answer. Reward: the reward sources score
                  the response (the model's own tokens: observations are not its text).
    environment   a multi-turn environment (rollout.agent_loop.environment): after each model
                  turn the environment's step(text) gives feedback (a user turn), a reward and
                  whether the episode is over. The trajectory's reward is the sum of the steps'
                  rewards (a reward source of type `environment` reads it); tools, when also
                  configured, are called as in `tools` before the environment sees a turn
                  without calls.

Both stop at the runtime's limits (rollout.agent_loop.max_turns, data.max_response_length); a
trajectory a limit ends while the model still wanted a turn (calls in its last allowed turn,
which are not run; an episode not done) finishes with "length", as the runtime's cut. The
prompt is the dataset row's; an environment's reset(row) prepares the episode from the row (its
observation goes to the run result's info as "first_observation", which the training batch does
not carry: put what the model must read first in the dataset's prompt). The numbers a loop
reports in its info (tool_calls, env_steps) are logged as agent/info/<key>_mean.
"""
from __future__ import annotations

from typing import Optional

from verl_mcore.agent.loop import AgentContext, AgentLoop


def _text(ctx: AgentContext, token_ids) -> str:
    # Special tokens kept: a template's tool-call tags may be added tokens of their own.
    return ctx.tokenizer.decode(list(token_ids), skip_special_tokens=False)


def _room(ctx: AgentContext) -> bool:
    """Whether the trajectory can take another model turn (ending here instead keeps the
    loop's result: the runtime's TrajectoryEnded would drop it)."""
    return ctx.turns < ctx.max_turns and ctx.tokens_left > 0


def _cut(ctx: AgentContext, result: dict) -> dict:
    """`result`, the trajectory ended by its limits while the model still wanted a turn (a call
    to answer, an episode still open): finish reason "length", as the runtime gives a loop that
    asks past them, so the overlong filter and the length metrics count it."""
    if not ctx.ended:
        ctx.finish_reason = "length"
    return result


def _tools_of(ctx: AgentContext, loop: str):
    if ctx.tools is None:
        raise ValueError(f"the built-in agent loop {loop!r} needs rollout.agent_loop.tools or "
                         f".environment configured")
    return ctx.tools


class _TurnLimited(AgentLoop):
    """kwargs of the built-in loops: max_tokens_per_turn, a model turn's tokens at most (None:
    what is left of the response's budget)."""

    def __init__(self, max_tokens_per_turn: Optional[int] = None):
        if max_tokens_per_turn is not None and max_tokens_per_turn < 1:
            raise ValueError(f"max_tokens_per_turn={max_tokens_per_turn}: at least 1")
        self.max_tokens_per_turn = max_tokens_per_turn


class ToolLoop(_TurnLimited):
    """rollout.agent_loop.name: tools (module docstring). A call the model completed in a turn
    that then ran out of tokens still runs."""

    async def run(self, ctx: AgentContext, row: dict, prompt_ids: list[int]):
        tools = _tools_of(ctx, "tools")
        calls = 0
        while True:
            turn = await ctx.generate(self.max_tokens_per_turn)
            parsed = tools.parse(_text(ctx, turn.token_ids))
            if ctx.ended or not (parsed.calls or parsed.errors):  # no room for results: over
                return {"tool_calls": calls}
            if not _room(ctx):  # no turn left to read the results: they are not run
                return _cut(ctx, {"tool_calls": calls})
            results = await tools.call(parsed)
            calls += len(results)
            ctx.append_observation(tools.observation(results, after_token=turn.token_ids[-1]))
            if not _room(ctx):
                return {"tool_calls": calls}


class EnvironmentLoop(_TurnLimited):
    """rollout.agent_loop.name: environment (module docstring)."""

    async def run(self, ctx: AgentContext, row: dict, prompt_ids: list[int]):
        tools = _tools_of(ctx, "environment")
        total, steps = 0.0, 0
        async with tools.environment() as env:
            first = await env.reset(row)
            while True:
                if not _room(ctx):
                    return _cut(ctx, {"reward": total, "env_steps": steps,
                                      "first_observation": first})
                turn = await ctx.generate(self.max_tokens_per_turn)
                text = _text(ctx, turn.token_ids)
                last: Optional[int] = turn.token_ids[-1] if turn.token_ids else None
                parsed = tools.parse(text) if tools.specs else None
                if parsed is not None and (parsed.calls or parsed.errors) and not ctx.ended:
                    if not _room(ctx):  # no turn left to read the results
                        return _cut(ctx, {"reward": total, "env_steps": steps,
                                          "first_observation": first})
                    results = await tools.call(parsed)
                    ctx.append_observation(tools.observation(results, after_token=last))
                    continue
                step = await env.step(ctx.tokenizer.decode(list(turn.token_ids),
                                                           skip_special_tokens=True))
                steps += 1
                total += float(step.reward or 0.0)
                if step.done or ctx.ended:  # over, or no room for the feedback
                    return {"reward": total, "env_steps": steps, "first_observation": first}
                ctx.append_observation(tools.feedback(step.observation, after_token=last))


BUILTIN_LOOPS = {"tools": ToolLoop, "environment": EnvironmentLoop}
