"""Atomic writes and disk-full errors (verl_mcore/utils/files.py), on a real full tmpfs."""
from __future__ import annotations

import errno
import os

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from tests.tmpfs import small_tmpfs
from verl_mcore.utils import files


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "latest")
    files.write_text_atomic(path, "step_00000001\n")
    files.write_json_atomic(path, {"step": 2})
    assert open(path).read() == '{\n "step": 2\n}\n'
    assert os.listdir(tmp_path) == ["latest"]


def test_full_disk_keeps_the_old_file_and_says_where_and_how_much(tmp_path):
    with small_tmpfs(str(tmp_path / "fs"), "64k") as fs:
        path = os.path.join(fs.path, "config.yaml")
        files.write_text_atomic(path, "old: 1\n")
        with open(os.path.join(fs.path, "filler"), "wb") as f:  # leave less than 16 KiB free
            f.write(b"x" * (64 * 1024 - 12 * 1024))
        with pytest.raises(files.DiskFullError) as e:
            files.write_text_atomic(path, "new: 2\n" * 4000)  # 28 KB
        message = str(e.value)
        assert path in message and "bytes) free" in message and "needs about" in message
        assert "run the same command again" in message
        # A plain open(path, "w") would have truncated it first (config.yaml cut to 4096 bytes).
        assert open(path).read() == "old: 1\n"
        assert sorted(os.listdir(fs.path)) == ["config.yaml", "filler"]


def test_disk_full_is_recognised_through_megatron_and_torch_wrappers():
    worker = RuntimeError("Worker failure: [Errno 28] No space left on device")
    assert files.is_disk_full(CheckpointException("write", {0: (worker, None)}))
    assert files.is_disk_full(OSError(errno.EDQUOT, "quota"))
    try:
        try:
            raise OSError(errno.ENOSPC, "x")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert files.is_disk_full(outer)
    assert not files.is_disk_full(CheckpointException("write", {}))  # other ranks' view
    assert not files.is_disk_full(OSError(errno.EACCES, "denied"))


def test_only_interrupted_atomic_writes_count_as_stale(tmp_path):
    for name in ("config.yaml.tmp.4242", "latest.tmp.7", "notes.tmp", "data.tmp.x", "config.yaml"):
        (tmp_path / name).write_text("x")
    removed = files.remove_stale_temporaries(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == ["config.yaml.tmp.4242", "latest.tmp.7"]
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "data.tmp.x", "notes.tmp"]
