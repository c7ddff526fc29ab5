"""Helper processes die with the process that started them.

A trainer killed with SIGKILL (the OOM killer, `scancel --signal=KILL`, a node health check) runs
no cleanup, and megatron's checkpoint writer leaves its helpers behind: the forked writer (and its
forked workers) and the spawned multiprocessing Manager that carries their write results, two
processes and about 270 MB per kill (FINDINGS.md). Linux's PR_SET_PDEATHSIG asks the kernel to
signal a process when its parent dies, so:

- `children_die_with_this_process()` makes every later `os.fork()` child of this process set it
  (os.register_at_fork; multiprocessing's fork context and megatron's async caller use
  os.fork). It is inherited as a hook, so grandchildren forked by a child die with that child.
- a spawned or exec'd child has no fork hook: it calls `die_with_parent(parent_pid)` itself
  first thing (the Manager's initializer, a worker's entry code).

The signal follows the *thread* that created the child: children forked from a short-lived thread
would die with it. Ours and megatron's fork from the main thread. Elsewhere than Linux these are
no-ops.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Optional

_PR_SET_PDEATHSIG = 1
_fork_parent: Optional[int] = None  # set in the parent just before each fork


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """Ask for SIGKILL when the parent dies; if it already died (the child was re-parented
    before the request took effect), exit now. `parent_pid`: the pid the parent had."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not permitted here: nothing better to do than to live on
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _before_fork() -> None:
    global _fork_parent
    _fork_parent = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_fork_parent)


_installed = False


def children_die_with_this_process() -> None:
    """From now on, every child this process forks dies when it does (idempotent)."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _installed = True
