"""Triton kernel of ops/fp8.py: per-token (per-row) e4m3 quantization in one launch.

The torch reference takes six kernels per call (abs, max, clamp, divide, clamp, cast); at decode
batch sizes each moves a few hundred KB and is bound by its launch, and the engine quantizes the
input of four GEMMs per layer. One program per row reads the row twice (its max, then the
quantized values), both times from L2 at these sizes.

Bits: the scale is max|x| / 448 and each value x / scale, both divided with IEEE round-to-nearest
(`div_rn`; Triton's `/` on fp32 is an approximate division), clamped to +-448 and converted to
e4m3 rounding to nearest-even: the bits of `fp8.quantize_tokens_reference`. ops/fp8.py runs this
kernel only after `quantize_kernel_supported` compared its bits with the reference's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                   MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
    tl.store(s_ptr + row, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=cols < K)


def quantize_rows(x: torch.Tensor, fp8_max: float, min_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 / fp16 / fp32, rows contiguous) -> (e4m3 [M, K], fp32 scales [M, 1]);
    the scale of a row is max(max |x|, min_amax) / fp8_max (ops/fp8.py's constants)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be [M, K], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=fp8_max,
                             MIN_AMAX=min_amax, BLOCK=min(BLOCK, triton.next_power_of_2(k)),
                             num_warps=4)
    return q, scale
