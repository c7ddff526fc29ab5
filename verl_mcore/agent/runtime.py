"""The agent-loop runtime: every trajectory of a replica's prompt batch at once over the engine.

    runtime = load_agent_loop(cfg.rollout.agent_loop, tokenizer, eos_ids, vocab_size)
    outputs = runtime(phase, prompts, sampling)    # n SampleOutputs per prompt, ordered

Each trajectory is a coroutine of the user's loop (agent/loop.py) on one asyncio event loop.
The loop alternates between letting the coroutines run until they wait (for a model turn, a
tool, a timer) and one round of the engine's serving session (rollout/serving.py): the turns
asked for since the last round are submitted, in trajectory order, and decoded with those
already running; the turns that finished wake their trajectories. A trajectory waiting for a
tool holds no slot: the engine decodes the others meanwhile. When nothing is left to decode
and every open trajectory waits on something else, the runtime waits for the first of them.

KV across turns: a trajectory's requests are one serving session, so the engine keeps its KV
between turns and the next turn prefills only the tokens appended since (the last sampled
token and the observation); the trajectory's session is released when it ends. The n samples
of a prompt submit their first turns together and share the prompt's blocks.

Random streams: sample j of prompt i draws with key stream_key(sampling.seed, i, j), its counter
continuing over its turns (the model tokens it sampled before): a trajectory's tokens do not
depend on when its turns were decoded or what ran beside them, and a one-turn trajectory is
generate()'s sample exactly.

TP_g > 1. The engine's decode step is collective over the generation TP group, so its ranks
must make the same serving calls in the same order. The user's loops (and so the tools they
call) run on the group's first rank only -- once per replica, as tools must -- and each round
it sends the others what to do (`ReplicaChannel.share`: the round's requests, with their token
ids, observations included, and the sessions to release); they replay it on their engine,
which samples the same tokens. At the end the first rank sends the outputs, so every rank of
the group returns the same trajectories, and a digest of the tokens each rank's engine sampled
is compared (a mismatch stops the run). A loop that raises on the first rank stops every rank
of the group with its error. User code may therefore do anything between its awaits (time,
randomness, I/O): nothing of it needs to be reproduced on the other ranks.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import statistics
import time
from typing import Any, Optional, Sequence

import torch.distributed as dist

from verl_mcore.agent.builtin import BUILTIN_LOOPS
from verl_mcore.agent.loop import AgentContext, Turn, TrajectoryEnded, check_agent_loop, split_result
from verl_mcore.agent.toolbox import AgentTools
from verl_mcore.rollout.base import SampleOutput, SamplingParams
from verl_mcore.rollout.generate_fn import GenerateFnError, check_outputs
from verl_mcore.rollout.serving import Request, Server, stream_key
from verl_mcore.user_code import exit_raises_in_this_thread, load_checked, user_line
from verl_mcore.utils.metric_names import name_fragment
from verl_mcore.utils.doing import doing

_KEY = "rollout.agent_loop"
_SUMMED = ("agent/tool/", "agent/env/")  # ToolMetrics.to_dict's keys


class AgentLoopError(RuntimeError):
    """rollout.agent_loop's class raised, returned what a trajectory cannot hold, or the ranks
    of a generation TP group disagreed on the tokens they sampled."""


class ReplicaChannel:
    """Messages from the first rank of a generation TP group (the leader, which runs the agent
    loops) to the group's other ranks. `share(obj)` on the leader sends obj and returns it;
    `share()` elsewhere returns what the leader sent. Without a group (TP_g = 1) it is the
    identity."""

    def __init__(self, group=None):
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.src = dist.get_process_group_ranks(self.group)[0] if self.group is not None else None

    @property
    def leads(self) -> bool:
        return self.group is None or dist.get_rank() == self.src

    def share(self, obj: Any = None) -> Any:
        if self.group is None:
            return obj
        box = [obj if self.leads else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


class AgentRuntime:
    """rollout.agent_loop's class (`loop_cls`, `name` in `path`, built with `kwargs` once per
    trajectory) run over a GenerationPhase's serving session (module docstring)."""

    def __init__(self, loop_cls, kwargs: dict, path: Optional[str], name: str, *, max_turns: int,
                 tokenizer, eos_token_ids: Sequence[int], vocab_size: int,
                 tools: Optional[AgentTools] = None):
        self.loop_cls, self.kwargs, self.path, self.name = loop_cls, dict(kwargs), path, name
        self.max_turns, self.tokenizer = max_turns, tokenizer
        self.eos_token_ids, self.vocab_size = list(eos_token_ids), vocab_size
        # The run's tools (their sandbox starts on the first call: on the leading ranks only).
        self.tools = tools
        self.label = f"{_KEY} {path}:{name}" if path else f"{_KEY} {name} (built in)"

    def close(self) -> None:
        """Stop the tools' sandbox workers, where they started."""
        if self.tools is not None:
            self.tools.close()

    def __call__(self, phase, prompts, sampling: SamplingParams) -> list[SampleOutput]:
        """n trajectories per prompt of `prompts` (input_ids, rows), ordered by (prompt,
        sample), checked as a generate function's outputs are (rollout/generate_fn.py); the
        phase gets the runtime's metrics and, after a weight update, the first turns for the
        weight-sync check."""
        count = len(prompts.input_ids) * sampling.n
        if not count:
            return []
        channel = ReplicaChannel(phase.groups.gen_tp)
        max_len = max(map(len, prompts.input_ids)) + sampling.max_new_tokens
        with phase.serving(sampling, max_len=max_len, sessions=count) as (server, sp):
            if channel.leads:
                outputs, firsts, metrics = self._lead(server, sp, channel, prompts)
            else:
                outputs, firsts, metrics = _follow(server, channel)
        phase.keep_for_check(prompts.input_ids, firsts, sampling.temperature)
        # The tools' and environment's metrics are counts and summed seconds (agent/metrics.py):
        # they add up over the step's calls; the rest are this batch's.
        counts = {k: v for k, v in metrics.items() if k.startswith(_SUMMED)}
        phase.note({k: v for k, v in metrics.items() if k not in counts}, summed=counts)
        try:
            check_outputs(outputs, len(prompts.input_ids), sampling, self.vocab_size, self.label)
        except GenerateFnError as e:
            raise AgentLoopError(str(e)) from None
        return outputs

    def _lead(self, server: Server, sampling: SamplingParams, channel: ReplicaChannel, prompts):
        loop = asyncio.new_event_loop()
        lead = _Leader(self, server, sampling, channel, prompts)
        rule = (self.label, "it runs in the trainer, which this would have ended: end the "
                            "trajectory by returning from run")
        try:
            with doing(f"running {self.label} on {len(prompts.input_ids)} prompts x n={sampling.n}"), \
                    exit_raises_in_this_thread(rule):
                result = loop.run_until_complete(lead.run())
        except BaseException as e:  # the other ranks wait for the next round: tell them
            channel.share(("error", f"{type(e).__name__}: {e}"))
            raise
        finally:
            loop.close()
        outputs, firsts, metrics = result
        channel.share(("end", outputs, firsts, metrics, lead.digest.hexdigest()))
        return result


def _follow(server: Server, channel: ReplicaChannel):
    """A non-leading rank of the group: the leader's rounds replayed on this rank's engine."""
    digest = hashlib.sha1()
    while True:
        message = channel.share()
        if message[0] == "round":
            _, requests, releases = message
            for request in requests:
                server.submit(request)
            for session in releases:
                server.release(session)
            for rid, out in server.step():
                digest.update(repr((rid, out.token_ids)).encode())
        elif message[0] == "end":
            _, outputs, firsts, metrics, theirs = message
            if theirs != digest.hexdigest():
                raise AgentLoopError(
                    f"rank {dist.get_rank()} of a generation TP group sampled other tokens than "
                    "the group's first rank from the same requests: the engine's ranks are not in "
                    "step (a bug, or different weights on the ranks of the group)")
            return outputs, firsts, metrics
        else:
            raise AgentLoopError(f"{_KEY} failed on the generation TP group's first rank: {message[1]}")


class _Leader:
    """The leading rank's event loop over one batch (module docstring)."""

    def __init__(self, runtime: AgentRuntime, server: Server, sampling: SamplingParams,
                 channel: ReplicaChannel, prompts):
        self.rt, self.server, self.sp, self.channel = runtime, server, sampling, channel
        self.prompts = prompts
        self.n = sampling.n
        self.seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        self.asked: list[tuple[int, AgentContext, int, asyncio.Future]] = []  # turns not submitted
        self.waiting: dict[int, tuple[int, asyncio.Future]] = {}  # request id -> trajectory, turn
        self.releases: list[int] = []
        self.firsts: dict[int, SampleOutput] = {}  # each trajectory's first turn
        self.digest = hashlib.sha1()
        self.rounds = 0
        self.idle_s = 0.0
        self.wake: Optional[asyncio.Event] = None

    async def run(self):
        self.wake = asyncio.Event()
        contexts = [AgentContext(self.prompts.input_ids[t // self.n], self.prompts.rows[t // self.n],
                                 tokenizer=self.rt.tokenizer, eos_token_ids=self.rt.eos_token_ids,
                                 max_turns=self.rt.max_turns, max_tokens=self.sp.max_new_tokens,
                                 request=self._turn, index=t, tools=self.rt.tools)
                    for t in range(len(self.prompts.input_ids) * self.n)]
        tasks = [asyncio.ensure_future(self._trajectory(t, ctx)) for t, ctx in enumerate(contexts)]
        for task in tasks:
            task.add_done_callback(lambda _: self.wake.set())
        try:
            while True:
                self.wake.clear()
                await self._settle()
                failed = next((task for task in tasks if task.done() and task.exception() is not None), None)
                if failed is not None:
                    raise failed.exception()
                if self.asked or self.releases or self.server.busy:
                    self._round()
                    continue
                if all(task.done() for task in tasks):
                    break
                # Nothing to decode: every open trajectory waits on something else (a tool).
                start = time.perf_counter()
                await self.wake.wait()
                self.idle_s += time.perf_counter() - start
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        results = [task.result() for task in tasks]
        outputs = [self._output(t, ctx, *result) for t, (ctx, result) in enumerate(zip(contexts, results))]
        firsts = [self.firsts[t] for t in sorted(self.firsts)]
        metrics = self._metrics(contexts)
        metrics.update(info_metrics([info for _, info in results]))
        if self.rt.tools is not None:  # per tool, of this batch's trajectories
            metrics.update(self.rt.tools.take_metrics())
        return outputs, firsts, metrics

    async def _settle(self) -> None:
        """Let the trajectories run until they wait: yield to the event loop until a pass adds
        no request (a turn's result resumes its trajectory one loop iteration later)."""
        while True:
            before = len(self.asked) + len(self.releases)
            for _ in range(2):
                await asyncio.sleep(0)
            if len(self.asked) + len(self.releases) == before:
                return

    def _round(self) -> None:
        """Submit the turns asked for (in trajectory order), release ended trajectories' KV,
        decode one round, hand finished turns to their trajectories."""
        asked = sorted(self.asked, key=lambda a: a[0])
        self.asked = []
        releases, self.releases = sorted(self.releases), []
        requests = [Request(tuple(ctx.token_ids), key=stream_key(self.seed, t // self.n, t % self.n),
                            draws=ctx.sampled, max_new_tokens=budget, stop_token_ids=self.sp.stop_token_ids,
                            session=t, share=t // self.n if ctx.turns == 0 else None,
                            prompt_index=t // self.n, sample_index=t % self.n)
                    for t, ctx, budget, _ in asked]
        self.channel.share(("round", requests, releases))
        for (t, ctx, _, future), request in zip(asked, requests):
            self.waiting[self.server.submit(request)] = (t, future)
        for session in releases:
            self.server.release(session)
        self.rounds += 1
        for rid, out in self.server.step():
            self.digest.update(repr((rid, out.token_ids)).encode())
            t, future = self.waiting.pop(rid)
            if t not in self.firsts:
                self.firsts[t] = out
            if not future.cancelled():
                future.set_result(Turn(tuple(out.token_ids),
                                       None if out.logprobs is None else tuple(out.logprobs),
                                       out.finish_reason, dict(out.extras)))

    async def _turn(self, ctx: AgentContext, budget: int) -> Turn:
        """AgentContext's request: the next round submits it."""
        future = asyncio.get_running_loop().create_future()
        self.asked.append((ctx.index, ctx, budget, future))
        self.wake.set()
        return await future

    async def _trajectory(self, t: int, ctx: AgentContext):
        rt = self.rt
        where = f" (trajectory of prompt {t // self.n}, sample {t % self.n})"
        try:
            loop = rt.loop_cls(**rt.kwargs)
            result = await loop.run(ctx, ctx.row, list(ctx.prompt_ids))
        except TrajectoryEnded:
            result = None  # a limit ended it inside the loop
        except (Exception, SystemExit) as e:  # ExitCalled for an os._exit; sys.exit too
            raise AgentLoopError(f"{rt.label} raised {type(e).__name__}: {e}"
                                 f"{user_line(e, rt.path)}{where}") from e
        finally:
            ctx.close()
            self.releases.append(t)  # its kept KV
            self.wake.set()
        try:
            return split_result(result, rt.label + where)
        except ValueError as e:
            raise AgentLoopError(str(e)) from None

    def _output(self, t: int, ctx: AgentContext, reward: Optional[float], info: dict) -> SampleOutput:
        return SampleOutput(prompt_index=t // self.n, sample_index=t % self.n, token_ids=list(ctx.response),
                            logprobs=list(ctx.logprobs) if ctx.has_logprobs and self.sp.logprobs else None,
                            finish_reason=ctx.finish_reason, loss_mask=list(ctx.loss_mask),
                            turns=ctx.turns, reward=reward, info=info, extras=ctx.response_extras())

    def _metrics(self, contexts: list[AgentContext]) -> dict[str, float]:
        tokens = sum(len(c.response) for c in contexts)
        observed = sum(c.observation_tokens for c in contexts)
        turns = [c.turns for c in contexts]
        return {"agent/trajectories": float(len(contexts)),
                "agent/turns_mean": statistics.fmean(turns),
                "agent/turns_max": float(max(turns)),
                "agent/observation_tokens_mean": observed / len(contexts),
                "agent/masked_share": observed / tokens if tokens else 0.0,
                "agent/observations_cut": float(sum(c.observations_cut for c in contexts)),
                "agent/length_ended_share": sum(c.finish_reason == "length" for c in contexts) / len(contexts),
                "agent/tool_wait_seconds_mean": statistics.fmean(c.tool_wait_s for c in contexts),
                "agent/engine_idle_seconds": self.idle_s,
                "agent/rounds": float(self.rounds)}


def info_metrics(infos: Sequence[dict]) -> dict[str, float]:
    """`agent/info/<key>_mean`: the mean of each number the loops' run results reported beside
    the reward (SampleOutput.info: the tools loop's tool_calls, the environment loop's
    env_steps), over the trajectories that reported it. Other values (text) stay in the
    outputs' info only: the training batch carries no per-sample objects."""
    sums: dict[str, list[float]] = {}
    for info in infos:
        for key, value in info.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                sums.setdefault(key, []).append(float(value))
    return {f"agent/info/{name_fragment(k)}_mean": statistics.fmean(v) for k, v in sums.items()}


def load_agent_loop(cfg, tokenizer, eos_token_ids: Sequence[int], vocab_size: int) -> Optional[AgentRuntime]:
    """rollout.agent_loop's runtime (cfg: its AgentLoopConfig), or None when none is configured.
    The file is imported first in a fresh interpreter under import_timeout_s, where the class is
    checked and built once with the kwargs (check_agent_loop), before any model is built."""
    if not cfg.path and cfg.name in BUILTIN_LOOPS:  # agent/builtin.py
        cls, path = BUILTIN_LOOPS[cfg.name], None
        check_agent_loop(cls, _KEY, "verl_mcore/agent/builtin.py", cfg.name, dict(cfg.kwargs),
                         construct=True)
    else:
        loaded = load_checked(cfg, _KEY, (check_agent_loop, (_KEY, cfg.path, cfg.name,
                                                             dict(cfg.kwargs))))
        if loaded is None:
            if cfg.tools or cfg.environment.path:
                raise ValueError(f"{_KEY}.tools / .environment are set but no agent loop runs "
                                 f"them: set {_KEY}.name to a built-in loop "
                                 f"({sorted(BUILTIN_LOOPS)}) or to your class with {_KEY}.path")
            return None
        cls, path = loaded
    return AgentRuntime(cls, cfg.kwargs, path, cfg.name, max_turns=cfg.max_turns, tokenizer=tokenizer,
                        eos_token_ids=eos_token_ids, vocab_size=vocab_size,
                        tools=AgentTools.load(cfg, tokenizer, _KEY))
