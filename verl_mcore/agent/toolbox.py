"""What an agent loop's trajectories call, for one run: the tools and the environment (run in the
sandbox's worker processes), the parser of tool calls, and the observation tokens.

    tools = AgentTools.load(cfg.rollout.agent_loop, tokenizer)   # start-up: files probed
    ...                                                        # per trajectory (ctx.tools):
    parsed = tools.parse(text)                                 # the turn's calls and errors
    results = await tools.call(parsed)                         # run in the sandbox, counted
    ctx.append_observation(tools.observation(results, after_token=turn.token_ids[-1]))
    async with tools.environment() as env: ...                 # reset(row) / step(text)
    metrics = tools.take_metrics()                             # the batch's agent/tool/* ...

`load` probes every file (tools, environment, a user's parser) in a fresh interpreter before any
model is built, and checks the chat template can make observation turns. The sandbox's workers
start on the first call, and only where loops run: on the first rank of each generation TP group
(agent/runtime.py), so tools run once per replica.
"""
from __future__ import annotations

from typing import Optional, Sequence

from verl_mcore.agent.environment import load_environment
from verl_mcore.agent.metrics import ToolMetrics
from verl_mcore.agent.observation import ObservationTokens
from verl_mcore.agent.parsers import ParsedTurn, load_parser, parse_error_result
from verl_mcore.agent.sandbox import EnvSession, ToolSandbox
from verl_mcore.agent.tools import ToolResult, load_tools

_KEY = "rollout.agent_loop"


class AgentTools:
    """The run's tools, environment, parser and observation tokens (module docstring); `cfg`: an
    AgentLoopConfig (its tools, environment, sandbox, parser, observation_role,
    max_observation_tokens)."""

    def __init__(self, cfg, tokenizer, tools, environment, parser, key: str = _KEY):
        self.cfg, self.key = cfg, key
        self.specs, self.environment_spec = tools, environment
        self._parse = parser
        self.observations = ObservationTokens.from_config(tokenizer, cfg, key)
        # An environment's feedback is what a user says back (the template's user turn).
        self.feedback_tokens = (ObservationTokens(tokenizer, "user", cfg.max_observation_tokens,
                                                  key=key) if environment is not None else None)
        self.metrics = ToolMetrics()
        self._sandbox: Optional[ToolSandbox] = None

    @classmethod
    def load(cls, cfg, tokenizer, key: str = _KEY) -> Optional["AgentTools"]:
        """The tools of `cfg` with every file probed, or None when it names no tool and no
        environment."""
        tools = load_tools(cfg.tools, f"{key}.tools")
        environment = load_environment(cfg.environment, f"{key}.environment")
        if not tools and environment is None:
            return None
        return cls(cfg, tokenizer, tools, environment, load_parser(cfg.parser, f"{key}.parser"),
                   key)

    @property
    def schemas(self) -> list[dict]:
        """The tools' OpenAI-style schemas (what the prompt shows the model)."""
        return [spec.schema for spec in self.specs]

    # ------------------------------------------------------------------ per trajectory

    def parse(self, text: str) -> ParsedTurn:
        """The tool calls (and malformed ones) in a model turn's text."""
        return self._parse(text)

    async def call(self, parsed: ParsedTurn) -> list[ToolResult]:
        """Every call of a turn run in the sandbox (concurrently), in the order written, then
        an error result for each malformed call; each counted in the metrics. Never raises for
        what a tool or the model did."""
        results = list(await self.sandbox.call_all(parsed.calls)) if parsed.calls else []
        results += [parse_error_result(e) for e in parsed.errors]
        for r in results:
            self.metrics.add(r)
        return results

    def observation(self, results: Sequence[ToolResult],
                    after_token: Optional[int] = None) -> list[int]:
        """The token ids of one tool turn (observation_role) holding the results' texts, then
        the assistant turn's opener; `after_token`: the model turn's last token (observation.py).
        A turn past max_observation_tokens is cut and says so."""
        return self.observations.turn([r.text for r in results], after_token).ids

    def feedback(self, text: str, after_token: Optional[int] = None) -> list[int]:
        """The token ids of an environment's feedback as a user turn, then the assistant
        turn's opener (cut like an observation)."""
        return self.feedback_tokens.turn([text], after_token).ids

    def environment(self) -> EnvSession:
        """A trajectory's environment session: `async with tools.environment() as env:` then
        `await env.reset(row)`, `await env.step(text)` (agent/sandbox.py EnvSession)."""
        if self.environment_spec is None:
            raise ValueError(f"{self.key}: no environment is configured "
                             f"({self.key}.environment.path / name)")
        return _CountedSession(self.sandbox.session(), self.metrics)

    @property
    def sandbox(self) -> ToolSandbox:
        """The worker processes, started on first use."""
        if self._sandbox is None:
            s = self.cfg.sandbox
            self._sandbox = ToolSandbox(
                self.specs, self.environment_spec, num_workers=s.num_workers,
                timeout_s=s.timeout_s, max_memory_mb=s.max_memory_mb,
                max_output_chars=s.max_output_chars, startup_timeout_s=s.startup_timeout_s,
                key=f"{self.key}.sandbox")
        return self._sandbox

    def take_metrics(self) -> dict[str, float]:
        """The per-tool and environment metrics since the last look (agent/metrics.py)."""
        out, self.metrics = self.metrics.to_dict(), ToolMetrics()
        return out

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


class _CountedSession:
    """An EnvSession whose steps are counted in the run's metrics."""

    def __init__(self, session: EnvSession, metrics: ToolMetrics):
        self._session, self._metrics = session, metrics

    async def reset(self, row) -> str:
        return await self._session.reset(row)

    async def step(self, action_text: str):
        step = await self._session.step(action_text)
        self._metrics.add_env_step(step)
        return step

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> "_CountedSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
