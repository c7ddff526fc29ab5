"""StageTimer (verl_mcore/stage_timer.py): per-phase peak memory with torch.cuda's peak counters
replaced by a fake allocator, so the CUDA branch runs on the CPU machine."""
import pytest
import torch

from verl_mcore.stage_timer import StageTimer

GiB = 2**30


class FakeAllocator:
    """torch.cuda's allocated-bytes counter and its resettable peak, and the allocator's count of
    cudaMalloc retries (memory_stats()["num_alloc_retries"], which a peak reset leaves alone)."""

    def __init__(self, allocated: int = 0):
        self.allocated = allocated
        self.peak = allocated
        self.retries = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def reset_peak(self, device=None) -> None:
        self.peak = self.allocated


@pytest.fixture
def fake_cuda(monkeypatch):
    mem = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", mem.reset_peak)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": mem.retries})
    return mem


def test_peak_per_phase_max_over_repeats_and_process_peak(fake_cuda):
    mem = fake_cuda
    mem.alloc(10 * GiB)  # model building: a peak before the first step...
    mem.free(6 * GiB)    # ...then 4 GiB stay resident
    timer = StageTimer()
    with timer("gen"):
        mem.alloc(3 * GiB)
        mem.free(3 * GiB)
    with timer("actor"):
        mem.alloc(1 * GiB)
        mem.free(1 * GiB)
    mem.retries += 5  # between phases: counted in none
    with timer("actor"):  # a repeated phase keeps its largest peak, and sums its retries
        mem.alloc(2 * GiB)
        mem.retries += 2
        mem.free(2 * GiB)
    m = timer.metrics()
    assert m["memory_gb/gen"] == 7.0 and m["memory_gb/actor"] == 6.0
    assert m["memory/alloc_retries/gen"] == 0.0 and m["memory/alloc_retries/actor"] == 2.0
    assert set(m) == {"timing_s/gen", "timing_s/actor", "memory_gb/gen", "memory_gb/actor",
                      "memory/alloc_retries/gen", "memory/alloc_retries/actor"}
    # The phase resets did not lose the build peak: the process peak is still 10 GiB.
    assert timer.process_peak_bytes() == 10 * GiB

    # The next step's timer carries the peak in, and sees work between phases.
    nxt = StageTimer(peak_seen=timer.process_peak_bytes())
    mem.alloc(9 * GiB)  # e.g. an onload outside any phase: 13 GiB
    mem.free(9 * GiB)
    with nxt("ref"):
        pass
    assert nxt.metrics()["memory_gb/ref"] == 4.0
    assert nxt.process_peak_bytes() == 13 * GiB


def test_cpu_emits_timings_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    timer = StageTimer()
    with timer("gen"):
        pass
    assert list(timer.metrics()) == ["timing_s/gen"]
    assert timer.process_peak_bytes() == 0
