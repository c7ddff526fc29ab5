"""ToolMetrics: per-tool counts and seconds, merged across trajectories."""
from verl_mcore.agent.environment import EnvStep
from verl_mcore.agent.metrics import ToolMetrics
from verl_mcore.agent.tools import ToolResult


def test_counts_merge_across_trajectories():
    a, b = ToolMetrics(), ToolMetrics()
    for r in (ToolResult("x", "ok", 0.5, "calc"), ToolResult("x", "error", 0.25, "calc"),
              ToolResult("x", "timeout", 2.0, "python"), ToolResult("x", "unknown_tool", 0, "made_up"),
              ToolResult("x", "parse_error")):
        a.add(r)
    b.add(ToolResult("x", "bad_arguments", 0.0, "calc"))
    b.add_env_step(EnvStep("o", 1.0, True, "ok", 0.125))
    b.add_env_step(EnvStep("o", 0.0, True, "timeout", 1.0))
    total = ToolMetrics.total([a, b]).to_dict()
    assert total == {
        "agent/tool/calc/calls": 3.0, "agent/tool/calc/errors": 1.0, "agent/tool/calc/timeouts": 0.0,
        "agent/tool/calc/bad_arguments": 1.0, "agent/tool/calc/seconds": 0.75,
        "agent/tool/python/calls": 1.0, "agent/tool/python/errors": 0.0,
        "agent/tool/python/timeouts": 1.0, "agent/tool/python/bad_arguments": 0.0,
        "agent/tool/python/seconds": 2.0,
        "agent/tool/unknown_tool": 1.0, "agent/tool/parse_errors": 1.0,
        "agent/env/steps": 2.0, "agent/env/errors": 0.0, "agent/env/timeouts": 1.0,
        "agent/env/seconds": 1.125}
    assert "agent/tool/made_up/calls" not in total  # invented names make no metrics of their own
    assert a.to_dict()["agent/tool/calc/calls"] == 2.0  # total() left its parts alone
    assert "agent/env/steps" not in a.to_dict()
