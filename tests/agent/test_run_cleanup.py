"""A run whose agent loop fails after the tools' sandbox started leaves no worker process behind
in the trainer's process (pooled test ranks, the Python API: the process lives on after fit)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.test_agent_e2e import _train_recording
from tests.agent.test_builtin_loops import ROOT, _tiny, tiny_model  # noqa: F401 - the fixture
from tests.multiproc import run_on_ranks

FAILING = Path(__file__).resolve().parent / "failing_parser.py"


def _children_after_failed_run(rank, world_size, overrides, config):
    import psutil

    outcome, _, _ = _train_recording(rank, world_size, overrides, config)
    alive = [p for p in psutil.Process().children(recursive=True)
             if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
             and "sandbox_worker" in " ".join(p.cmdline())]
    return outcome, [" ".join(p.cmdline())[:200] for p in alive]


@pytest.mark.distributed
def test_a_failed_run_stops_the_sandbox_workers(tiny_model, tmp_path):  # noqa: F811
    """~15 s. The parser raises on a trajectory's third turn: the run fails naming it, and the
    sandbox's workers (started by the first turns' calls) are gone when fit returns."""
    overrides = _tiny(tiny_model, tmp_path / "run") + [
        f"rollout.agent_loop.parser={{path: {FAILING}, name: fail_later}}",
        "rollout.agent_loop.max_turns=4", "rollout.agent_loop.kwargs={max_tokens_per_turn: 4}",
        "data.max_response_length=64"]
    config = str(ROOT / "examples/agent/calculator.yaml")
    [(outcome, alive)] = run_on_ranks(_children_after_failed_run, 1, fresh=True,
                                      args=(overrides, config), timeout=300)
    assert outcome != 0 and "the parser gives up" in str(outcome), outcome
    assert alive == [], alive
