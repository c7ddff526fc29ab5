"""Reading checkpoint files as data: nothing in a checkpoint directory can run code.

Users load checkpoints other people wrote (shared project directories, downloaded conversions),
and pickle runs whatever a file asks it to. So every file we read from a checkpoint is parsed
with a reader that resolves only the classes its format needs:

  dist/.metadata          torch.distributed.checkpoint's index, a pickle that torch reads with
                          plain pickle.load. Read here by an unpickler that resolves only
                          METADATA_GLOBALS (read_dcp_metadata).
  dist/*.distcp tensors   torch.load(weights_only=True): torch's FileSystemReader already does.
  dist/*.distcp objects   megatron's sharded objects (each linear's `_extra_state`, the
                          dp_reshardable optimizer's parts). torch's DefaultLoadPlanner unpickles
                          them with weights_only=False; SafeBytesPlanner with weights_only=True.
  dist/common.pt, trainer_state.pt, rng/*.pt   torch.load(weights_only=True) (torch_load).
  *.json                  json.

"weights_only" resolves tensors, containers, torch's own types and what megatron-core registers
with torch.serialization.add_safe_globals when it is imported (megatron/core/safe_globals.py:
numpy arrays and dtypes, a few enums and config dataclasses, BytesIO); none of them runs code
when unpickled.

megatron's torch_dist load builds its FileSystemReader and load planner inside
TorchDistLoadShardedStrategy.load, with no argument to pass others, so dist_load swaps those two
names of megatron's strategy module for the safe ones while it runs (_megatron_reads_safely).
torch itself is not patched; the swap only ever makes a megatron load in the same process
stricter, never looser.

Every refusal is a BadCheckpointError naming the file and the check that failed.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


class BadCheckpointError(ValueError):
    """A checkpoint file failed a check (unreadable, truncated, altered, or not plain data).
    One string argument, so that it pickles across ranks unchanged."""


# The classes of torch.distributed.checkpoint's Metadata (torch 2.13 metadata.py, planner.py,
# filesystem.py), as pickled by torch's FileSystemWriter and megatron-core 0.16.1's
# FileSystemWriterAsync, which adds `all_local_plans` (SavePlans of WriteItems) for its cached
# save plans. Checked against every `.metadata` our saves write (GRPO and PPO; distributed and
# non-distributed optimizer; both optimizer_sharding formats; TP 1 and 2; fp32, bf16, fp16) and
# tools/convert_hf's. TensorProperties pickles its memory format as _MEM_FORMAT_ENCODING and its
# layout through torch.serialization._get_layout (a lookup by name); StorageMeta.checkpoint_id
# is a PosixPath when the saver was given one. None of these runs code when unpickled.
_DCP = "torch.distributed.checkpoint"
METADATA_GLOBALS = frozenset(
    [(f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")]
    + [(f"{_DCP}.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")]
    + [(f"{_DCP}.filesystem", "_StorageInfo"),
       ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("collections", "OrderedDict"), ("pathlib", "PosixPath")]
    + [("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)]
)


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise BadCheckpointError(
                f"{self._path}: refused to unpickle {module}.{name}: a checkpoint's metadata "
                "holds only torch.distributed.checkpoint's own classes, so this file was not "
                "written by a checkpoint save (it may have been planted to run code). Nothing "
                "from it was executed; do not load this checkpoint.")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise BadCheckpointError(f"{self._path}: refused a persistent id in the metadata pickle")


def read_dcp_metadata(path: str) -> Metadata:
    """torch.distributed.checkpoint's `.metadata` file at `path`, unpickled with the allow-list,
    with its storage entries checked to name plain files beside it."""
    try:
        with open(path, "rb") as f:
            metadata = _AllowListUnpickler(f, path).load()
    except BadCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbled: any unpickling error
        raise BadCheckpointError(f"{path}: unreadable checkpoint metadata "
                                 f"({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise BadCheckpointError(f"{path}: not torch.distributed.checkpoint metadata "
                                 f"(unpickled a {type(metadata).__name__})")
    for index, info in metadata.storage_data.items():
        rel = getattr(info, "relative_path", None)
        # DCP opens os.path.join(checkpoint_dir, relative_path): a path with a separator or
        # '..' would read a file outside the checkpoint.
        if not isinstance(rel, str) or not rel or rel in (".", "..") or "/" in rel \
                or os.sep in rel or (os.altsep and os.altsep in rel):
            raise BadCheckpointError(f"{path}: entry {getattr(index, 'fqn', index)!r} points at "
                                     f"{rel!r}, not a file of this checkpoint directory")
    return metadata


def _why(e: BaseException) -> str:
    """A one-line reason. torch's weights_only refusal begins with advice to load the file with
    weights_only=False, the opposite of what to do with a file that may be hostile: keep only
    its "Unsupported global: ..." part."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1].split(" was not an allowed", 1)[0]
        lines = [line.strip() for line in reason.splitlines() if line.strip()]
        return f"refused by weights_only: {lines[0] if lines else 'not plain data'}"
    # Any other wording: never pass on the advice to retry with weights_only=False.
    lines = [line for line in text.splitlines() if line.strip() and "weights_only" not in line]
    return f"{type(e).__name__}: {lines[0] if lines else 'not plain data'}"


def torch_load(path: str) -> Any:
    """torch.load(path, weights_only=True) on CPU; any failure (missing, truncated, not plain
    data) is a BadCheckpointError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - EOFError, UnpicklingError, zip errors, OSError
        raise BadCheckpointError(f"{path}: cannot be read as plain checkpoint data ({_why(e)}); "
                                 "nothing from it was executed") from e


def read_json(path: str) -> dict:
    """A JSON object from a checkpoint; anything else is a BadCheckpointError naming the file."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise BadCheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise BadCheckpointError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` read by read_dcp_metadata (cached: megatron
    and DCP ask for it several times per load)."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = {None: metadata} if metadata is not None else {}

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id and os.fspath(checkpoint_id) != os.fspath(self.path):
            self._metadata = {}
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP's fallback to per-rank `__<rank>.metadata` files
        if rank not in self._metadata:
            self._metadata[rank] = read_dcp_metadata(os.fspath(self._get_metadata_path(rank)))
        metadata = self._metadata[rank]
        if getattr(metadata, "storage_meta", None) is None:  # as torch's read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeBytesPlanner(DefaultLoadPlanner):
    """Non-tensor items (megatron's sharded objects) unpickled with weights_only=True.
    Use as a mixin ahead of a DefaultLoadPlanner subclass."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - refused globals, truncation, garbage
            raise BadCheckpointError(
                f"object {fqn!r} in a .distcp file of this checkpoint is not plain data "
                f"({_why(e)}); nothing from it was executed") from e
        # What DefaultLoadPlanner.load_bytes does with the object.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _safe_mcore_planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    class SafeMCoreLoadPlanner(SafeBytesPlanner, MCoreLoadPlanner):
        pass

    return SafeMCoreLoadPlanner


@contextlib.contextmanager
def _megatron_reads_safely():
    """megatron's torch_dist strategy module, for the duration: its reader factory returns a
    SafeFileSystemReader and its load planner is SafeMCoreLoadPlanner (see the module
    docstring for why a swap and not an argument)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    swaps = {"_get_filesystem_reader": lambda checkpoint_dir, cache_metadata=False:
             SafeFileSystemReader(checkpoint_dir),
             "MCoreLoadPlanner": _safe_mcore_planner_class()}
    missing = [name for name in swaps if not hasattr(mcore_torch, name)]
    if missing:  # a megatron-core other than 0.16.x: fail rather than load unsafely
        raise RuntimeError(f"megatron.core.dist_checkpointing.strategies.torch has no {missing}: "
                           "verl_mcore's safe checkpoint loading needs megatron-core 0.16")
    saved = {name: getattr(mcore_torch, name) for name in swaps}
    for name, value in swaps.items():
        setattr(mcore_torch, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(mcore_torch, name, value)


def _common_load_strategy():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        """common.pt with weights_only=True whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
        (megatron's leaves it to torch's default)."""

        def load_common(self, checkpoint_dir):
            return torch_load(os.path.join(checkpoint_dir, "common.pt"))

    return SafeCommonLoadStrategy()


def dist_load(sharded_state_dict: dict, ckpt_dir: str) -> dict:
    """megatron's dist_checkpointing.load(sharded_state_dict, ckpt_dir) reading only data.
    Collective. A refusal on any rank (DCP gathers the ranks' read errors) is a
    BadCheckpointError on every rank."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint import CheckpointException

    try:
        with _megatron_reads_safely():
            return dist_checkpointing.load(sharded_state_dict, ckpt_dir,
                                           sharded_strategy=TorchDistLoadShardedStrategy(),
                                           common_strategy=_common_load_strategy())
    except BadCheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        bad = _bad_checkpoint_cause(e)
        if bad is None:
            raise
        raise BadCheckpointError(f"{ckpt_dir}: {bad}") from e


def _bad_checkpoint_cause(exc: BaseException, depth: int = 0):
    """The BadCheckpointError inside `exc`: its cause / context chain, or the per-rank failures
    of torch's CheckpointException ({rank: (exception, traceback)})."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, BadCheckpointError):
        return exc
    failures = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]
    for inner in failures + [exc.__cause__, exc.__context__]:
        if isinstance(inner, BaseException):
            found = _bad_checkpoint_cause(inner, depth + 1)
            if found is not None:
                return found
    return None


def check_dist_dir(ckpt_dir: str) -> Metadata:
    """Checks of a megatron torch_dist directory that read no tensor: metadata.json names the
    torch_dist backend, `.metadata` passes read_dcp_metadata, every .distcp file is at least as
    long as the entries stored in it (a truncated file fails here, with or without a manifest),
    and common.pt is plain data. Returns the DCP metadata."""
    config = read_json(os.path.join(ckpt_dir, "metadata.json"))
    backends = (config.get("sharded_backend"), config.get("common_backend"))
    if backends != ("torch_dist", "torch"):
        raise BadCheckpointError(f"{ckpt_dir}/metadata.json: backends {backends}; only megatron's "
                                 "('torch_dist', 'torch') format is read")
    metadata = read_dcp_metadata(os.path.join(ckpt_dir, ".metadata"))
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        path = os.path.join(ckpt_dir, rel)
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise BadCheckpointError(f"{path}: listed in .metadata but unreadable ({e})") from e
        if size < end:
            raise BadCheckpointError(f"{path}: truncated ({size} bytes; .metadata places data up "
                                     f"to byte {end})")
    torch_load(os.path.join(ckpt_dir, "common.pt"))
    return metadata
