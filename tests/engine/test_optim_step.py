"""optim_step.prefer_fused_adam: which torch optimizers it switches, and (on a GPU) that the
switched Adam takes the same step, also right after a checkpoint load left `step` on the host.

The grad-norm half of optim_step is checked against megatron's own norm in test_host_syncs.py
and at every layout by test_layouts.py."""
from __future__ import annotations

import types

import pytest
import torch

from verl_mcore.engine import optim_step


def _megatron_like(inner):
    """The two attributes prefer_fused_adam reads from a megatron optimizer."""
    return types.SimpleNamespace(optimizer=inner)


def _params(device, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(17 + i, 5, generator=g).to(device)) for i in range(n)]


def test_cpu_params_and_other_optimizers_are_left_alone():
    adam = torch.optim.AdamW(_params("cpu"), lr=1e-3)
    sgd = torch.optim.SGD(_params("cpu"), lr=1e-3)
    chained = types.SimpleNamespace(chained_optimizers=[_megatron_like(adam), _megatron_like(sgd)])
    assert optim_step.sub_optimizers(chained) == chained.chained_optimizers
    assert optim_step.prefer_fused_adam(chained) == 0
    assert adam.param_groups[0]["fused"] in (None, False)


def test_clip_scales_every_grad_by_megatrons_coefficient_in_place():
    params = _params("cpu")
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad = None  # a parameter without a gradient is skipped, as megatron does
    before = [None if p.grad is None else p.grad.clone() for p in params]
    opt = types.SimpleNamespace(get_parameters=lambda: params, config=types.SimpleNamespace(
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=False))
    storages = [p.grad.data_ptr() for p in params if p.grad is not None]
    optim_step.clip_by_total_norm(opt, 1.0, 100.0)  # megatron: grads *= max_norm / (norm + 1e-6)
    coeff = 1.0 / (100.0 + 1.0e-6)
    assert torch.equal(params[0].grad, before[0] * coeff) and torch.equal(params[2].grad, before[2] * coeff)
    assert params[1].grad is None and [p.grad.data_ptr() for p in params if p.grad is not None] == storages
    scaled = [p.grad.clone() for p in params if p.grad is not None]
    optim_step.clip_by_total_norm(opt, 1.0, 0.5)  # under the limit: untouched
    assert all(torch.equal(a, p.grad) for a, p in zip(scaled, [params[0], params[2]]))
    optim_step.clip_by_total_norm(opt, 1.0, float("nan"))  # as megatron: a nan norm scales nothing
    assert all(torch.equal(a, p.grad) for a, p in zip(scaled, [params[0], params[2]]))


@pytest.mark.gpu
def test_fused_adam_takes_the_same_step_after_a_host_side_step_count():
    ref_params, params = _params("cuda"), _params("cuda")
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=True)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(4):
        for p, q in zip(ref_params, params):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ref.step()
        if step == 1:
            # what megatron's load leaves behind: host-side step tensors, the saved (foreach) flags
            for state in opt.state.values():
                state["step"] = state["step"].cpu()
            for group in opt.param_groups:
                group["fused"], group["foreach"] = None, True
        if step in (0, 1):
            assert optim_step.prefer_fused_adam(types.SimpleNamespace(chained_optimizers=[_megatron_like(opt)])) == 1
            assert opt.param_groups[0]["fused"] is True
        opt.step()
        for p, q in zip(ref_params, params):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    assert all(s["step"].is_cuda and float(s["step"]) == 4 for s in opt.state.values())


@pytest.mark.gpu
def test_checkpoint_common_state_leaves_the_gpu():
    """The fused Adam's `step` is a GPU tensor; in a checkpoint's common state (megatron's
    non-distributed optimizer saves it as `common_step`) it must be a host tensor, or every rank
    unpickles it onto rank 0's GPU during dist_checkpointing's validation."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from verl_mcore.engine.checkpoint import _common_tensors_to_cpu

    sharded = ShardedTensor.from_rank_offsets("w", torch.zeros(4, device="cuda"))
    state = {"state": {"common_step": torch.tensor(3.0, device="cuda"), "w": sharded},
             "param_groups": [{"lr": 1.0, "step": (torch.tensor(3, device="cuda"), 2)}]}
    out = _common_tensors_to_cpu(state)
    assert out is state and out["state"]["common_step"].device.type == "cpu"
    assert out["state"]["w"] is sharded and sharded.data.is_cuda
    assert out["param_groups"][0]["step"][0].device.type == "cpu"
