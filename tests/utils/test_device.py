"""utils/device: the configured device, once decided, answers cuda_in_use(); nothing decided, CUDA's
presence does (a library user's process)."""
import pytest
import torch

from verl_mcore.utils import device


@pytest.fixture
def undecided(monkeypatch):
    monkeypatch.setattr(device, "_decided", None)


def test_undecided_follows_torch(undecided, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.cuda_in_use()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not device.cuda_in_use() and device.compute_device() == torch.device("cpu")


def test_decided_cpu_wins_over_a_visible_gpu(undecided, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device.set_compute_device("cpu")
    device.set_compute_device("cpu")  # the same decision again is fine (idempotent callers)
    assert not device.cuda_in_use() and device.compute_device() == torch.device("cpu")


def test_a_second_different_decision_is_refused(undecided):
    device.set_compute_device("cpu")
    with pytest.raises(RuntimeError, match="already computes on cpu, cannot switch to cuda"):
        device.set_compute_device("cuda")
    with pytest.raises(ValueError, match="'gpu' is neither 'cpu' nor 'cuda'"):
        device.set_compute_device("gpu")
