"""The device this process computes on: the configured one, not whether torch can see a GPU.

`trainer.device=cpu` under a CUDA build of torch must run on the CPU over gloo, as it does under
a CPU build. Every choice that follows from the device (where models are built, megatron's CPU
initialisation, memory statistics, pinned offload buffers, the CUDA RNG states saved with a
checkpoint) has to follow the backend the process group was started with: a model placed on the
GPU under gloo reaches megatron's coalesced parameter all-gather as CUDA tensors, which gloo's
coalesced all-gather (no CUDA variant) reads as host pointers, and the process segfaults.

The device is decided once per process (distributed/launch.init_distributed from trainer.device,
or distributed/cpu_compat.install) and recorded here; `cuda_in_use()` answers from that record
and, in a process where nothing decided (a library user's, a test's), from torch.cuda.is_available().
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

DeviceType = Literal["cpu", "cuda"]

_decided: Optional[DeviceType] = None


def set_compute_device(kind: DeviceType) -> None:
    """Record the device this process computes on (once decided, for the life of the process).

    A second, different decision is refused: half a process on each device is the bug this
    module exists to prevent (cpu_compat's patches cannot be undone once megatron ran under them).
    """
    global _decided
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"compute device: {kind!r} is neither 'cpu' nor 'cuda'")
    if _decided is not None and _decided != kind:
        raise RuntimeError(f"compute device: this process already computes on {_decided}, "
                           f"cannot switch to {kind} (start a new process for trainer.device={kind})")
    _decided = kind


def cuda_in_use() -> bool:
    """True when this process computes on CUDA (see the module docstring)."""
    if _decided is not None:
        return _decided == "cuda"
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device this rank's models and training tensors live on: the current CUDA device, or
    the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_in_use() else torch.device("cpu")
