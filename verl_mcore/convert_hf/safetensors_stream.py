"""Write a safetensors file tensor by tensor (the header is computed from declared shapes first).

`safetensors.torch.save_file` needs every tensor of a file in memory at once; a 70B shard would
then cost its full size in RAM. The format is simple (8-byte little-endian header length, a JSON
header with dtype / shape / byte offsets, then the raw bytes in header order), so we write the
header from the plan and stream the data after it.
"""
from __future__ import annotations

import json
import struct
from typing import Callable, Iterable, Sequence

import torch

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= int(s)
    return n


def write_safetensors(path: str, entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
                      groups: Iterable[Callable[[], dict[str, torch.Tensor]]],
                      on_tensor: Callable[[int], None] = lambda nbytes: None) -> None:
    """Write `entries` (name, shape, dtype), in that order, to `path`.

    `groups` yields callables, each returning the next few tensors by name (e.g. q, k, v from
    one fused QKV); their names must follow the order of `entries`. Only one group is held at a
    time.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = _nbytes(shape, dtype)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    order = [name for name, _, _ in entries]
    done = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for make in groups:
            for name, tensor in make().items():
                if done >= len(order) or order[done] != name:
                    raise ValueError(f"{path}: tensor {name!r} produced out of the declared order "
                                     f"(expected {order[done] if done < len(order) else 'none'})")
                spec = header[name]
                if list(tensor.shape) != spec["shape"] or DTYPE_NAMES[tensor.dtype] != spec["dtype"]:
                    raise ValueError(f"{path}: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                                     f"declared {spec['shape']} {spec['dtype']}")
                data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))  # no extra copy of the bytes
                on_tensor(data.numel())
                done += 1
    if done != len(order):
        raise ValueError(f"{path}: wrote {done} of {len(order)} declared tensors")
