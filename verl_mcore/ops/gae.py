"""Batched masked GAE: `verl_mcore.ops.gae_reference.gae`, with a CUDA kernel on GPUs.

The semantics are those of `gae_reference.gae` (read its docstring; `verl_mcore.algo.advantages`
exports it as `gae`): that function is the reference and the CPU implementation, and the kernel
(csrc/gae.cu) computes the same recurrence as a parallel chunked scan in float32. float64 inputs
stay on the reference (the kernel accumulates in float32). `gae_whitened` adds masked whitening of
the advantages (`gae_reference.masked_whiten`): the kernel also emits each scan tile's (count, mean, M2) of
valid advantages, so whitening costs one more elementwise pass instead of three reductions.
Registered as torch.library custom ops `verl_mcore::gae` and `verl_mcore::gae_whitened` (no
autograd: advantages are targets, not functions to differentiate).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from verl_mcore.ops import _groups
from verl_mcore.ops._extension import extension
from verl_mcore.ops.gae_reference import gae as _reference_gae, masked_whiten

__all__ = ["gae", "gae_whitened"]


def _result_dtype(rewards: Tensor, values: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(torch.float32, rewards.dtype), values.dtype)


def _kernel_inputs(rewards: Tensor, values: Tensor, mask: Tensor):
    """float32 rewards/values and a mask dtype the kernel reads, or None to use the reference."""
    if _result_dtype(rewards, values) != torch.float32:
        return None
    if mask.dtype not in (torch.bool, torch.uint8, torch.float32):
        mask = mask != 0
    return rewards.float(), values.float(), mask


@torch.library.custom_op("verl_mcore::gae", mutates_args=())
def _gae_op(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    return _reference_gae(rewards, values, mask, gamma, lam)


def _gae_whitened_reference(rewards, values, mask, gamma, lam, eps, group_name):
    adv, ret = _reference_gae(rewards, values, mask, gamma, lam)
    group = _groups.lookup(group_name, "verl_mcore::gae_whitened")
    return masked_whiten(adv, mask, eps=eps, group=group), ret


@torch.library.custom_op("verl_mcore::gae_whitened", mutates_args=())
def _gae_whitened_op(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, eps: float, group_name: str
) -> tuple[Tensor, Tensor]:
    return _gae_whitened_reference(rewards, values, mask, gamma, lam, eps, group_name)


def moments_from_tile_stats(tile_stats: Tensor, group: Optional[dist.ProcessGroup]) -> tuple[int, float, float]:
    """Pool per-tile `(count, mean, M2)` rows `[tiles, 3]` (over `group`'s ranks too) into
    `(n, mean, unbiased variance)` of all valid advantages, as `masked_whiten` defines them.

    The pooling stays on the device and the three numbers come to the host in one read: each
    read is a sync, and at B=1024, T=8192 three of them were half of the whitened GAE's time.
    """
    n_i, mean_i, m2_i = tile_stats.double().unbind(dim=-1)  # [tiles] each
    totals = torch.stack([n_i.sum(), (n_i * mean_i).sum()])
    if group is not None:
        dist.all_reduce(totals, group=group)
    mean = totals[1] / totals[0].clamp(min=1)
    m2 = (m2_i + n_i * (mean_i - mean) ** 2).sum()  # pooled sum of squared deviations from `mean`
    if group is not None:
        dist.all_reduce(m2, group=group)
    count, mean, m2 = torch.stack([totals[0], mean, m2]).tolist()
    n = int(round(count))
    if n < 2:
        where = f" over {dist.get_world_size(group)} ranks" if group is not None else ""
        raise ValueError(
            f"gae_whitened: needs at least 2 valid tokens to estimate a variance, found {n}{where}; "
            "check the response mask (is every response empty?) or disable whitening"
        )
    return n, mean, m2 / (n - 1)


def _whiten_from_tile_stats(adv: Tensor, mask: Tensor, tile_stats: Tensor, eps: float, group_name: str) -> None:
    """Whiten `adv` in place from the kernel's per-tile (count, mean, M2), as masked_whiten does.

    One rank: the pooling and the normalisation both run on the device and the host reads only
    the count afterwards, to refuse fewer than 2 valid tokens (one sync, after all the work is
    queued). Across ranks the pooled moments are all-reduced first (moments_from_tile_stats).
    """
    group = _groups.lookup(group_name, "verl_mcore::gae_whitened")
    stream = torch.cuda.current_stream(adv.device).cuda_stream
    if group is None:
        moments = extension().whiten_by_tile_stats_(adv, mask, tile_stats, float(eps), stream)
        n = int(round(moments[0].item()))
        if n < 2:
            raise ValueError(
                f"gae_whitened: needs at least 2 valid tokens to estimate a variance, found {n}; "
                "check the response mask (is every response empty?) or disable whitening"
            )
        return
    _, mean, var = moments_from_tile_stats(tile_stats, group)
    extension().masked_normalize_(adv, mask, mean, 1.0 / math.sqrt(var + eps), stream)


def _gae_cuda(rewards, values, mask, gamma, lam):
    inputs = _kernel_inputs(rewards, values, mask)
    if inputs is None or rewards.dim() != 2:
        return _reference_gae(rewards, values, mask, gamma, lam)
    stream = torch.cuda.current_stream(rewards.device).cuda_stream
    adv, ret, _ = extension().gae(*inputs, float(gamma), float(lam), stream, -1, False)
    return adv, ret


def _gae_whitened_cuda(rewards, values, mask, gamma, lam, eps, group_name):
    inputs = _kernel_inputs(rewards, values, mask)
    if inputs is None or rewards.dim() != 2:
        return _gae_whitened_reference(rewards, values, mask, gamma, lam, eps, group_name)
    stream = torch.cuda.current_stream(rewards.device).cuda_stream
    adv, ret, tile_stats = extension().gae(*inputs, float(gamma), float(lam), stream, -1, True)
    _whiten_from_tile_stats(adv, inputs[2], tile_stats, eps, group_name)
    return adv, ret


if extension() is not None:
    _gae_op.register_kernel("cuda")(_gae_cuda)
    _gae_whitened_op.register_kernel("cuda")(_gae_whitened_cuda)


def _eager_kernel(t: Tensor) -> bool:
    """Whether this call goes straight to the kernel's implementation instead of through the
    registered op: eager calls on CUDA tensors with the extension loaded. torch.library's dispatch
    of a Python custom op costs ~60 us a call on the H200 (ops.gae 0.146 ms against 0.083 ms for
    the extension call at B=1024, T=8192; whitened: 0.294 against ~0.16 ms), as much as the
    kernels themselves. Under torch.compile the registered op is what gets traced."""
    return t.is_cuda and extension() is not None and not torch.compiler.is_compiling()


def _fake(rewards, values, mask, *args):
    out = torch.empty(rewards.shape, dtype=_result_dtype(rewards, values), device=rewards.device)
    return out, torch.empty_like(out)


_gae_op.register_fake(_fake)
_gae_whitened_op.register_fake(_fake)


def _check_shapes(where: str, rewards: Tensor, values: Tensor, mask: Tensor) -> None:
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"{where}: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must all be [batch, T]"
        )


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """`rewards, values, mask: [batch, T]` -> `(advantages, returns)`, each `[batch, T]`.

    Exactly `gae_reference.gae` (masked positions skipped and set to 0; see there),
    computed by the CUDA kernel for float32/bf16/fp16 GPU tensors when the extension is loaded.
    """
    _check_shapes("gae", rewards, values, mask)
    if _eager_kernel(rewards):
        return _gae_cuda(rewards, values, mask, float(gamma), float(lam))
    return _gae_op(rewards, values, mask, float(gamma), float(lam))


@torch.no_grad()
def gae_whitened(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    eps: float = 1e-8,
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[Tensor, Tensor]:
    """`gae`, then `masked_whiten` of the advantages: `(whitened advantages, returns)`, `[batch, T]`.

    Same result as `gae_reference.masked_whiten(gae(...)[0], mask, eps=eps, group=group)`: mean
    and unbiased variance over the valid tokens (of all ranks of `group`), masked positions 0.
    Raises ValueError below 2 valid tokens.
    """
    _check_shapes("gae_whitened", rewards, values, mask)
    if _eager_kernel(rewards):
        return _gae_whitened_cuda(rewards, values, mask, float(gamma), float(lam), float(eps),
                                  _groups.group_name(group))
    return _gae_whitened_op(rewards, values, mask, float(gamma), float(lam), float(eps), _groups.group_name(group))
