"""manifest.json: the size and SHA-256 of every file of a checkpoint, written as part of its
commit and checked before any of its tensors is read.

    {"format": 1, "files": {"dist/__0_0.distcp": {"size": 1234, "sha256": "9f2c..."}, ...}}

Paths are relative to the directory holding manifest.json and '/'-separated; the manifest lists
every file under that directory except itself, and a check fails on any file that differs, is
missing, or is not listed.

Hashing costs time at scale, so it is spread over the ranks: at save each rank hashes the files
it wrote (megatron names them `__<rank>_<i>.distcp`; ours `rng/rank_<rank>.pt`) and rank 0
gathers the entries; at load the entries are shared out across the ranks by size
(verify_share). SHA-256 ran at 1.2 GiB/s on one core of the 2-core CPU dev machine (SHA-NI,
files in the page cache; 2026-12-03): a 70B run's checkpoint with optimizer state (~1 TB: bf16
weights, fp32 main weights and two Adam moments) over 64 ranks is ~15 GB a rank, ~12 s at save
(the files were just written, so usually cached) and at load bounded by reading them back.

What a manifest proves: the files are the ones the save wrote (no truncation, no bit rot, no
overwritten bytes). It is not a signature: whoever can write the directory can rewrite the
manifest too, which is why reading stays allow-listed (safe_read.py) regardless.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import heapq
import os
import re
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from verl_mcore.utils.safe_read import BadCheckpointError, read_json

MANIFEST = "manifest.json"
FORMAT = 1
HASH_THREADS = 2  # per process (hashlib and reads release the GIL); megatron writes 2 files a rank
_WRITER = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")

T = TypeVar("T")


def list_files(root: str) -> list[str]:
    """Every file under root but the manifest, relative and '/'-separated, sorted."""
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _entry(root: str, rel: str) -> dict:
    with open(os.path.join(root, rel), "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return {"size": os.fstat(f.fileno()).st_size, "sha256": digest}


def hash_files(root: str, rels: list[str]) -> dict[str, dict]:
    """{rel: {"size", "sha256"}} of the given files, hashed by a few threads."""
    if not rels:
        return {}
    with concurrent.futures.ThreadPoolExecutor(min(HASH_THREADS, len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda rel: _entry(root, rel), rels)))


def _writer_rank(rel: str) -> int:
    """The rank that wrote a file, from its name; rank 0 for everything else."""
    match = _WRITER.search(rel)
    return int(match.group(1) or match.group(2)) if match else 0


def gather_manifest(root: str) -> Optional[dict]:
    """The manifest of the fully written directory `root` on rank 0 (None elsewhere). Collective
    over the default group: each rank hashes the files it wrote, rank 0 hashes the rest and any
    a rank did not see."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = list_files(root)
    mine = [rel for rel in files if _writer_rank(rel) == rank
            or (rank == 0 and _writer_rank(rel) >= world)]
    entries = hash_files(root, mine)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(entries, gathered, dst=0)
    if rank != 0:
        return None
    merged = {rel: e for part in gathered for rel, e in part.items()}
    merged.update(hash_files(root, [rel for rel in files if rel not in merged]))
    return {"format": FORMAT, "files": dict(sorted(merged.items()))}


def build_manifest(root: str) -> dict:
    """The manifest of `root`, hashed in this process (tools/convert_hf)."""
    return {"format": FORMAT, "files": hash_files(root, list_files(root))}


def find_manifest(ckpt_dir: str) -> Optional[tuple[str, str]]:
    """(directory holding the manifest, prefix of ckpt_dir's files in it) for a dist checkpoint
    directory: its own manifest (tools/convert_hf), or the one of the run checkpoint whose
    `dist/` it is; None when there is none (written before manifests existed)."""
    if os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        return ckpt_dir, ""
    parent = os.path.dirname(os.path.abspath(ckpt_dir))
    if os.path.basename(os.path.abspath(ckpt_dir)) == "dist" and \
            os.path.isfile(os.path.join(parent, MANIFEST)):
        return parent, "dist/"
    return None


def read_manifest(root: str) -> Optional[dict]:
    """{rel: {"size", "sha256"}} from root/manifest.json; None when there is no manifest."""
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        return None
    manifest = read_json(path)
    files = manifest.get("files")
    if manifest.get("format") != FORMAT or not isinstance(files, dict):
        raise BadCheckpointError(f"{path}: not a manifest of format {FORMAT}")
    for rel, e in files.items():
        parts = rel.split("/") if isinstance(rel, str) else [""]
        if not (isinstance(e, dict) and isinstance(e.get("size"), int)
                and isinstance(e.get("sha256"), str)) or "" in parts or ".." in parts \
                or os.path.isabs(rel):
            raise BadCheckpointError(f"{path}: malformed entry {rel!r}")
    return files


def _share(files: dict[str, dict], rank: int, world: int) -> list[str]:
    """This rank's part of the files, balanced by size (the same split on every rank)."""
    loads = [(0, r) for r in range(world)]
    mine = []
    for rel in sorted(files, key=lambda rel: (-files[rel]["size"], rel)):
        load, r = heapq.heappop(loads)
        if r == rank:
            mine.append(rel)
        heapq.heappush(loads, (load + files[rel]["size"], r))
    return mine


def verify_share(root: str, files: dict[str, dict], rank: int = 0, world: int = 1,
                 prefix: str = "") -> None:
    """Check this rank's share of the manifest entries under `prefix` (all of them for
    world=1); rank 0 also checks that every file present there is listed. Raises
    BadCheckpointError naming the first file that fails and how."""
    listed = {rel: e for rel, e in files.items() if rel.startswith(prefix)}
    if rank == 0:
        extra = [rel for rel in list_files(os.path.join(root, prefix) if prefix else root)
                 if prefix + rel not in listed]
        if extra:
            raise BadCheckpointError(
                f"{os.path.join(root, prefix + extra[0])}: not in {os.path.join(root, MANIFEST)} "
                f"({len(extra)} such file(s)): added after the checkpoint was saved")
    for rel in _share(listed, rank, world):
        path = os.path.join(root, rel)
        want = listed[rel]
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise BadCheckpointError(f"{path}: listed in the manifest but unreadable ({e})") from e
        if size != want["size"]:
            raise BadCheckpointError(f"{path}: {size} bytes, the manifest says {want['size']} "
                                     "(truncated or rewritten since the save)")
        got = _entry(root, rel)["sha256"]
        if got != want["sha256"]:
            raise BadCheckpointError(f"{path}: SHA-256 {got[:16]}..., the manifest says "
                                     f"{want['sha256'][:16]}... (contents changed since the save)")


def on_every_rank(check: Callable[[], T]) -> T:
    """Run `check` on this rank; if it raised BadCheckpointError on any rank, raise the lowest
    such rank's error on every rank, so that all ranks take the same decision. Collective over
    the default group (nothing to exchange with one rank)."""
    error = None
    result = None
    try:
        result = check()
    except BadCheckpointError as e:
        error = str(e)
    world = dist.get_world_size()
    errors = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise BadCheckpointError(first)
    return result


_FINGERPRINT_SUFFIXES = (".safetensors", ".distcp")
_FINGERPRINT_SAMPLES, _FINGERPRINT_SAMPLE_BYTES = 8, 1 << 16


def weights_fingerprint(directory: str) -> str:
    """A cheap identity of the weights in `directory` (an HF model or a dist checkpoint): the
    SHA-256 of each weight file's relative path, size and eight 64 KiB samples spread over it.
    The same weights copied elsewhere keep it; another model (other weights of the same
    architecture) changes it with certainty in practice. Not a checksum of every byte: a LoRA
    resume uses it to tell that model.path still holds the base its adapters were trained on,
    reading ~0.5 MB a file, not the model."""
    digest = hashlib.sha256()
    files = sorted(os.path.relpath(os.path.join(d, n), directory)
                   for d, _, names in os.walk(directory) for n in names
                   if n.endswith(_FINGERPRINT_SUFFIXES))
    for rel in files:
        path = os.path.join(directory, rel)
        size = os.path.getsize(path)
        digest.update(f"{rel.replace(os.sep, '/')}\0{size}\0".encode())
        with open(path, "rb") as f:
            for i in range(_FINGERPRINT_SAMPLES):
                f.seek(max(0, size - _FINGERPRINT_SAMPLE_BYTES) * i // (_FINGERPRINT_SAMPLES - 1))
                digest.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()
