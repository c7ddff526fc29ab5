"""Capture and restore every random number generator a training rank draws from.

A resumed run must continue the random streams exactly where the interrupted one stopped, so a
checkpoint stores, per rank: Python's `random`, numpy's global generator, torch's CPU generator,
every CUDA device's generator (when this process computes on CUDA: utils/device.py), and the named states of megatron-core's
tensor-parallel RNG tracker (the "model-parallel-rng" stream dropout inside TP regions uses;
`cpu_compat` keeps those on the CPU generator when there is no GPU).

The captured state holds only tensors, ints, floats, strings, tuples, lists, dicts and None, so it
can be written with `torch.save` and read back with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch

from verl_mcore.utils.device import cuda_in_use

FORMAT = 1


def capture_rng_state() -> dict[str, Any]:
    """The state of every generator of this process (see the module docstring for the list)."""
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "format": FORMAT,
        "python": random.getstate(),
        # np.ndarray is not loadable with weights_only=True: keep the key words as a tensor.
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gauss),
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda_in_use() else None,
        "megatron_tracker": _tracker_states(),
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every generator of this process from `capture_rng_state()`'s result.

    Raises ValueError naming the generator when the saved state cannot apply here (a CUDA state
    saved on a different number of devices, or CUDA states missing on a CUDA machine).
    """
    if state.get("format") != FORMAT:
        raise ValueError(f"rng state: unknown format {state.get('format')!r} (expected {FORMAT})")
    random.setstate(_as_python_state(state["python"]))
    kind, keys, pos, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gauss))
    torch.set_rng_state(state["torch_cpu"])
    if cuda_in_use():
        cuda = state["cuda"]
        if cuda is None:
            raise ValueError("rng state: saved without CUDA, cannot restore the CUDA generators")
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"rng state: saved for {len(cuda)} CUDA devices, this process sees "
                f"{torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all(cuda)
    tracker_states = state["megatron_tracker"]
    if tracker_states is not None:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(dict(tracker_states))


def _tracker_states() -> dict[str, torch.Tensor] | None:
    """Named states of megatron's TP RNG tracker, or None when megatron never initialised it."""
    import sys

    if "megatron.core.tensor_parallel" not in sys.modules:
        return None  # nothing in this process can have drawn from it
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    if not getattr(tracker, "is_initialized", lambda: True)():
        return None
    states = tracker.get_states()
    for name, value in states.items():
        if not isinstance(value, torch.Tensor):
            # CUDA-graph-safe trackers keep torch.Generator objects, which torch.save cannot
            # write for a weights_only load.
            raise TypeError(
                f"rng state: megatron RNG tracker state {name!r} is a {type(value).__name__}, "
                "not a tensor (CUDA-graph-safe RNG is not supported by checkpointing)"
            )
    return {name: value.clone() for name, value in states.items()}


def _as_python_state(saved: Any) -> tuple:
    """random.setstate needs (version, tuple of 625 ints, gauss_next) with a tuple inside."""
    version, internal, gauss_next = saved
    return (version, tuple(internal), gauss_next)


def seed_everything(seed: int, rank: int) -> None:
    """Python's and numpy's RNGs per rank; torch's the same on all ranks (identical fresh heads,
    replicated init); megatron's model-parallel tracker once its state exists."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed)
    with contextlib.suppress(Exception):  # parallel state not initialised yet: seeded again later
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
