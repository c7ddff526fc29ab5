"""The optimizer step megatron-core takes, without the host round trips it makes when neither
TransformerEngine nor apex is installed (our GPU image has neither).

Without them megatron 0.16.1 falls back to
  - `torch.optim.AdamW` with its default multi-tensor (foreach) implementation: several passes over
    parameters, gradients and both moments per step. The fused implementation does one. On an
    H200 the step of a 3B model is a few percent of a training iteration (see bench/RESULTS.md).
  - a gradient norm (`local_multi_tensor_l2_norm`) that turns every per-tensor norm into a Python
    float: one device->host sync per parameter tensor (about 400 for a 36-layer model), and the
    engine's finiteness-checked step computed it twice (once to check, once inside
    `clip_grad_norm`).

`global_grad_norm` computes the same quantity as megatron's `get_grad_norm` (sum of squared
per-shard norms, reduced over each optimizer's grad-stats group) with one sync at the end, and
`clip_by_total_norm` applies megatron's clipping with the norm already computed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from verl_mcore.utils.device import compute_device


def sub_optimizers(optimizer) -> list:
    """The megatron optimizers a (possibly chained) optimizer steps."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


@torch.no_grad()
def global_grad_norm(optimizer) -> torch.Tensor:
    """L2 norm of all main gradients the optimizer steps, reduced over every grad-stats group
    (model- and data-parallel ranks for the distributed optimizer): a 0-dim fp32 tensor, the
    same on every rank. Duplicated parameters (shared embeddings, TP-replicated norms) are
    counted once, as megatron's `get_main_grads_for_grad_norm` selects them."""
    return _reduced_norm(optimizer, lambda opt: opt.get_main_grads_for_grad_norm()
                         if opt.get_parameters() else [])


@torch.no_grad()
def global_param_norm(optimizer) -> torch.Tensor:
    """L2 norm of every parameter the optimizer updates (its fp32 main copies, or the shards the
    distributed optimizer owns), reduced like `global_grad_norm`: a 0-dim fp32 tensor, the same
    on every rank. Parameters replicated over TP count once per TP rank, so it is not the model's
    norm, but the same quantity step after step, which is what a divergence check needs."""
    def main_params(opt):
        inner = getattr(opt, "optimizer", None)
        if inner is None or getattr(opt, "is_stub_optimizer", False):
            return []
        return [p for g in inner.param_groups for p in g["params"]]

    return _reduced_norm(optimizer, main_params)


def _reduced_norm(optimizer, tensors_of) -> torch.Tensor:
    """sqrt of the sum of squared norms of `tensors_of(sub-optimizer)`, all-reduced once per
    distinct grad-stats group (sub-optimizers sharing a group are summed first, as megatron's
    ChainedOptimizer does), with one foreach norm per sub-optimizer and no host read."""
    per_group: list[list] = []  # [group, sum of squares]
    for opt in sub_optimizers(optimizer):
        tensors = tensors_of(opt)
        if tensors:
            squares = torch.stack(torch._foreach_norm(tensors)).float().square().sum()
        else:
            squares = torch.zeros((), dtype=torch.float32, device=_device_of(opt))
        group = opt.get_grad_stats_parallel_group()
        entry = next((e for e in per_group if e[0] is group), None)
        if entry is None:
            per_group.append([group, squares])
        else:
            entry[1] = entry[1] + squares.to(entry[1].device)
    total = None
    for group, squares in per_group:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
        total = squares if total is None else total + squares.to(total.device)
    return total.sqrt()


@torch.no_grad()
def clip_by_total_norm(optimizer, max_norm: float, total_norm: float) -> None:
    """Scale every main gradient by max_norm / (total_norm + 1e-6) when that is below 1:
    megatron's clip_grad_by_total_norm_fp32 with the norm computed once, and one in-place
    multi-tensor multiply (megatron's fallback without apex writes `src * scale` into a new
    tensor and copies it back, per gradient). The same products, so the same values."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if not coeff < 1.0:  # also a nan norm: megatron leaves the gradients as they are then
        return
    for opt in sub_optimizers(optimizer):
        decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        grads = [g for g in (getattr(p, "decoupled_grad" if decoupled else "grad", None)
                             for p in opt.get_parameters()) if g is not None]
        if grads:
            torch._foreach_mul_(grads, coeff)


def prefer_fused_adam(optimizer) -> int:
    """Switch torch Adam/AdamW inside megatron's optimizer to the fused implementation when all
    its parameters are on a GPU; returns how many torch optimizers were switched.

    Call it after building the optimizer and after loading a checkpoint: a load replaces the
    param groups (and their `fused` flag) with the saved ones, and megatron puts Adam's `step`
    on the host, where the fused kernel cannot read it. The update is the same Adam(W) update;
    results differ from the foreach path only by floating-point rounding.
    """
    switched = 0
    for opt in sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or not all(p.is_cuda and p.is_floating_point() for p in params):
            continue
        if any(g.get("differentiable") or g.get("capturable") for g in inner.param_groups):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        for p, state in inner.state.items():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(device=p.device, dtype=torch.float32)
        switched += 1
    return switched


def _device_of(opt) -> torch.device:
    params = opt.get_parameters()
    if params:
        return params[0].device
    return compute_device()
