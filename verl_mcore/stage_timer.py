"""Wall time, peak memory and allocator retries per phase of a step (`timing_s/<phase>`,
`memory_gb/<phase>`, `memory/alloc_retries/<phase>`): the trainer's step and the Python API's
calls time their phases with it."""
from __future__ import annotations

import contextlib
import resource
import time

import torch

from verl_mcore.utils.device import cuda_in_use


class StageTimer:
    """Wall time per phase (CUDA synchronised), for `timing_s/<phase>` and the stage line; on
    CUDA also the peak allocated memory of each phase, for `memory_gb/<phase>`, and how often
    the caching allocator had to free its cache and retry a cudaMalloc in it
    (`memory/alloc_retries/<phase>`): each retry synchronises the device and returns memory to
    the driver, so a phase that retries runs near the memory limit and slower than it should.

    Per-phase peaks need `torch.cuda.reset_peak_memory_stats()` at each phase start, which would
    lose the process peak `perf/max_memory_allocated_gb` reports; so the peak reached since the
    previous reset (the last phase, the work between phases, model building before the first
    step) is read just before each reset and kept in `peak_seen`. `peak_seen` starts at the
    previous step's `process_peak_bytes()`, so the process peak carries over steps.
    """

    def __init__(self, peak_seen: int = 0):
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}  # phase -> max over its repeats (CUDA only)
        self.alloc_retries: dict[str, int] = {}  # phase -> sum over its repeats (CUDA only)
        self.peak_seen = peak_seen  # bytes: every peak read before a reset
        self.cuda = cuda_in_use()

    @contextlib.contextmanager
    def __call__(self, name: str):
        retries = 0
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_seen = max(self.peak_seen, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            retries = _alloc_retries()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)
                self.alloc_retries[name] = self.alloc_retries.get(name, 0) + _alloc_retries() - retries
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def process_peak_bytes(self) -> int:
        """Peak allocated bytes since the process started: the largest reading taken before a
        reset (this step's, and `peak_seen` carried in), or now."""
        return max(self.peak_seen, torch.cuda.max_memory_allocated()) if self.cuda else 0

    def metrics(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory_gb/{k}": v / 2**30 for k, v in self.peak_bytes.items()})
        out.update({f"memory/alloc_retries/{k}": float(v) for k, v in self.alloc_retries.items()})
        return out


def _alloc_retries() -> int:
    # reset_peak_memory_stats leaves this counter alone (it resets only peaks).
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def rss_gb() -> float:
    """This process's peak resident memory in GiB (the CPU's `perf/max_memory_allocated_gb`)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
