"""Write and read megatron-core `dist_checkpointing` (torch_dist) checkpoints one tensor at a time.

megatron's own `dist_checkpointing.save` needs the whole model's state dict in memory. A converted
checkpoint has a simple, fixed structure, so we write it with torch.distributed.checkpoint (DCP)
directly, through a save planner that produces each chunk only when the writer asks for it:
host memory holds about one tensor at a time.

The structure is exactly what megatron writes for a TP=1, PP=1 GPTModel, so
`dist_checkpointing.load(model.sharded_state_dict(), dir)` reshards it to any TP/PP at load:
- `metadata.json` {"sharded_backend": "torch_dist", ...} and `common.pt` (an empty dict);
- non-layer tensors under their canonical names (`embedding.word_embeddings.weight`, ...);
- decoder layers stacked under `decoder.layers.<rest>` with global shape [num_layers, *shape]
  and one chunk per layer; `linear_fc1` in two chunks per layer (gate rows, up rows), as
  megatron's SwiGLU sharded factory does;
- a MoE model's routed experts (SequentialMLP) under `decoder.layers.mlp.experts.experts.<rest>`
  with an expert axis after the layer axis, [num_layers, num_experts, *shape], one chunk (two
  for fc1) per layer and expert; when dense and MoE layers mix (megatron's list-valued
  moe_layer_freq), megatron keys every layer by its index instead, `decoder.layers.<i>.<rest>`,
  with no layer axis (`KeyLayout`);
- per layer (and expert) and linear, an `_extra_state` object (`[None]` for the local spec's
  linears).

Reading checks the directory first (verl_mcore.models.checkpoint.verify_dist_checkpoint: the
manifest convert.py writes, DCP metadata allow-listed) and reads it as data only
(verl_mcore.utils.safe_read).
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from verl_mcore.utils.safe_read import SafeFileSystemReader
from verl_mcore.models.checkpoint import verify_dist_checkpoint

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}
# Linears whose `_extra_state` megatron saves per layer (TransformerEngine fp8 metadata slot):
# every megatron linear, named by the canonical name of its weight.
_LINEAR_WEIGHT_RE = re.compile(r"\.linear_(qkv|proj|fc1|fc2)\.weight$")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """How megatron keys a GPTModel's tensors in a dist checkpoint (TransformerBlock and
    SequentialMLP sharded_state_dict): layers stacked along a leading axis unless the layers
    differ (`stacked_layers` False: dense and MoE layers mixed), routed experts along an axis
    of their own. `num_layers` / `num_experts` size those axes when writing; reading needs only
    the offsets."""

    num_layers: int = 0
    num_experts: int = 0
    stacked_layers: bool = True

    @classmethod
    def of(cls, arch) -> "KeyLayout":
        moe = arch.moe
        if moe is None:
            return cls(arch.num_layers)
        return cls(arch.num_layers, moe.num_experts, len(moe.layers) == arch.num_layers)

    def locate(self, canonical: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """(checkpoint key, offsets along the leading layer / expert axes, their sizes) of a
        canonical name; both empty for a tensor outside the decoder layers."""
        match = _LAYER_RE.match(canonical)
        if not match:
            return canonical, (), ()
        layer, rest = int(match.group(1)), match.group(2)
        offsets: tuple[int, ...] = ()
        sizes: tuple[int, ...] = ()
        expert = _EXPERT_RE.match(rest)
        if expert:
            rest = f"mlp.experts.experts.{expert.group(2)}"
            offsets, sizes = (int(expert.group(1)),), (self.num_experts,)
        if self.stacked_layers:
            return f"decoder.layers.{rest}", (layer, *offsets), (self.num_layers, *sizes)
        return f"decoder.layers.{layer}.{rest}", offsets, sizes


@dataclasses.dataclass
class Chunk:
    """One stored piece of a checkpoint key: global shape, where the piece sits, and how to
    produce it (called once, when the writer reaches it)."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    nbytes: int = 0


def chunks_for(canonical: str, shape: Sequence[int], layout: KeyLayout, dtype: torch.dtype,
               produce: Callable[[], torch.Tensor], split_halves: bool = False) -> list[Chunk]:
    """The chunk(s) megatron stores for one full (TP=1) tensor of `shape`.

    `split_halves` (linear_fc1): two chunks, rows [0, n/2) and [n/2, n); `produce` is then
    called once per half with the half index.
    """
    key, prefix_off, prefix_shape = layout.locate(canonical)
    shape = tuple(int(s) for s in shape)
    global_shape = prefix_shape + shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not split_halves:
        size = (1,) * len(prefix_shape) + shape
        return [Chunk(key, global_shape, prefix_off + (0,) * len(shape), size, dtype,
                      lambda: produce().reshape(size), _numel(shape) * itemsize)]
    half = (shape[0] // 2,) + shape[1:]
    size = (1,) * len(prefix_shape) + half
    return [Chunk(key, global_shape, prefix_off + (i * half[0],) + (0,) * (len(shape) - 1), size,
                  dtype, (lambda i=i: produce(i).reshape(size)), _numel(half) * itemsize)
            for i in range(2)]


def extra_state_keys(canonicals: Iterable[str], layout: KeyLayout) -> list[str]:
    """The `_extra_state` object keys megatron saves for the linears among `canonicals` (the
    canonical names of a model's tensors): `<key>._extra_state/shard_<offsets>_<sizes>`, with
    the layer / expert axes, or 0 of 1 where there are none."""
    keys = []
    for name in canonicals:
        if not _LINEAR_WEIGHT_RE.search(name):
            continue
        key, offsets, sizes = layout.locate(name.removesuffix(".weight"))
        offsets, sizes = offsets or (0,), sizes or (1,)
        keys.append(f"{key}._extra_state/shard_{'.'.join(map(str, offsets))}_"
                    f"{'.'.join(map(str, sizes))}")
    return keys


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _StreamingSavePlanner(DefaultSavePlanner):
    """A DCP save planner whose items are declared up front and produced on demand."""

    def __init__(self, chunks: Sequence[Chunk], objects: dict[str, object],
                 on_written: Callable[[Chunk], None]):
        super().__init__()
        self._chunks = {self._index(c): c for c in chunks}
        self._objects = objects
        self._on_written = on_written

    @staticmethod
    def _index(c: Chunk) -> MetadataIndex:
        return MetadataIndex(c.key, torch.Size(c.offsets))

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                 for key in self._objects]
        for index, c in self._chunks.items():
            items.append(WriteItem(
                index=index, type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                               sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape))))
        self.plan = SavePlan(items, planner_data={})  # no flattened-key mappings
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self._objects[write_item.index.fqn], buf)
            buf.seek(0)
            return buf
        c = self._chunks[MetadataIndex(write_item.index.fqn, write_item.index.offset)]
        tensor = c.produce()
        if tuple(tensor.shape) != c.sizes or tensor.dtype != c.dtype:
            raise ValueError(f"{c.key} chunk at {c.offsets}: produced {tuple(tensor.shape)} "
                             f"{tensor.dtype}, declared {c.sizes} {c.dtype}")
        self._on_written(c)
        return tensor.contiguous()


def write_dist_checkpoint(out_dir: str, chunks: Sequence[Chunk], extra_states: Iterable[str],
                          on_written: Callable[[Chunk], None] = lambda c: None) -> None:
    """Write a torch_dist checkpoint of `chunks` plus megatron's per-linear extra states
    (`extra_state_keys`)."""
    os.makedirs(out_dir, exist_ok=True)
    objects = {key: [None] for key in extra_states}
    # thread_count=1 with no CUDA reads items lazily, one at a time (_SerialCpuLoader); with
    # CUDA it prefetches at most per_thread_copy_ahead bytes.
    writer = dcp.FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=1,
                                  per_thread_copy_ahead=0)
    dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(chunks, objects, on_written),
             no_dist=True)
    torch.save({}, os.path.join(out_dir, "common.pt"))
    with open(os.path.join(out_dir, "metadata.json"), "w") as f:
        json.dump(METADATA_JSON, f)


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads given regions of stored tensors into caller-owned buffers."""

    def __init__(self, requests: Iterable[tuple[str, ChunkStorageMetadata, torch.Tensor]]):
        super().__init__()
        self._requests = list(requests)
        self._dest: dict[str, torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, chunk, dest in self._requests:
            md = self.metadata.state_dict_metadata[key]
            self._dest[key] = (chunk, dest)
            items += create_read_items_for_chunk_list(key, md, [chunk])
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item):
        chunk, dest = self._dest[read_item.dest_index.fqn]
        view = dest
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, off, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: the data is already there


class DistCheckpointReader:
    """Reads pieces of a torch_dist checkpoint without loading the rest."""

    def __init__(self, ckpt_dir: str):
        if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
            raise FileNotFoundError(f"{ckpt_dir}: no metadata.json (not a megatron dist checkpoint)")
        self.ckpt_dir = ckpt_dir
        self.metadata = verify_dist_checkpoint(ckpt_dir)  # BadCheckpointError: refused

    def tensor_meta(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{self.ckpt_dir}: no tensor {key!r} in the checkpoint")
        return md

    def has(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata.get(key), TensorStorageMetadata)

    def read(self, canonical: str, layout: KeyLayout = KeyLayout()) -> torch.Tensor:
        """The full (TP=1) tensor of a canonical name (one layer's, one expert's slice of
        stacked keys); `layout`: how the model's keys are laid out (dense: the default)."""
        key, prefix, _ = layout.locate(canonical)
        md = self.tensor_meta(key)
        shape = tuple(md.size)
        n = len(prefix)
        offsets = prefix + (0,) * (len(shape) - n)
        sizes = (1,) * n + shape[n:]
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        dcp.load({}, storage_reader=SafeFileSystemReader(self.ckpt_dir, self.metadata),
                 planner=_ChunkLoadPlanner([(key, chunk, dest)]), no_dist=True)
        return dest.reshape(shape[n:])
