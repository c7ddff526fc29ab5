"""examples/agent/python_tool.py's program dies with its sandbox worker: a worker killed by the
sandbox (its timeout_s shorter than the tool's, or the sandbox closed with the run) leaves no
program behind, even one that sleeps (RLIMIT_CPU never ends it). ~5 s."""
from __future__ import annotations

import os
import time
import uuid

import psutil

from verl_mcore.agent.sandbox import ToolSandbox
from verl_mcore.agent.tools import ToolCall
from verl_mcore.config.schema import AgentToolsConfig, SandboxConfig, ToolConfig

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent")


def _programs(tag: str) -> list[psutil.Process]:
    """The live processes running a main.py that holds `tag`."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            script = next((a for a in p.cmdline() if a.endswith("main.py")), None)
            if script and "agent-python-" in script:
                with open(script) as f:
                    if tag in f.read():
                        out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


def test_a_killed_worker_leaves_no_program_behind():
    tag = f"orphan-{uuid.uuid4().hex}"
    cfg = AgentToolsConfig(
        tools=[ToolConfig(path=os.path.join(EXAMPLES, "python_tool.py"), name="PythonInterpreter",
                          kwargs={"timeout_s": 60})],
        sandbox=SandboxConfig(num_workers=1, timeout_s=2))
    code = f"import time\n# {tag}\ntime.sleep(120)\n"
    with ToolSandbox.from_config(cfg) as sb:
        result = sb.call_sync(ToolCall("python", {"code": code}))
        assert result.status == "timeout", result
    deadline = time.monotonic() + 5
    while _programs(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _programs(tag)
    for p in left:  # not to leave them to the next test
        p.kill()
    assert not left, [p.cmdline() for p in left]
