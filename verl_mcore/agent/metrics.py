"""Per-tool metrics of agent trajectories: a small accumulator each trajectory fills and the
runtime merges (`a.merge(b)`, or `ToolMetrics.total(many)`), reported as

    agent/tool/<name>/calls, .../errors, .../timeouts, .../bad_arguments, .../seconds
    agent/tool/unknown_tool      calls of a name no tool has (not per name: the model invents
                                 names, and each would become a metric of its own)
    agent/tool/parse_errors      turns' malformed calls (parsers.py)
    agent/env/steps, agent/env/errors, agent/env/timeouts, agent/env/seconds

Counts are sums over the trajectories merged; seconds are the tools' wall time summed (a call's,
whoever waited for it), not the step's time.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable

from verl_mcore.agent.environment import EnvStep
from verl_mcore.agent.tools import ToolResult

_PER_TOOL = ("calls", "errors", "timeouts", "bad_arguments", "seconds")
_COUNTED = {"error": "errors", "timeout": "timeouts", "bad_arguments": "bad_arguments"}


@dataclass
class ToolMetrics:
    per_tool: dict[str, collections.Counter] = field(default_factory=dict)
    unknown_tool: int = 0
    parse_errors: int = 0
    env: collections.Counter = field(default_factory=collections.Counter)

    def add(self, result: ToolResult) -> None:
        """Count one call's result (every status: ToolSandbox.call's, parsers'
        parse_error_result)."""
        if result.status == "parse_error":
            self.parse_errors += 1
            return
        if result.status == "unknown_tool":
            self.unknown_tool += 1
            return
        counts = self.per_tool.setdefault(result.tool, collections.Counter())
        counts["calls"] += 1
        counts["seconds"] += result.seconds
        if result.status in _COUNTED:
            counts[_COUNTED[result.status]] += 1

    def add_env_step(self, step: EnvStep) -> None:
        self.env["steps"] += 1
        self.env["seconds"] += step.seconds
        if step.status in ("error", "timeout"):
            self.env[step.status + "s"] += 1

    def merge(self, other: "ToolMetrics") -> "ToolMetrics":
        """Add `other`'s counts to these (in place); returns self."""
        for name, counts in other.per_tool.items():
            self.per_tool.setdefault(name, collections.Counter()).update(counts)
        self.unknown_tool += other.unknown_tool
        self.parse_errors += other.parse_errors
        self.env.update(other.env)
        return self

    @classmethod
    def total(cls, many: Iterable["ToolMetrics"]) -> "ToolMetrics":
        out = cls()
        for m in many:
            out.merge(m)
        return out

    def to_dict(self, prefix: str = "agent") -> dict[str, float]:
        """The metrics by name; a tool called at least once has all its keys (zeros too)."""
        out: dict[str, float] = {}
        for name in sorted(self.per_tool):
            for k in _PER_TOOL:
                out[f"{prefix}/tool/{name}/{k}"] = float(self.per_tool[name][k])
        out[f"{prefix}/tool/unknown_tool"] = float(self.unknown_tool)
        out[f"{prefix}/tool/parse_errors"] = float(self.parse_errors)
        if self.env:
            for k in ("steps", "errors", "timeouts", "seconds"):
                out[f"{prefix}/env/{k}"] = float(self.env[k])
        return out
