"""Batched masked GAE: `verl_mcore.algo.advantages.gae`, with a CUDA kernel on GPUs.

The semantics are those of `verl_mcore.algo.advantages.gae` (read its docstring): that function is
the reference and the CPU implementation, and the kernel (csrc/gae.cu) computes the same
recurrence as a parallel chunked scan in float32. float64 inputs stay on the reference (the kernel
accumulates in float32). Registered as the torch.library custom op `verl_mcore::gae` (no autograd:
advantages are targets, not functions to differentiate).
"""
from __future__ import annotations

import torch
from torch import Tensor

from verl_mcore.algo import advantages as _algo
from verl_mcore.ops._extension import extension

__all__ = ["gae"]


def _result_dtype(rewards: Tensor, values: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(torch.float32, rewards.dtype), values.dtype)


@torch.library.custom_op("verl_mcore::gae", mutates_args=())
def _gae_op(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    return _algo.gae(rewards, values, mask, gamma, lam)


if extension() is not None:

    @_gae_op.register_kernel("cuda")
    def _gae_cuda(rewards, values, mask, gamma, lam):
        if _result_dtype(rewards, values) != torch.float32 or rewards.dim() != 2:
            return _algo.gae(rewards, values, mask, gamma, lam)
        if mask.dtype not in (torch.bool, torch.uint8, torch.float32):
            mask = mask != 0
        stream = torch.cuda.current_stream(rewards.device).cuda_stream
        return extension().gae(rewards.float(), values.float(), mask, float(gamma), float(lam), stream, -1)


@_gae_op.register_fake
def _(rewards, values, mask, gamma, lam):
    out = torch.empty(rewards.shape, dtype=_result_dtype(rewards, values), device=rewards.device)
    return out, torch.empty_like(out)


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """`rewards, values, mask: [batch, T]` -> `(advantages, returns)`, each `[batch, T]`.

    Exactly `verl_mcore.algo.advantages.gae` (masked positions skipped and set to 0; see there),
    computed by the CUDA kernel for float32/bf16/fp16 GPU tensors when the extension is loaded.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must all be [batch, T]"
        )
    return _gae_op(rewards, values, mask, float(gamma), float(lam))
