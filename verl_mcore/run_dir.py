"""The run directory: one run at a time in it, no debris of dead runs, a record of every start.

    run = RunDir.open(cfg, run_dir, local_rank, local_world_size)   # collective, first thing
    ...                                                             # (nothing written before)
    run.record_start(cfg)                    # collective, once the run's inputs passed checks
    run.close()                                                     # Trainer.finish

    RUN_DIR/.lock                 flock-ed by the run using the directory; names its holder
    RUN_DIR/config.yaml           the resolved config of the newest start
    RUN_DIR/configs/start_N.yaml  the resolved config of every start (N = 1, 2, ...)
    (metrics.jsonl, tensorboard/, wandb_run_id: tracking.py; checkpoints/: checkpoints.py)

The lock. Rank 0 holds `fcntl.flock(LOCK_EX | LOCK_NB)` on RUN_DIR/.lock for the whole run and
writes its host, pid and Slurm job id into the file, so that a second run on the directory is
refused naming them: two runs would interleave metrics rows and mix their checkpoints. The kernel
drops a flock when its holder dies, SIGKILL included, so the lock of a dead job needs no cleanup:
the next run takes it, and the text the dead holder left in the file (a clean exit empties it)
is only logged. Children the holder forked (megatron's checkpoint writer workers) share the lock
while they live, which is right: they still write into the directory.

Node-local run directories (a path on /tmp or local scratch, a different directory on every
node): rank 0 writes a random token into its .lock; the local rank 0 of each other node then
reads RUN_DIR/.lock, and when it does not find that token its node has a directory of its own,
which it locks too (and cleans, below). No config key is needed. Checkpoints are committed by
rank 0 alone, so only a run directory shared by all nodes can be resumed: a warning says so.

Filesystems. flock is kernel-local on local filesystems. On Linux NFS clients it is mapped to an
NFS byte-range lock (NFSv4, or v3 with lockd), so it holds across nodes, except with the `nolock`
mount option (node-local only); the server frees the lock of a crashed client after its lease
(about 90 s on NFSv4). Lustre needs the `flock` mount option (`localflock`: node-local only;
neither: flock fails). Where flock fails, the run warns that the directory is unprotected and
goes on.

A used directory. checkpoint.resume=never starts from step 0; in a directory that already holds
a run's checkpoints or metrics the two runs would mix, so that is refused (checkpoint.load_path
is a request to start from a given checkpoint, and allowed).

Debris. Under the lock, rank 0 removes what killed processes of earlier runs left: unfinished
checkpoint saves (`.tmp.step_N/`, which after a full disk held the space every restart needed)
and the `*.tmp.<pid>` files of interrupted atomic writes (utils/files.py).

Every refusal is raised on every rank (distributed/agree.py): no rank waits for one that stopped.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import time
import uuid
from typing import Optional

import torch.distributed as dist

from verl_mcore.checkpoints import CHECKPOINTS, role_roots
from verl_mcore.distributed.agree import raised_on_every_rank
from verl_mcore.engine.checkpoint import list_checkpoints, remove_unfinished_saves
from verl_mcore.utils.files import remove_stale_temporaries, write_text_atomic

log = logging.getLogger("verl_mcore.run_dir")

LOCK = ".lock"
CONFIG = "config.yaml"
STARTS = "configs"
METRICS = "metrics.jsonl"
_START = re.compile(r"^start_(\d+)\.yaml$")


class RunDirError(RuntimeError):
    """This run cannot use its trainer.run_dir (another run holds it, or it holds another run)."""


class RunDir:
    def __init__(self, path: str, lock_fd: Optional[int], start: Optional[int]):
        self.path = path
        self.start = start  # this start's number (rank 0), None elsewhere
        self._fd = lock_fd

    @classmethod
    def open(cls, cfg, path: str, local_rank: int, local_world_size: int) -> "RunDir":
        """Lock, check and clean the run directory (see the module docstring); `record_start`
        writes this start's config once the inputs passed their checks.
        Collective; raises RunDirError (or DiskFullError) on every rank when it cannot be used."""
        rank, world = dist.get_rank(), dist.get_world_size()
        fd, token, start = None, None, None
        try:
            with raised_on_every_rank(f"opening trainer.run_dir={path}", RunDirError):
                if rank == 0:
                    fd, token = _lock(path)
                    _refuse_used_directory(cfg, path)
            box = [token]
            dist.broadcast_object_list(box, src=0)
            node_local = False
            if world > local_world_size:  # several nodes: does each see rank 0's directory?
                with raised_on_every_rank(f"opening trainer.run_dir={path}", RunDirError):
                    if local_rank == 0 and rank != 0 and not _shows_token(path, box[0]):
                        node_local = True
                        fd, _ = _lock(path)
                node_local = _any_rank(node_local)
            with raised_on_every_rank(f"preparing trainer.run_dir={path}", RunDirError):
                if fd is not None or (rank == 0 and token is None):  # locked, or no flock here
                    _remove_debris(path)
        except BaseException:
            _unlock(fd)
            raise
        if node_local and rank == 0:
            log.warning("trainer.run_dir=%s is a different directory on each node (node-local): "
                        "each node's copy is locked, but checkpoints are committed by rank 0 "
                        "alone, so this run cannot be resumed; use a directory all nodes share",
                        path)
        return cls(path, fd, start)

    def record_start(self, cfg) -> None:
        """This start's resolved config to configs/start_N.yaml and config.yaml, once the run's
        inputs passed their checks: a start refused for its data, model or code leaves the
        record of the run in the directory as it was. Collective; raises RunDirError (or
        DiskFullError) on every rank when it cannot be written."""
        with raised_on_every_rank(f"recording this start in trainer.run_dir={self.path}",
                                  RunDirError):
            if dist.get_rank() == 0:
                self.start = _record_start(cfg, self.path)

    def close(self) -> None:
        """Release the lock (emptying the holder's text first: text left in .lock means its
        holder died). Idempotent."""
        fd, self._fd = self._fd, None
        _unlock(fd)


# ---------------------------------------------------------------------------------------------
# The lock


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": uuid.uuid4().hex}


def _lock(run_dir: str) -> tuple[Optional[int], Optional[str]]:
    """Take RUN_DIR/.lock; return (its fd, our token), (None, token) where the filesystem has no
    flock. Raises RunDirError naming the holder when another process has it."""
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:  # a file of that name, a parent that is a file, no permission
        raise RunDirError(f"trainer.run_dir={run_dir} cannot be used as the run directory "
                          f"({e.strerror}); give the run another trainer.run_dir") from e
    path = os.path.join(run_dir, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    locked = True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise RunDirError(_in_use(run_dir, path, holder)) from None
    except OSError as e:  # ENOLCK, ENOSYS, EOPNOTSUPP: a filesystem without flock
        locked = False
        log.warning("%s: flock is not available on this filesystem (%s): nothing stops a second "
                    "run from using trainer.run_dir=%s at the same time; make sure none does",
                    path, e, run_dir)
    previous = _read(fd)
    if locked and previous:
        log.warning("%s: its last holder (%s) ended without releasing it (killed?); the lock died "
                    "with it, and this run takes over", path, _describe(previous))
    me = _holder()
    os.ftruncate(fd, 0)  # the file stays the same inode: a rename would not carry the flock
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    os.fsync(fd)
    if not locked:
        os.close(fd)
        return None, me["token"]
    return fd, me["token"]


def _unlock(fd: Optional[int]) -> None:
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read(fd: int):
    """The holder recorded in an open .lock: a dict, the raw text if it is not ours, or None."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return text
    return holder if isinstance(holder, dict) else text


def _describe(holder) -> str:
    if not isinstance(holder, dict):
        return repr(holder)
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('since')}"


def _in_use(run_dir: str, path: str, holder) -> str:
    hint = "wait for it to end or stop it"
    if isinstance(holder, dict):
        if holder.get("slurm_job_id"):
            hint = f"wait for it to end or stop it (scancel {holder['slurm_job_id']})"
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            if pid == os.getpid():
                hint = ("this very process holds it: an earlier Trainer on this directory was "
                        "not finished; call its finish() first")
            elif isinstance(pid, int) and not _alive(pid):
                hint = (f"pid {pid} has exited, but a process it started still holds the lock "
                        f"(`fuser -v {path}` names it): end that process")
    who = _describe(holder) if holder else "a process that has not written its name yet"
    return (f"trainer.run_dir={run_dir} is in use by another run: {who} (flock on {path}). Two "
            f"runs in one directory would mix their metrics and checkpoints. To go on: {hint}, "
            f"or give this run its own trainer.run_dir.")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _shows_token(run_dir: str, token: Optional[str]) -> bool:
    """True when this node's RUN_DIR/.lock is the one rank 0 wrote (a shared directory)."""
    try:
        with open(os.path.join(run_dir, LOCK)) as f:
            return token is not None and token in f.read()
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
        return False


def _any_rank(flag: bool) -> bool:
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return any(flags)


# ---------------------------------------------------------------------------------------------
# What the directory holds


def _refuse_used_directory(cfg, run_dir: str) -> None:
    """checkpoint.resume=never in a directory that holds a run: the two would mix."""
    ckpt = cfg.checkpoint
    if ckpt.resume != "never" or ckpt.load_path:
        return
    found = []
    for role, root in role_roots(run_dir).items():
        steps = [s for s, _ in list_checkpoints(root)]
        if steps:
            found.append(f"{role} checkpoints of steps {steps} in {root}")
    metrics = os.path.join(run_dir, METRICS)
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        with open(metrics, "rb") as f:
            found.append(f"{sum(1 for _ in f)} metrics rows in {metrics}")
    if found:
        raise RunDirError(
            f"trainer.run_dir={run_dir} holds an earlier run ({'; '.join(found)}), and "
            f"checkpoint.resume=never starts this one from step 0 in the same directory: the two "
            f"runs' checkpoints and metrics rows would mix. Give this run its own "
            f"trainer.run_dir, or set checkpoint.resume=auto to continue the earlier run, or "
            f"move those files away.")


def _remove_debris(run_dir: str) -> None:
    """Unfinished saves and interrupted atomic writes of dead processes (module docstring)."""
    removed = []
    for root in role_roots(run_dir).values():
        removed += remove_unfinished_saves(root) + remove_stale_temporaries(root)
    for directory in (run_dir, os.path.join(run_dir, CHECKPOINTS), os.path.join(run_dir, STARTS)):
        removed += remove_stale_temporaries(directory)
    for path in removed:
        log.warning("run directory: removed %s, left by a process of an earlier start that died "
                    "while writing it", path)


def _record_start(cfg, run_dir: str) -> int:
    """Write this start's resolved config to configs/start_N.yaml and config.yaml; return N."""
    starts = os.path.join(run_dir, STARTS)
    os.makedirs(starts, exist_ok=True)
    numbers = [int(m.group(1)) for m in map(_START.match, os.listdir(starts)) if m]
    n = max(numbers, default=0) + 1
    me = _holder()
    job = f", Slurm job {me['slurm_job_id']}" if me["slurm_job_id"] else ""
    text = (f"# start {n} in this run directory: {me['since']}, host {me['host']}, "
            f"pid {me['pid']}{job}\n" + cfg.to_yaml())
    write_text_atomic(os.path.join(starts, f"start_{n:04d}.yaml"), text)
    write_text_atomic(os.path.join(run_dir, CONFIG), text)
    return n
