"""verl_mcore.distributed.cpu_compat: each patch still targets what it was written for, and does
what it claims in a fresh rank.

The end-to-end check (megatron's pipeline schedule + distributed optimizer at several layouts
against a 1-rank run) is tests/distributed/test_megatron_layouts.py.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.distributed import cpu_compat


@pytest.mark.parametrize("patch", cpu_compat.PATCHES, ids=lambda p: f"{p.module}.{p.attr}")
def test_patch_target_exists_with_expected_signature(patch):
    # Runs against the untouched modules of this process: install() is only ever called in
    # spawned ranks here. A failure means megatron-core (or torch) moved or changed the function:
    # re-read its source and update the replacement in cpu_compat before touching the expectation.
    _, _, original = cpu_compat.resolve(patch)
    assert not getattr(original, "__cpu_compat_wrapped__", None), "main process must be unpatched"
    params = tuple(inspect.signature(original).parameters)
    assert params == patch.params, (
        f"{patch.module}.{patch.attr} now takes {params}, cpu_compat was written for "
        f"{patch.params} ({patch.why})"
    )


def test_every_patch_has_a_replacement():
    replacements = cpu_compat._replacements()
    assert set(replacements) == {(p.module, p.attr) for p in cpu_compat.PATCHES}


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_install_is_noop_with_cuda_unless_the_device_is_cpu(monkeypatch, device):
    # "auto" with a GPU, and "cuda" anywhere, leave this process untouched; install("cpu") is the
    # probe below (it must run in a fresh rank: it patches for good).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    depth = torch._C._len_torch_function_stack()
    assert cpu_compat.install(device) is False
    assert not cpu_compat.is_installed()
    assert torch.cuda.current_device is current_device
    assert torch._C._len_torch_function_stack() == depth
    for patch in cpu_compat.PATCHES:
        _, _, value = cpu_compat.resolve(patch)
        assert value not in {
            cpu_compat._current_device, cpu_compat._synchronize, cpu_compat._get_cpu_rng_state,
            cpu_compat._set_cpu_rng_state, cpu_compat._tracker_add, cpu_compat._tracker_fork,
        }
        assert not hasattr(value, "__cpu_compat_wrapped__")


def test_install_names_a_bad_device():
    with pytest.raises(ValueError, match="device 'gpu' is not one of auto, cpu, cuda"):
        cpu_compat.install("gpu")


def _probe(rank, world_size, device):
    """Everything observable about install(device) in a fresh 1-rank process; asserted in the
    tests. device "cpu" runs where torch sees a GPU (made to, on a CPU build): trainer.device=cpu
    under a CUDA build of torch, which must take the very same CPU path."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as megatron_optimizer
    from megatron.core import parallel_state, tensor_parallel

    from verl_mcore.utils.device import cuda_in_use

    if device == "cpu" and not torch.cuda.is_available():
        torch.cuda.is_available = lambda: True  # as under a CUDA build; a fresh rank
    originals = {p: cpu_compat.resolve(p)[2] for p in cpu_compat.PATCHES}
    out: dict = {"installed": [cpu_compat.install(device), cpu_compat.install(device)]}
    out["cuda_in_use"] = cuda_in_use()
    out["mode_depth"] = torch._C._len_torch_function_stack()
    out["replaced"] = {
        f"{p.module}.{p.attr}": cpu_compat.resolve(p)[2] is not originals[p] for p in cpu_compat.PATCHES
    }
    out["rebound"] = (
        megatron_optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    )

    # 1./2. Devices.
    x = torch.ones(2)
    out["devices"] = {
        'zeros(device="cuda")': torch.zeros(2, device="cuda").device.type,
        'empty(device="cuda:1")': torch.empty(2, device="cuda:1").device.type,
        "tensor(device=current_device())": torch.tensor([1.0], device=torch.cuda.current_device()).device.type,
        'arange(device=torch.device("cuda"))': torch.arange(3, device=torch.device("cuda")).device.type,
        "x.cuda()": x.cuda().device.type,
        'x.to("cuda")': x.to("cuda").device.type,
        "x.to(current_device())": x.to(torch.cuda.current_device()).device.type,
        'x.to(device="cuda", dtype=f64)': x.to(device="cuda", dtype=torch.float64).device.type,
        'zeros(device="meta")': torch.zeros(2, device="meta").device.type,  # not CUDA: untouched
    }
    out["x.cuda() is x"] = x.cuda() is x
    pinned = x.pin_memory()
    out["pin_memory copies"] = pinned.data_ptr() != x.data_ptr() and torch.equal(pinned, x)
    out["empty(pin_memory=True)"] = tuple(torch.empty(3, pin_memory=True).shape)
    torch.cuda.synchronize()  # must not raise

    # 4. CUDA type names, only inside the wrapped megatron functions.
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.full((4,), 10.0)
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=20.0)
    out["clipped_grad"] = param.grad.tolist()
    out["type_outside"] = torch.ones(1).type()

    # 3. RNG tracker.
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    expected = torch.Generator().manual_seed(123 + 2718)  # megatron's TP seed at tp_rank 0
    torch.manual_seed(5)
    with tracker.fork():
        first = torch.rand(4)
    after_fork = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    torch.manual_seed(5)
    out["rng"] = {
        "fork draws the tracked stream": torch.equal(first, torch.rand(4, generator=expected)),
        "fork advances the tracked stream": torch.equal(second, torch.rand(4, generator=expected)),
        "default stream untouched by fork": torch.equal(after_fork, torch.rand(4)),
    }
    # Activation checkpointing saves all RNG states in forward (CPU, "CUDA" via the patched
    # _get_cuda_rng_state, and the tracker's) and restores them for the recompute: it must run
    # on CPU, and the recomputed dropout mask must be the forward's, so
    # d(sum out)/dx = keep_mask * w / (1 - p).
    w = torch.linspace(1.0, 2.0, 64)

    def dropped(inp):
        with tracker.fork():
            return torch.nn.functional.dropout(inp * w, p=0.5, training=True)

    inp = torch.ones(64, requires_grad=True)
    y = tensor_parallel.checkpoint(dropped, False, inp)
    y.sum().backward()
    keep = (y != 0).float()
    out["rng"]["checkpoint recompute replays dropout"] = torch.allclose(inp.grad, keep * w * 2.0)
    out["rng"]["dropout dropped something"] = 0 < keep.sum().item() < 64

    # DDP buffer offload/reload (distributed/param_and_grad_buffer.py): uses synchronize() and
    # keeps `param_data.cpu().pin_memory()` as the host copy before freeing param_data.
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from tests.distributed import tiny_gpt

    config = tiny_gpt.make_config()
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
        module=tiny_gpt.build_model(config),
    )
    before = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    ddp.offload_grad_buffers()
    ddp.restore_grad_buffers()
    for buffer in ddp.buffers:
        buffer.offload_to_cpu(move_params=True, move_grads=True)
        buffer.reload_from_cpu(move_params=True, move_grads=True)
    out["ddp offload keeps params"] = all(
        torch.equal(p.detach(), before[n]) for n, p in ddp.named_parameters()
    )
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module", params=["auto", "cpu"])
def probe(request):
    if request.param == "auto" and torch.cuda.is_available():
        pytest.skip("install() (auto) is a no-op with CUDA (test_install_is_noop_with_cuda_unless_...)")
    # A fresh process: the probe checks what cpu_compat.install() changes, which a pooled rank that
    # already ran another test would have installed before the probe looks.
    return run_on_ranks(_probe, world_size=1, args=(request.param,), timeout=120, fresh=True)[0]


def test_install_is_idempotent(probe):
    assert probe["installed"] == [True, True]
    assert probe["cuda_in_use"] is False, "installed, the process computes on the CPU"
    assert probe["mode_depth"] == 1, "install() twice must push the device mode once"


def test_install_replaces_every_target(probe):
    assert all(probe["replaced"].values()), probe["replaced"]
    assert probe["rebound"], "megatron.core.optimizer.optimizer still holds the unwrapped function"


def test_cuda_devices_become_cpu(probe):
    expected = {name: "cpu" for name in probe["devices"]}
    expected['zeros(device="meta")'] = "meta"
    assert probe["devices"] == expected
    assert probe["x.cuda() is x"]


def test_pinned_memory_becomes_plain_copy(probe):
    assert probe["pin_memory copies"]
    assert probe["empty(pin_memory=True)"] == (3,)


def test_cuda_type_names_only_inside_patched_functions(probe):
    # clip_grad_by_total_norm_fp32 asserts grad.type() == "torch.cuda.FloatTensor", then scales
    # by max_norm / (total_norm + 1e-6).
    assert probe["clipped_grad"] == pytest.approx([10.0 / (20.0 + 1e-6)] * 4)
    assert probe["type_outside"] == "torch.FloatTensor"


def test_rng_tracker_on_cpu_generator(probe):
    assert all(probe["rng"].values()), probe["rng"]


def test_megatron_ddp_buffer_offload_roundtrip(probe):
    assert probe["ddp offload keeps params"]
