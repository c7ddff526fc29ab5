"""A small tmpfs for disk-full tests: `with small_tmpfs(path, "2600k") as fs: ...; fs.resize("20m")`.

Mounting needs root (CAP_SYS_ADMIN); where it is not allowed the test is skipped. A real full
filesystem is better than a patched writer: megatron's checkpoint writer runs in forked worker
processes that no monkeypatch reaches.
"""
from __future__ import annotations

import contextlib
import os
import subprocess

import pytest


class Tmpfs:
    def __init__(self, path: str):
        self.path = path

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", self.path], check=True)


@contextlib.contextmanager
def small_tmpfs(path: str, size: str):
    os.makedirs(path, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.strip() or mount.returncode})")
    try:
        yield Tmpfs(path)
    finally:
        subprocess.run(["umount", "-l", path], check=False)
