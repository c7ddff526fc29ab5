"""rollout.agent_loop: a user's class that runs one multi-turn trajectory over the engine.

    from verl_mcore.agent.loop import AgentLoop

    class Calculator(AgentLoop):
        def __init__(self, answer_tag="<answer>"):     # rollout.agent_loop.kwargs
            self.answer_tag = answer_tag

        async def run(self, ctx, row, prompt_ids):
            while True:
                turn = await ctx.generate()              # the model's tokens, as sampled
                text = ctx.tokenizer.decode(turn.token_ids)
                if turn.finish_reason != "stop" or self.answer_tag in text:
                    return None                          # scored by the reward sources
                result = await some_tool(text)           # other trajectories decode meanwhile
                ctx.append_observation(ctx.tokenizer.encode(result, add_special_tokens=False))

One instance per trajectory (constructed with rollout.agent_loop.kwargs), so a loop may keep the
trajectory's state on `self`. Its file is imported at start-up in a probe process, where the
class is checked (an AgentLoop subclass, `async def run(self, ctx, row, prompt_ids)`) and built
once with the kwargs, before any model is built.

Token in, token out: `ctx.generate` continues the trajectory as it stands (the prompt, every
model turn and every observation so far) and appends the model's tokens to it exactly as the
engine sampled them, with their log-probs and loss mask 1. The loop adds the tokens of
everything else itself (`ctx.append_observation`: loss mask 0, log-prob 0, counted in the
context and the token budget); it never re-tokenizes the model's text.

Limits, enforced by the runtime: rollout.agent_loop.max_turns model turns and
data.max_response_length tokens for the whole response (model and observation tokens). A turn
gets at most what is left of the budget; an observation past it is cut. Once a limit is reached
the trajectory is over: the next `ctx.generate` raises TrajectoryEnded (a BaseException, which
`except Exception` does not swallow), and the runtime ends the trajectory there with finish
reason "length". Otherwise the trajectory's finish reason is its last turn's.

`run` returns None (the reward sources score the response), a float (the environment's reward
for the trajectory), or a dict {"reward": float or None, ...} whose other keys are the
trajectory's info; the runtime puts them in SampleOutput.reward and SampleOutput.info, and logs
the info's numbers as agent/info/<key>_mean (the training batch carries no per-sample info).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import time
from typing import Any, Awaitable, Callable, Optional, Sequence

import torch

from verl_mcore.rollout.base import FinishReason
from verl_mcore.rollout.token_fields import TOKEN_FIELDS

SIGNATURE = "class Loop(AgentLoop) with async def run(self, ctx, row, prompt_ids)"


class AgentLoop:
    """Base class of rollout.agent_loop's class (module docstring)."""

    async def run(self, ctx: "AgentContext", row: dict, prompt_ids: list[int]) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.run: an agent loop implements "
                                  "async def run(self, ctx, row, prompt_ids)")


class TrajectoryEnded(BaseException):
    """Raised by `AgentContext.generate` once the trajectory has no turn or token left; the
    runtime ends the trajectory there (a BaseException, like asyncio.CancelledError, so a loop's
    `except Exception` lets it through)."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn: the tokens the engine sampled, their log-probs (None unless the engine
    returned them) and why the turn ended ("stop": a stop token, kept last; "length": the turn's
    or the trajectory's token budget); extras: the other per-token fields the engine gave
    (SampleOutput.extras: the routed experts under routing replay)."""

    token_ids: tuple[int, ...]
    logprobs: Optional[tuple[float, ...]]
    finish_reason: FinishReason
    extras: dict = dataclasses.field(default_factory=dict)


class AgentContext:
    """One trajectory's view of the runtime: the prompt, the response so far, the engine.

    prompt_ids, row: the dataset row's prompt (chat template applied) and the row itself.
    tokenizer, eos_token_ids: the actor's.
    max_turns, max_tokens: the trajectory's limits (model turns; response tokens).
    index: the trajectory's place in its replica's batch (prompt * n + sample).
    tools: the run's tools, environment, parser and observation tokens (agent/toolbox.py
        AgentTools: `await ctx.tools.call(ctx.tools.parse(text))`, `ctx.tools.observation(...)`,
        `ctx.tools.environment()`), or None when rollout.agent_loop configures none.
    """

    def __init__(self, prompt_ids: Sequence[int], row: dict, *, tokenizer, eos_token_ids: Sequence[int],
                 max_turns: int, max_tokens: int,
                 request: Callable[["AgentContext", int], Awaitable[Turn]], index: int = 0,
                 tools: Any = None):
        self.index, self.tools = index, tools
        self.prompt_ids = list(prompt_ids)
        self.row = row
        self.tokenizer, self.eos_token_ids = tokenizer, list(eos_token_ids)
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self._request = request  # the runtime's: runs one turn of this trajectory
        self.response: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns = 0
        self.sampled = 0  # model tokens: the random stream's counter of the next turn
        self.observation_tokens = 0
        self.observations_cut = 0  # observations cut at the token budget
        self.finish_reason: Optional[FinishReason] = None  # set once a limit ended it
        self.tool_wait_s = 0.0  # time between a turn's end and the next request, or the end
        self.has_logprobs = True  # every turn came with the engine's log-probs
        # per-token field -> chunks [n, *shape] over the response (observations: the default)
        self.extras: dict[str, list[torch.Tensor]] = {}
        self._turn_ended: Optional[float] = None
        self._last_reason: FinishReason = "stop"

    @property
    def token_ids(self) -> list[int]:
        """The trajectory as the model sees it: the prompt and the response so far."""
        return self.prompt_ids + self.response

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - len(self.response)

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None

    async def generate(self, max_new_tokens: Optional[int] = None) -> Turn:
        """The model's next turn, continuing `token_ids`: at most `max_new_tokens` (None: all
        that is left of the budget) new tokens, appended to the response (loss mask 1). Raises
        TrajectoryEnded when no turn or token is left."""
        if (self.turns >= self.max_turns or self.tokens_left <= 0) and not self.ended:
            self.finish_reason = "length"  # it wanted another turn: cut, as by a length limit
        if self.ended:
            raise TrajectoryEnded(self.finish_reason)
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"AgentContext.generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        budget = self.tokens_left if max_new_tokens is None else min(max_new_tokens, self.tokens_left)
        self._waited()
        turn = await self._request(self, budget)
        self._turn_ended = time.perf_counter()
        self.turns += 1
        self.sampled += len(turn.token_ids)
        self._add_extras(turn.extras, len(turn.token_ids))
        self.response += turn.token_ids
        self.loss_mask += [1] * len(turn.token_ids)
        self.has_logprobs &= turn.logprobs is not None
        self.logprobs += turn.logprobs if turn.logprobs is not None else [0.0] * len(turn.token_ids)
        self._last_reason = turn.finish_reason
        if not self.tokens_left and turn.finish_reason != "stop":
            # Cut at the budget; a turn whose stop token was the budget's last is complete
            # (as a one-turn generation of the same tokens), until more is asked for.
            self.finish_reason = "length"
        return turn

    def append_observation(self, token_ids: Sequence[int]) -> int:
        """Append tokens the model did not write (a tool's result, an environment's feedback,
        with the chat template's delimiters): loss mask 0, log-prob 0. Past the token budget
        they are cut and the trajectory ends ("length"). Returns how many were appended."""
        ids = [int(t) for t in token_ids]
        if self.ended and ids:
            raise RuntimeError(f"AgentContext.append_observation: the trajectory already ended "
                               f"({self.finish_reason}); nothing more can be appended")
        room = self.tokens_left
        if len(ids) >= room:
            if len(ids) > room:
                self.observations_cut += 1
            ids = ids[:room]
            self.finish_reason = "length"
        self._add_extras({}, len(ids))
        self.response += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.observation_tokens += len(ids)
        return len(ids)

    def _add_extras(self, extras: dict, n: int) -> None:
        """The per-token extras of n tokens about to join the response: `extras`' values, the
        field's default for those it lacks (and for the tokens before a field first came)."""
        for name in extras.keys() - self.extras.keys():
            self.extras[name] = [TOKEN_FIELDS[name].fill(len(self.response))]
        for name, chunks in self.extras.items():
            chunks.append(torch.as_tensor(extras[name]) if name in extras else TOKEN_FIELDS[name].fill(n))

    def response_extras(self) -> dict[str, torch.Tensor]:
        """The per-token extras of the whole response, [len(response), *shape] each."""
        return {name: torch.cat(chunks) for name, chunks in self.extras.items()}

    def close(self) -> FinishReason:
        """The trajectory's finish reason, once its loop is over."""
        self._waited()
        if self.finish_reason is None:
            self.finish_reason = self._last_reason
        return self.finish_reason

    def _waited(self) -> None:
        if self._turn_ended is not None:
            self.tool_wait_s += time.perf_counter() - self._turn_ended
            self._turn_ended = None


def split_result(result: Any, where: str) -> tuple[Optional[float], dict]:
    """What `run` returned -> (reward, info); raises ValueError naming `where` for anything
    else (module docstring)."""
    if result is None:
        return None, {}
    if isinstance(result, dict):
        info = dict(result)
        reward = info.pop("reward", None)
        return (None if reward is None else _reward(reward, where)), info
    return _reward(result, where), {}


def _reward(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{where} returned reward {value!r}; run returns None, a finite number "
                         "(the trajectory's reward) or a dict with a 'reward' key")
    return float(value)


def check_agent_loop(obj: Any, key: str, path: str, name: str, kwargs: dict,
                     construct: bool = False) -> str:
    """That `obj` (the config key `key`'s, `name` in `path`) is an AgentLoop subclass with an
    async run(self, ctx, row, prompt_ids), constructible with `kwargs` (built once where
    `construct`: in the import probe). Raises ValueError naming the file and the class."""
    what = f"{key}.name={name!r} in {path}"
    if not (inspect.isclass(obj) and issubclass(obj, AgentLoop)):
        kind = "a class" if inspect.isclass(obj) else f"a {type(obj).__name__}"
        raise ValueError(f"{what} is {kind} that does not subclass verl_mcore.agent.loop.AgentLoop: "
                         f"{key} is {SIGNATURE}")
    run = getattr(obj, "run")
    if run is AgentLoop.run:
        raise ValueError(f"{what} does not implement run: {key} is {SIGNATURE}")
    if not inspect.iscoroutinefunction(run):
        raise ValueError(f"{what}: run is not `async def`: {key} is {SIGNATURE}")
    try:
        inspect.signature(run).bind(None, None, None, None)
    except TypeError as e:
        raise ValueError(f"{what}: run{inspect.signature(run)} cannot be called as "
                         f"run(self, ctx, row, prompt_ids): {e}") from None
    try:
        inspect.signature(obj).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"{what}: {name}{inspect.signature(obj)} cannot be built as "
                         f"{name}(**{key}.kwargs) with kwargs {sorted(kwargs)}: {e}") from None
    if construct:
        obj(**kwargs)
    return "class"
