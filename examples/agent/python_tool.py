"""A Python interpreter tool (agent.tools): the model's code runs in a child process of the
sandbox worker, with resource limits and no network.

    agent:
      tools:
        - path: examples/agent/python_tool.py
          name: PythonInterpreter
          kwargs: {timeout_s: 5, max_memory_mb: 512}

The model's program runs as `python -I` (isolated: no user site, no PYTHON* variables) in a
fresh temporary directory, with an empty environment, under:
  - RLIMIT_CPU (timeout_s, and a wall-clock kill of its process group at timeout_s);
  - RLIMIT_AS (max_memory_mb);
  - death with the sandbox worker (PR_SET_PDEATHSIG): its own session, which the timeout's kill
    needs, takes it out of the worker's process group, so a worker the sandbox kills (its
    timeout, the end of the run) would otherwise leave a program that sleeps running for good;
  - RLIMIT_FSIZE (what it prints goes to a file; past max_output_bytes it is stopped, and the
    result says so);
  - no network: in a new user and network namespace (`unshare -rn`) where the machine allows
    it (the namespace has only a downed loopback, so every connection fails); where it does not,
    an audit hook (sys.addaudithook) refuses socket connects, binds, sends and name look-ups
    from Python code (native code could still reach the network). `network_isolation()` says
    which one this machine gets: "namespace" or "audit_hook".

The class has a `schema` attribute, so the model calls it `python`.
"""
from __future__ import annotations

import ctypes
import functools
import os
import resource
import signal
import subprocess
import sys
import tempfile

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

_AUDIT_HOOK = """\
import sys
def _no_network(event, args):
    if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                 "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"):
        raise PermissionError("network access is disabled in this sandbox")
sys.addaudithook(_no_network)
del _no_network
"""


@functools.lru_cache(maxsize=1)
def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def network_isolation() -> str:
    """"namespace" where `unshare -rn` works here, else "audit_hook"."""
    return "namespace" if _unshare_works() else "audit_hook"


class PythonInterpreter:
    """Run a Python program and return what it prints (stdout and stderr)."""

    schema = {"type": "function", "function": {
        "name": "python",
        "description": "Run a Python 3 program and return what it prints. Use print() for every "
                       "value you want to see. No network, no files kept between calls.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "the program"}},
            "required": ["code"]}}}

    def __init__(self, timeout_s: float = 5.0, max_memory_mb: int = 512,
                 max_output_bytes: int = 8192):
        self.timeout_s, self.max_memory_mb = timeout_s, max_memory_mb
        self.max_output_bytes = max_output_bytes

    def __call__(self, code: str) -> str:
        with tempfile.TemporaryDirectory(prefix="agent-python-") as work:
            script = os.path.join(work, "main.py")
            with open(script, "w") as f:
                f.write(code if network_isolation() == "namespace" else _AUDIT_HOOK + code)
            out_path = os.path.join(work, "output")
            command = [sys.executable, "-I", script]
            if network_isolation() == "namespace":
                command = ["unshare", "-rn"] + command
            with open(out_path, "wb") as out:
                proc = subprocess.Popen(command, cwd=work, env={"PATH": "/usr/bin:/bin"},
                                        stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=self._limits)
                try:
                    exit_code = proc.wait(timeout=self.timeout_s)
                    late = False
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    exit_code, late = proc.wait(), True
            with open(out_path, "rb") as f:
                printed = f.read(self.max_output_bytes).decode("utf-8", "replace")
            # Python ignores SIGXFSZ: a write past the limit fails (EFBIG) rather than killing it.
            full = os.path.getsize(out_path) >= self.max_output_bytes
        if late:
            return printed + f"\n[the program did not finish within {self.timeout_s:g} s and was stopped]"
        if full or exit_code == -signal.SIGXFSZ:
            return printed + f"\n[output stopped at {self.max_output_bytes} bytes]"
        if exit_code == -signal.SIGXCPU:
            return printed + f"\n[the program used more than {self.timeout_s:g} s of CPU]"
        if exit_code != 0 and not printed.strip():
            return f"[the program ended with exit code {exit_code}]"
        return printed if printed.strip() else "[the program printed nothing: use print()]"

    def _limits(self) -> None:
        """In the child, before exec."""
        if sys.platform.startswith("linux"):  # SIGKILL when the worker dies (module docstring)
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        cpu = max(1, int(self.timeout_s + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = int(self.max_memory_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_output_bytes, self.max_output_bytes))

