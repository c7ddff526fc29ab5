"""A helper process that runs user code: a fresh interpreter talking to its parent over a socket.

The scoring workers (reward/pool.py) and the agent's tool sandbox (agent/sandbox.py) both run a
user's code where a hang can be ended by a kill, a crash costs one process, a memory cap holds,
and nothing is shared with the trainer. This module is what they share: how such a process is
started and stopped, and how it sets itself up before it serves.

Why a fresh interpreter rather than a multiprocessing child: spawn would re-import the trainer's
main module (torch, megatron-core: seconds per worker, and a hang for a script without a main
guard), and fork would copy CUDA and communication threads.

    parent                                         child (run_worker)
    WorkerProcess("pkg.mod:serve", init, cap)  ->  ignore SIGINT/USR1/TERM, die with the parent
      sends (sys.path, cap), then init              sys.path = the parent's; RLIMIT_AS = cap
                                                     init = recv(); pkg.mod.serve(conn, init)

The child imports `pkg.mod` by name (not as __main__), so the objects it sends back are of the
parent's classes. What `serve` says and hears after that is its own protocol; an error while
setting up (the entry cannot be imported, `init` cannot be unpickled, a MemoryError under the
cap) is sent as ("init_error", traceback), the message each serve also uses for its own set-up.
"""
from __future__ import annotations

import importlib
import os
import resource
import signal
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, Iterator, Optional

from verl_mcore.distributed.children import die_with_parent
from verl_mcore.user_code import child_env

_MAIN = ("import sys; from multiprocessing.connection import Connection; "
         "from verl_mcore.distributed.worker_process import run_worker; "
         "run_worker(sys.argv[1], Connection(int(sys.argv[2])), int(sys.argv[3]))")


class WorkerProcess:
    """A fresh interpreter running `entry` ("package.module:function", called as
    function(conn, init)) with this process's sys.path, its address space capped at
    `max_memory_mb` (None: no cap). `quiet`: its stdout and stderr go to /dev/null instead of
    this process's (a tool that prints 10 MB from native code must not fill the trainer's log).
    `conn` is the parent's end of the socket; `proc` the Popen."""

    def __init__(self, entry: str, init: Any, max_memory_mb: Optional[int] = None,
                 quiet: bool = False):
        ours, theirs = socket.socketpair()
        out = subprocess.DEVNULL if quiet else None
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _MAIN, entry, str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()], env=child_env(), stdin=subprocess.DEVNULL,
            stdout=out, stderr=out)
        theirs.close()
        self.conn = Connection(ours.detach())
        # Two messages: the child applies the path and the cap before it unpickles `init`, whose
        # classes it imports (and whose imports count against the cap).
        self.conn.send((list(sys.path), max_memory_mb))
        self.conn.send(init)

    def kill(self) -> None:
        """Kill it (if it still runs), reap it and close the socket."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Ask it to stop (None, which each serve takes as the end), wait up to `timeout_s`,
        then kill it."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def limit_memory(max_memory_mb: Optional[int]) -> None:
    """Cap this process's address space: an allocation beyond it raises MemoryError in the user's
    code instead of taking the node's memory from the trainer."""
    if max_memory_mb:
        limit = int(max_memory_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def requests(conn: Connection) -> Iterator[Any]:
    """In the child: the parent's messages, until it sends None (stop) or is gone."""
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        yield message


def run_worker(entry: str, conn: Connection, parent_pid: int) -> None:
    """The child's side (started by WorkerProcess): set up, then serve until told to stop."""
    # Ctrl-C, Slurm's warning signal (USR1) and a preemption SIGTERM reach the whole process
    # group; the trainer decides what happens (finish the step, checkpoint), not the worker. A
    # worker whose trainer is gone sees its socket close and exits; one stuck in user code is
    # killed by the kernel when the trainer dies (distributed/children.py).
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent_pid)
    try:
        path, max_memory_mb = conn.recv()
        sys.path[:] = path  # the parent's, so a user's file can import what the parent could
        limit_memory(max_memory_mb)  # before the imports: they count too
        module, function = entry.split(":")
        serve = getattr(importlib.import_module(module), function)
        init = conn.recv()
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    serve(conn, init)
