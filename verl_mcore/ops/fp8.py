"""FP8 (e4m3) linear layers for generation: weights with one scale per output channel,
activations quantized per token on the fly.

    quantize_weight(w) -> (w_fp8, scale)            w [N, K] -> e4m3 [N, K], fp32 [N]
    quantize_weight_into(w, w_fp8, scale)           the same, into preallocated tensors
    quantize_tokens(x) -> (x_fp8, scale)            x [M, K] -> e4m3 [M, K], fp32 [M, 1]
    fp8_linear(x, w_fp8, w_scale) -> y              x [..., K] -> y [..., N] in x's dtype
    dequantize(q, scale) -> fp32                    q * scale (rows of q, scale broadcast)

The scheme: for each row r of a matrix (an output channel of a weight, a token of the
activations) scale_r = max_k |a_rk| / 448 in fp32 (448: e4m3's largest finite value), and
q_rk = e4m3(a_rk / scale_r) rounded to nearest (clamped to +-448 first: a division rounded up by
one ulp must not overflow). Then y_mn = (sum_k q_x[m, k] q_w[n, k]) * scale_x[m] * scale_w[n].
Why per output channel and not 128 x 128 blocks: torch._scaled_mm takes row-wise scales on
Hopper in every torch we run (2.11 on the GPU image), one GEMM with the scales applied in its
epilogue; block scales need the newer scaled_mm API and a kernel per recipe. Decode is bound by
the weight bytes, and per-channel scales add 4 bytes per output row (0.3% of a 1536-wide row).

Dispatch (decided per call from shapes, the device check once per device):
  * CUDA, bf16 activations, K and N multiples of 16 (torch._scaled_mm's alignment), a GPU whose
    _scaled_mm takes fp8 with row-wise scales (sm_89 and up; `scaled_mm_supported` runs it once
    against the reference): the activations are quantized (the Triton kernel of
    ops/_triton_fp8_kernels.py where `quantize_kernel_supported`, else the torch reference) and
    torch._scaled_mm(x_fp8, w_fp8.t(), scale_a [M, 1], scale_b [1, N], out_dtype=bf16) runs.
  * Everything else (the CPU, fp32 / fp16 activations, unaligned shapes): `fp8_linear_reference`,
    the same quantized operands multiplied in fp32 -- the same numbers up to the order of the
    fp32 accumulation and the final rounding, so CPU tests see what the GPU computes.

Error of one quantized element (the derivation the weight-sync check's fp8 tolerance cites,
rollout/sync_check.py): e4m3 holds 3 mantissa bits, so values in [2^e, 2^(e+1)) are spaced
2^(e-3) apart and rounding to nearest is off by at most 2^-4 of the value (relative); below
e4m3's smallest normal (2^-6 x scale) the spacing is a constant 2^-9 x scale, an absolute error
of at most 2^-10 x scale. `element_error_bound` is that bound; tests/ops/test_fp8.py checks it.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The scale of an all-zero row: any positive number works (its elements quantize to 0); this
# one keeps 1 / scale finite in fp32.
MIN_AMAX = 1e-12
RELATIVE_STEP = 2.0 ** -4  # half the spacing of e4m3 normals, relative to the value
SUBNORMAL_STEP = 2.0 ** -10  # half the spacing of e4m3 subnormals, relative to the row's scale
QUANTIZE_ROWS = 4096  # rows a weight is quantized at a time (its fp32 temporary)


def _row_scales(a: Tensor) -> Tensor:
    """fp32 [rows, 1]: max |a| of each row / 448 (the max is exact in any input dtype)."""
    amax = a.abs().amax(dim=-1, keepdim=True).float()
    return amax.clamp(min=MIN_AMAX) / FP8_MAX


def _quantize_rows(a: Tensor, scale: Tensor) -> Tensor:
    """e4m3(a / scale), rounded to nearest in fp32 and clamped to +-448."""
    return (a.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] (any float dtype) -> (e4m3 [N, K], fp32 scales [N]): one scale per output channel."""
    scale = _row_scales(w)
    return _quantize_rows(w, scale), scale.view(-1)


def quantize_weight_into(w: Tensor, w_fp8: Tensor, scale: Tensor, rows_at_once: int = QUANTIZE_ROWS) -> None:
    """`quantize_weight(w)` written into w_fp8 [N, K] (e4m3) and scale [N] (fp32), `rows_at_once`
    rows at a time: the fp32 temporary stays at rows_at_once x K x 4 bytes, whatever N is (the
    repartition quantizes the generation copy one tensor at a time; an LM-sized fc1 would
    otherwise double its footprint in fp32)."""
    if w.dim() != 2 or w_fp8.shape != w.shape or scale.shape != w.shape[:1]:
        raise ValueError(f"quantize_weight_into: weight {tuple(w.shape)}, fp8 target "
                         f"{tuple(w_fp8.shape)}, scales {tuple(scale.shape)} (want [N, K], [N, K], [N])")
    for start in range(0, w.shape[0], rows_at_once):
        rows = w[start:start + rows_at_once]
        s = _row_scales(rows)
        w_fp8[start:start + rows_at_once].copy_(_quantize_rows(rows, s))
        scale[start:start + rows_at_once].copy_(s.view(-1))


def quantize_tokens_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): one scale per token (row)."""
    scale = _row_scales(x)
    return _quantize_rows(x, scale), scale


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_tokens_reference`, by one Triton kernel on a GPU where it passed its self-check
    (the same bits: it divides with IEEE rounding and rounds to nearest), else the reference."""
    if x.is_cuda and quantize_kernel_supported(x.device) is None:
        from verl_mcore.ops import _triton_fp8_kernels  # optional: imports triton

        return _triton_fp8_kernels.quantize_rows(x, FP8_MAX, MIN_AMAX)
    return quantize_tokens_reference(x)


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 q * scale: scale [rows] or [rows, 1] multiplies row r of q [rows, K]."""
    return q.float() * scale.reshape(-1, 1).float()


def element_error_bound(a: Tensor, scale: Tensor) -> Tensor:
    """The most |a - dequantize(quantize(a))| can be, elementwise, for rows a [R, K] with scales
    [R] or [R, 1] (module docstring): 2^-4 |a| for normals, 2^-10 scale below them. fp32
    rounding of the division adds a relative 2^-24, well inside."""
    s = scale.reshape(-1, 1).float()
    return torch.maximum(RELATIVE_STEP * a.float().abs(), SUBNORMAL_STEP * s) * (1 + 2.0 ** -20)


def fp8_linear_reference(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    """x [..., K] @ dequantized w [N, K]^T with x quantized per token, multiplied in fp32: the
    numbers `torch._scaled_mm` computes from the same operands. Returns [..., N] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_tokens_reference(x2)
    acc = xq.float() @ w_fp8.float().t()  # [M, N]: products of e4m3 values are exact in fp32
    y = acc * xs * w_scale.view(1, -1).float()
    return y.to(x.dtype).reshape(*lead, w_fp8.shape[0])


def fp8_linear(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    """y = x w^T for an e4m3 weight w_fp8 [N, K] (row-major) with per-output-channel scales
    w_scale [N] (fp32); x [..., K] is quantized per token. Returns [..., N] in x's dtype
    (module docstring: which implementation runs where)."""
    k, n = x.shape[-1], w_fp8.shape[0]
    if w_fp8.dtype != FP8 or w_fp8.shape[1] != k or w_scale.shape != (n,):
        raise ValueError(f"fp8_linear: x [..., {k}], weight {tuple(w_fp8.shape)} {w_fp8.dtype}, "
                         f"scales {tuple(w_scale.shape)} (want an e4m3 [N, {k}] weight and [N] scales)")
    if not (x.is_cuda and x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0
            and scaled_mm_supported(x.device) is None):
        return fp8_linear_reference(x, w_fp8, w_scale)
    lead = x.shape[:-1]
    xq, xs = quantize_tokens(x.reshape(-1, k))
    y = torch._scaled_mm(xq, w_fp8.t(), scale_a=xs, scale_b=w_scale.view(1, n),
                         out_dtype=torch.bfloat16)
    return y.reshape(*lead, n)


@functools.lru_cache(maxsize=None)
def scaled_mm_supported(device: torch.device) -> Optional[str]:
    """None when torch._scaled_mm multiplies e4m3 operands with row-wise scales on this CUDA
    device and matches `fp8_linear_reference` (within bf16 rounding), else why not (a GPU
    before sm_89, a torch without row-wise scaling, ...). Once per device."""
    if device.type != "cuda":
        return "not a CUDA device"
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(5, 64, generator=g).to(device, torch.bfloat16)
        w_fp8, w_scale = quantize_weight(torch.randn(48, 64, generator=g).to(device))
        xq, xs = quantize_tokens_reference(x)
        got = torch._scaled_mm(xq, w_fp8.t(), scale_a=xs, scale_b=w_scale.view(1, -1),
                               out_dtype=torch.bfloat16).float()
        want = fp8_linear_reference(x, w_fp8, w_scale).float()
        err = ((got - want).abs() / want.abs().clamp(min=1.0)).max().item()
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None if err < 2e-2 else f"differs from the reference by {err:.3g}"


@functools.lru_cache(maxsize=None)
def quantize_kernel_supported(device: torch.device) -> Optional[str]:
    """None when the Triton per-token quantization kernel runs on this CUDA device and gives the
    reference's bits (rows of zeros, tiny and huge values, a K that is not a power of two), else
    why not. Once per device."""
    if device.type != "cuda":
        return "not a CUDA device"
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        from verl_mcore.ops import _triton_fp8_kernels  # optional: imports triton

        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(7, 1000, generator=g) * torch.logspace(-6, 6, 7).view(-1, 1))
        x[3] = 0.0
        x = x.to(device, torch.bfloat16)
        got_q, got_s = _triton_fp8_kernels.quantize_rows(x, FP8_MAX, MIN_AMAX)
        want_q, want_s = quantize_tokens_reference(x)
        same = torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_s, want_s)
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None if same else "its bits differ from the reference's"
