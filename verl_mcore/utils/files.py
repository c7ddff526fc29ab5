"""Writing the run's files so that a kill or a full disk never leaves a cut one, and saying so
clearly when the disk is full.

`open(path, "w")` truncates first: a kill or a full disk between the truncation and the last
write leaves a cut file (a restart on a full disk once cut config.yaml to 4096 bytes). Here the
new content goes to `path.tmp.<pid>`, is fsynced, and replaces the old file in one rename; the
directory is fsynced too, so that the rename itself survives a crash of the machine. Until the
rename the old file is untouched. Temporaries left by a killed process are removed at the next
start (run_dir.py), once the run-directory lock says no other run is writing them.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from typing import Any, Optional

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = tuple(os.strerror(e) for e in DISK_FULL_ERRNOS)
TMP_SUFFIX = ".tmp."  # + the writer's pid
_TMP_NAME = re.compile(r"\.tmp\.\d+$")


class DiskFullError(OSError):
    """No space (or quota) left where the run writes. The message names the path, the bytes
    free there, what the write needed and what to do."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def free_bytes(path: str) -> int:
    """Bytes this user may still write on the filesystem of `path` (or of its nearest existing
    parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def disk_full_error(path: str, what: str, needed: Optional[int] = None) -> DiskFullError:
    """The error for `what` (e.g. "the checkpoint of step 8") not fitting at `path`."""
    need = f"; {what} needs about {human_bytes(needed)} ({needed} bytes)" if needed else ""
    return DiskFullError(
        f"disk full: {what} does not fit at {path}: {human_bytes(free_bytes(path))} "
        f"({free_bytes(path)} bytes) free on that filesystem{need}. The checkpoints and metrics "
        f"written before are intact. Free space there (or raise the quota; older runs and "
        f"`abandoned.step_*` checkpoints are candidates, or lower checkpoint.keep_last), then run "
        f"the same command again: it resumes from the newest complete checkpoint.")


def is_disk_full(exc: BaseException) -> bool:
    """True when `exc`, its causes, or the per-rank failures of a torch.distributed.checkpoint
    CheckpointException are ENOSPC / EDQUOT. megatron's writer workers report theirs as text
    ("Worker failure: [Errno 28] No space left on device"), so the text is checked too."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DiskFullError) or getattr(e, "errno", None) in DISK_FULL_ERRNOS:
            return True
        if any(t in str(e) for t in _DISK_FULL_TEXTS):
            return True
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exc, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


def fsync_path(path: str) -> None:
    """fsync a file (its data) or a directory (its entries: renames, new files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot fsync a directory; the files are synced anyway
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` atomically (see the module docstring). A full disk raises
    DiskFullError and leaves the old file as it was."""
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: str, data: bytes) -> None:
    """write_text_atomic for bytes (a tokenizer.model is binary)."""
    tmp = f"{path}{TMP_SUFFIX}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if isinstance(e, OSError) and is_disk_full(e):
            raise disk_full_error(path, f"writing {os.path.basename(path)}", len(data)) from e
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def torch_save_synced(obj: Any, path: str) -> None:
    """torch.save, then fsync: for files inside a directory that is committed by a rename
    (a checkpoint), which must be on disk before the rename makes them visible."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def remove_stale_temporaries(directory: str) -> list[str]:
    """Delete the `*.tmp.<pid>` files write_text_atomic left in `directory` when killed; return
    their paths. Only for a directory no live process writes into (the run-directory lock)."""
    removed = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if _TMP_NAME.search(name) and os.path.isfile(path):
            os.remove(path)
            removed.append(path)
    return removed
