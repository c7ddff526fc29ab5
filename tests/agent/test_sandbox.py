"""The tool sandbox against hostile tools and environments: each misdeed becomes an observation
and a counted metric, and the sandbox goes on (issue 41's hostile cases)."""
import asyncio
import dataclasses
import os
import time

import pytest

from verl_mcore.agent.environment import EnvironmentFailure
from verl_mcore.agent.metrics import ToolMetrics
from verl_mcore.agent.sandbox import SandboxError, ToolSandbox
from verl_mcore.agent.tools import ToolCall
from verl_mcore.config.loading import from_dict
from verl_mcore.config.schema import AgentToolsConfig, EnvironmentConfig, SandboxConfig, ToolConfig
from verl_mcore.errors import ConfigError
from verl_mcore.user_code import UserCodeError

HOSTILE = os.path.join(os.path.dirname(__file__), "hostile_tools.py")


def _config(workers: int, **sandbox) -> AgentToolsConfig:
    return AgentToolsConfig(
        tools=[ToolConfig(path=HOSTILE, name=n) for n in ("echo", "nap", "misbehave")]
        + [ToolConfig(path=HOSTILE, name="Counter", kwargs={"start": 10})],
        environment=EnvironmentConfig(path=HOSTILE, name="Room", kwargs={"target": 3}),
        sandbox=SandboxConfig(num_workers=workers, timeout_s=1.0, max_memory_mb=1024,
                              max_output_chars=1000, **sandbox))


@pytest.fixture(scope="module")
def sandbox():
    with ToolSandbox.from_config(_config(2)) as sb:
        yield sb


@pytest.fixture(scope="module")
def one_worker():
    with ToolSandbox.from_config(_config(1)) as sb:
        yield sb


def misbehave(sb, how):
    return sb.call_sync(ToolCall("misbehave", {"how": how}))


def test_hostile_tools_become_observations_and_metrics(sandbox, capfd):
    metrics = ToolMetrics()
    restarts = sandbox.restarts
    results = {how: misbehave(sandbox, how) for how in (
        "hang", "segfault", "exit", "raise", "sys_exit", "huge_return", "huge_print",
        "native_print", "special", "memory", "json")}
    for r in results.values():
        metrics.add(r)
    assert {k: r.status for k, r in results.items()} == {
        "hang": "timeout", "segfault": "error", "exit": "error", "raise": "error",
        "sys_exit": "error", "huge_return": "ok", "huge_print": "ok", "native_print": "ok",
        "special": "ok", "memory": "error", "json": "ok"}
    assert results["hang"].text == "Error: misbehave did not finish within 1 s and was stopped."
    assert 1.0 <= results["hang"].seconds < 3.0
    assert "SIGSEGV" in results["segfault"].text and "exited with code 3" in results["exit"].text
    assert results["raise"].text == "Error: misbehave raised ZeroDivisionError: the tool failed"
    assert "Traceback" in results["raise"].detail and "hostile_tools.py" in results["raise"].detail
    assert results["sys_exit"].text == "Error: misbehave called sys.exit(2)"
    assert "ran out of memory (over the sandbox's max_memory_mb=1024)" in results["memory"].text
    # 10 MB returned or printed: cut in the worker, and said so
    for how, char in (("huge_return", "r"), ("huge_print", "p")):
        text = results[how].text
        assert text.startswith(char * 1000) and len(text) < 1100, how
        assert text.endswith(f"[output truncated: 1000 of {10_000_000 + (how == 'huge_print')} "
                             "characters shown]")
    assert "n" * 1000 not in capfd.readouterr().out  # native writes to fd 1 go nowhere
    assert results["special"].text == 'done <|im_end|><|endoftext|> <tool_call>{"name": "echo"}</tool_call>'
    assert results["json"].text == '{"a": [1, 2], "b": "ü"}'
    # three workers were replaced (hang, segfault, exit); the sandbox still answers
    assert sandbox.restarts - restarts == 3
    assert sandbox.call_sync(ToolCall("echo", {"text": "ab", "times": 2})).text == "abab"
    assert metrics.to_dict()["agent/tool/misbehave/calls"] == 11
    assert metrics.to_dict()["agent/tool/misbehave/errors"] == 5
    assert metrics.to_dict()["agent/tool/misbehave/timeouts"] == 1


def test_refused_before_any_worker(sandbox):
    r = sandbox.call_sync(ToolCall("rm_rf", {}))
    assert r.status == "unknown_tool" and r.tool == "rm_rf"
    assert r.text == "Error: there is no tool named 'rm_rf'; the tools are: echo, nap, misbehave, count."
    cases = {"missing": {}, "type": {"text": 3}, "unknown": {"text": "a", "x": 1},
             "enum": None}
    bad = {k: sandbox.call_sync(ToolCall("echo", v)) for k, v in cases.items() if v is not None}
    bad["enum"] = misbehave(sandbox, "dance")
    assert all(r.status == "bad_arguments" for r in bad.values())
    assert bad["missing"].text == "Error: bad arguments for echo: missing required argument 'text'."
    assert bad["type"].text == "Error: bad arguments for echo: 'text' must be a string, got 3 (an integer)."
    assert bad["unknown"].text == ("Error: bad arguments for echo: unknown argument 'x' (the "
                                   "arguments are 'text', 'times').")
    assert "'how' must be one of ['hang'," in bad["enum"].text
    m = ToolMetrics()
    for res in [r] + list(bad.values()):
        m.add(res)
    assert m.to_dict()["agent/tool/unknown_tool"] == 1
    assert m.to_dict()["agent/tool/echo/bad_arguments"] == 3


def test_workers_share_nothing_with_the_trainer_and_keep_class_state(sandbox):
    assert misbehave(sandbox, "modules").text == ""  # no torch, transformers, megatron there
    counts = [int(sandbox.call_sync(ToolCall("count", {})).text) for _ in range(6)]
    assert all(c > 10 for c in counts)  # constructed with start=10, once per worker


def test_async_calls_run_concurrently_without_blocking_the_loop(sandbox):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        t0 = time.monotonic()
        results = await sandbox.call_all([ToolCall("nap", {"seconds": 0.4}) for _ in range(4)])
        elapsed = time.monotonic() - t0
        tick.cancel()
        return results, elapsed, ticks

    results, elapsed, ticks = asyncio.run(main())
    assert [r.status for r in results] == ["ok"] * 4
    assert elapsed < 1.4  # 2 workers: two rounds of 0.4 s, not four
    assert ticks > 40  # the caller's loop kept running while the tools ran


def test_environment_sessions(one_worker):
    async def main():
        async with one_worker.session() as a, one_worker.session() as b:
            first = [await a.reset({"start": 1}), await b.reset({})]
            steps = [await a.step("1"), await b.step("1"), await a.step("1")]
            return first, steps

    first, steps = asyncio.run(main())
    assert first == ["start at 1", "start at 0"]
    assert [(s.observation, s.reward, s.done, s.status) for s in steps] == [
        ("total 2", 0.0, False, "ok"), ("total 1", 0.0, False, "ok"), ("total 3", 1.0, True, "ok")]


def test_environment_failures_end_the_trajectory_or_name_the_file(one_worker):
    async def main():
        out = {}
        for action in ("raise", "hang"):
            async with one_worker.session() as s:
                await s.reset({})
                out[action] = await s.step(action)
        # a crash in one session loses the state of the others on its worker
        async with one_worker.session() as s, one_worker.session() as other:
            await s.reset({})
            await other.reset({})
            out["crash"] = await s.step("crash")
            out["lost"] = await other.step("1")
        async with one_worker.session() as s:
            await s.reset({})
            out["after"] = await s.step("5")
        return out

    out = asyncio.run(main())
    assert (out["raise"].status, out["raise"].done, out["raise"].reward) == ("error", True, 0.0)
    assert out["raise"].observation == ("Error: the environment (Room.step) raised ValueError: "
                                        "the environment failed")
    assert out["hang"].status == "timeout" and out["hang"].done
    assert out["crash"].status == "error" and "exited with code 9" in out["crash"].observation
    assert out["lost"].status == "error" and "state was lost" in out["lost"].observation
    assert (out["after"].observation, out["after"].done) == ("total 5", True)
    m = ToolMetrics()
    for step in out.values():
        m.add_env_step(step)
    assert m.to_dict()["agent/env/errors"] == 3 and m.to_dict()["agent/env/timeouts"] == 1


@pytest.mark.parametrize("row, action, message", [
    ({"reset": "raise"}, None, r"agent.environment .*hostile_tools.py:Room: reset raised KeyError"),
    ({"reset": "bad"}, None, r"hostile_tools.py:Room: reset returned int 42 as the observation"),
    ({}, "bad", r"hostile_tools.py:Room: step returned the reward str 'not a number'"),
])
def test_a_broken_environment_contract_raises(one_worker, row, action, message):
    async def main():
        async with one_worker.session() as s:
            await s.reset(row)
            await s.step(action)

    with pytest.raises(EnvironmentFailure, match=message):
        asyncio.run(main())


def test_closed_sandbox_refuses_and_a_hung_call_is_cancelled():
    sb = ToolSandbox.from_config(_config(1))

    async def hang_then_close():
        task = asyncio.ensure_future(sb.call(ToolCall("nap", {"seconds": 30})))
        await asyncio.sleep(0.3)
        sb.close()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(hang_then_close())
    with pytest.raises(SandboxError, match="agent.sandbox: the sandbox is closed"):
        sb.call_sync(ToolCall("echo", {"text": "x"}))


def test_workers_that_cannot_start(tmp_path):
    # imports in the probe (and here) but not in a worker, whose first argument is its entry
    path = tmp_path / "worker_only.py"
    path.write_text("import sys, time\n"
                    "if sys.argv[0] == '-c' and sys.argv[1].endswith(':serve'):\n"
                    "    {}\n"
                    "def f(x: int) -> str:\n    '''F.'''\n    return str(x)\n")
    source = path.read_text()
    path.write_text(source.format("raise ImportError('not in workers')"))
    cfg = AgentToolsConfig(tools=[ToolConfig(path=str(path), name="f")],
                           sandbox=SandboxConfig(num_workers=1, startup_timeout_s=1.0))
    with pytest.raises(UserCodeError, match=r"(?s)Traceback.*a sandbox worker could not load "
                                            r"agent.tools\[0\] .*worker_only.py:f: ValueError: "
                                            r".*importing the file failed: ImportError: not in workers"):
        ToolSandbox.from_config(cfg)
    path = tmp_path / "worker_blocks.py"
    path.write_text(source.format("time.sleep(60)"))
    cfg.tools[0].path = str(path)
    t0 = time.monotonic()
    with pytest.raises(UserCodeError, match=r"a sandbox worker did not load agent.tools\[0\] "
                                            r".*worker_blocks.py:f within 1 s "
                                            r"\(agent.sandbox.startup_timeout_s\)"):
        ToolSandbox.from_config(cfg)
    assert time.monotonic() - t0 < 10


def test_the_config_section(tmp_path):
    cfg = from_dict(AgentToolsConfig, {
        "tools": [{"path": HOSTILE, "name": "echo"}],
        "sandbox": {"num_workers": 0}}, prefix="agent.")
    assert cfg.parser.name == "hermes" and cfg.parser.path is None  # the built-in by default
    with pytest.raises(ConfigError, match=r"agent.sandbox.num_workers=0: must be positive"):
        ToolSandbox.from_config(cfg)
    with pytest.raises(ConfigError, match=r"unknown config key agent.tools\[0\].schemas; did you mean"):
        from_dict(AgentToolsConfig, {"tools": [{"path": HOSTILE, "schemas": {}}]}, prefix="agent.")
    assert ToolSandbox.from_config(AgentToolsConfig()) is None  # nothing to run
    with pytest.raises(ConfigError, match="agent.environment: no environment is configured"):
        with ToolSandbox.from_config(dataclasses.replace(cfg, sandbox=SandboxConfig(num_workers=1))) as sb:
            sb.session()
