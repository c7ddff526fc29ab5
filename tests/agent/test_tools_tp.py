"""The built-in tools loop at TP_g = 2 (one replica on two gloo ranks): the tools run once per
replica, in the sandbox of the group's first rank only, and both ranks return the same
trajectories and train on the same batch."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.agent.test_agent_e2e import _train_recording
from tests.agent.test_builtin_loops import ALWAYS, ROOT, _rows, _tiny, tiny_model  # noqa: F401
from tests.multiproc import run_on_ranks

LOGGING = Path(__file__).resolve().parent / "logging_tool.py"


def _recording_with_pid(rank, world_size, overrides, config):
    return os.getpid(), _train_recording(rank, world_size, overrides, config)


@pytest.mark.slow  # ~40 s: two ranks build and train
@pytest.mark.distributed
def test_the_tools_loop_at_tp_g_2_calls_each_tool_once(tiny_model, tmp_path):  # noqa: F811
    log = tmp_path / "calls.log"
    run = tmp_path / "run"
    overrides = _tiny(tiny_model, run) + [
        f"rollout.agent_loop.tools=[{{path: {LOGGING}, name: calculator, kwargs: {{log: {log}}}}}]",
        f"rollout.agent_loop.parser={{path: {ALWAYS}, name: always}}",
        "rollout.agent_loop.max_turns=3", "rollout.agent_loop.kwargs={max_tokens_per_turn: 4}",
        "data.max_response_length=64", "parallel.tensor_model_parallel_size=2",
        "rollout.tensor_parallel_size=2"]
    (pid0, (first, trained0, served0)), (pid1, (second, trained1, served1)) = run_on_ranks(
        _recording_with_pid, 2, args=(overrides, str(ROOT / "examples/agent/calculator.yaml")),
        timeout=500)
    assert first == second == 0, (first, second)
    assert served0 == served1 and trained0 == trained1
    callers = log.read_text().split()
    # 4 trajectories, 2 calls each (the third turn's call has no turn left to read it)
    assert len(callers) == 4 * 2 and set(callers) == {str(pid0)}, (callers, pid0, pid1)
    for _, _, ids, mask, turns in served0[0]:
        assert turns == 3 and mask.count(0) > 0
    assert _rows(run)[0]["agent/tool/calculator/calls"] == 8
