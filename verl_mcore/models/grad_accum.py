"""megatron-core's gradient-accumulation fusion without apex.

With `TransformerConfig.gradient_accumulation_fusion`, megatron's parallel linears add each
weight gradient straight into DDP's `main_grad` (fp32) inside their backward, through apex's
`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32` (one GEMM with beta = 1). Without it,
the backward returns the weight gradient in the parameter dtype (bf16) and DDP's hook adds it,
`main_grad += grad`: a bf16 tensor written, read back, and one more elementwise kernel per
parameter per micro-batch (on one H200, 3B model, 4096-token micro-batches: 5,842 add kernels,
271 ms of a 5.6 s update). The GPU image has no apex, so this module implements the two
functions megatron calls with torch ops, and `install()` hands them to megatron.

    main_grad [out, in] += grad_output[N, out]^T @ total_input[N, in]

- Same dtype everywhere (fp32 models; bf16 main_grad): `main_grad.addmm_(...)`.
- bf16/fp16 inputs into an fp32 main_grad on CUDA: a cuBLAS GEMM with fp32 output and beta = 1,
  through `torch.addmm(..., out_dtype=torch.float32, out=main_grad)` or, where that overload
  wants `self` in the input dtype (some torch versions), the batch-of-one
  `torch.baddbmm(..., out_dtype=...)`, which accumulates into `out` itself. Which one works is
  probed once per process against a float64 reference; if neither does, the product is formed
  in the input dtype and added (what megatron does without the fusion: correct, just not faster).
- CPU: the inputs are upcast and `addmm_` accumulates, so CPU runs take megatron's fused code
  path exactly as the GPU does.
"""
from __future__ import annotations

import logging
import sys
from typing import Callable, Optional

import torch
from torch import Tensor

log = logging.getLogger("verl_mcore.models.grad_accum")

__all__ = ["install", "wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"]


def wgrad_gemm_accum_fp32(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """`main_grad [out, in]` (fp32) += `grad_output [N, out]`^T @ `total_input [N, in]`
    (apex's argument order; inputs fp32, bf16 or fp16)."""
    _accumulate(grad_output.t(), total_input, main_grad)


def wgrad_gemm_accum_fp16(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """The same with a bf16 / fp16 `main_grad` (DDP with grad_reduce_in_fp32=False)."""
    _accumulate(grad_output.t(), total_input, main_grad)


def _accumulate(a: Tensor, b: Tensor, acc: Tensor) -> None:
    """acc += a @ b, in place."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif not acc.is_cuda:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    elif acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        _mixed_accumulate(acc.device, a.dtype)(a, b, acc)
    else:
        _product_then_add(a, b, acc)  # any other mix: megatron's unfused arithmetic


def _addmm_out_dtype(a: Tensor, b: Tensor, acc: Tensor) -> None:
    torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)


def _baddbmm_out_dtype(a: Tensor, b: Tensor, acc: Tensor) -> None:
    acc3 = acc.unsqueeze(0)
    torch.baddbmm(acc3, a.unsqueeze(0), b.unsqueeze(0), out_dtype=acc.dtype, out=acc3)


def _product_then_add(a: Tensor, b: Tensor, acc: Tensor) -> None:
    acc.add_(torch.mm(a, b))


# Fused candidates in order of preference; _product_then_add is the unfused fallback.
_CANDIDATES: tuple[Callable[[Tensor, Tensor, Tensor], None], ...] = (
    _addmm_out_dtype, _baddbmm_out_dtype)
_chosen: dict[tuple, Callable[[Tensor, Tensor, Tensor], None]] = {}


def _mixed_accumulate(device: torch.device, dtype: torch.dtype) -> Callable[[Tensor, Tensor, Tensor], None]:
    """The first candidate that accumulates a `dtype` product into fp32 in place on this device
    within fp32 rounding of a float64 reference (probed once per device and dtype: a few small
    kernels and one sync, on the first backward)."""
    fn = _chosen.get((device, dtype))
    if fn is None:
        fn = probe(device, dtype) or _product_then_add
        _chosen[(device, dtype)] = fn
        log.info("gradient-accumulation fusion (%s into fp32 on %s): %s", dtype, device,
                 fn.__name__)
    return fn


def probe(device, dtype: torch.dtype = torch.bfloat16) -> Optional[Callable]:
    """The first fused candidate that gives `acc += a @ b` (inputs `dtype`, acc fp32) on
    `device` in place and within fp32 rounding; None if none does."""
    g = torch.Generator().manual_seed(0)
    # Transposed `a`, as in the weight-gradient GEMM (grad_output.t()).
    a = torch.randn(96, 64, generator=g).to(dtype).t().to(device)    # [64, 96]
    b = torch.randn(96, 80, generator=g).to(dtype).to(device)        # [96, 80]
    acc0 = torch.randn(64, 80, generator=g).to(device)
    want = acc0.double() + a.double() @ b.double()
    # bf16 rounding of the product (the unfused path) would be ~1e-2 here; fp32 is ~1e-6.
    tol = 1e-4 * float(want.abs().max())
    for fn in _CANDIDATES:
        acc = acc0.clone()
        try:
            fn(a, b, acc)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            log.debug("%s unavailable: %s", fn.__name__, exc)
            continue
        if acc.dtype == torch.float32 and float((acc.double() - want).abs().max()) <= tol:
            return fn
    return None


def install() -> None:
    """Let megatron's parallel linears use gradient-accumulation fusion (set
    `gradient_accumulation_fusion=True` in the TransformerConfig, before building, and wrap the
    model in megatron DDP, which provides `main_grad`). apex's kernels are kept when megatron
    found them; otherwise this module takes their place. Idempotent."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return  # apex's fused_weight_gradient_mlp_cuda, or already installed
    layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
    layers._grad_accum_fusion_available = True
