"""Fused ops of the native engine's decode step (csrc/decode.cu), with their torch references.

    rmsnorm(residual, delta, weight, eps) -> out        residual += delta (in place) when delta given
    rope_cache(qkv, cos, sin, positions, cache_k, cache_v, groups, r, hd) -> q
    cache_attention(q, cache_k, cache_v, positions, scale) -> out      flash attention with
                                                                        per-sequence key counts

`available(tensor)` says whether the kernels serve a tensor (a CUDA tensor and the extension
loaded); the references run everywhere and are the tests' oracle. Both ops are forward-only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from verl_mcore.ops._extension import extension


def available(t: Tensor) -> bool:
    return t.is_cuda and extension() is not None and hasattr(extension(), "rope_cache")


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def rmsnorm_reference(residual: Tensor, delta: Optional[Tensor], weight: Tensor, eps: float) -> Tensor:
    """torch's rms_norm, rounding where it rounds: (h * rstd) in h's dtype, then * weight."""
    if delta is not None:
        residual.copy_(residual + delta)
    h = residual.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * rstd).to(residual.dtype) * weight


def rmsnorm(residual: Tensor, delta: Optional[Tensor], weight: Tensor, eps: float) -> Tensor:
    """[residual += delta;] return rmsnorm(residual) * weight. residual must be contiguous."""
    if available(residual):
        return extension().rmsnorm(residual, delta, weight, float(eps), _stream(residual))
    return rmsnorm_reference(residual, delta, weight, eps)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as `x * cos + rotate_half(x) * sin` (non-interleaved halves): the rounding the
    rope_cache kernel reproduces, and the native engine's unfused rotation."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_cache_reference(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, cache_k: Tensor,
                         cache_v: Tensor, groups: int, r: int, hd: int) -> Tensor:
    tokens = positions.shape[0]
    rows = qkv.reshape(tokens, groups, r + 2, hd)
    c = cos[positions].view(tokens, 1, 1, hd)
    s = sin[positions].view(tokens, 1, 1, hd)
    qk = rotary(rows[:, :, : r + 1], c, s)
    slots = torch.arange(tokens, device=qkv.device)
    cache_k[slots, positions] = qk[:, :, r]
    cache_v[slots, positions] = rows[:, :, r + 1]
    return qk[:, :, :r].reshape(tokens, groups * r, hd)


def rope_cache(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, cache_k: Tensor, cache_v: Tensor,
               groups: int, r: int, hd: int) -> Tensor:
    """One token per sequence (token t in cache slot t). qkv [tokens, groups * (r + 2) * hd] in
    megatron's group-interleaved order; cos/sin [max_pos, hd]; positions int64 [tokens];
    cache_k/cache_v [slots, len, groups, hd]. Rotates q and k, writes k and v at each token's
    position, returns q [tokens, groups * r, hd]."""
    if available(qkv):
        return extension().rope_cache(qkv.contiguous(), cos, sin, positions, cache_k, cache_v, groups, r, hd,
                                      _stream(qkv))
    return rope_cache_reference(qkv, cos, sin, positions, cache_k, cache_v, groups, r, hd)


def cache_attention_reference(q: Tensor, cache_k: Tensor, cache_v: Tensor, positions: Tensor,
                              scale: float) -> Tensor:
    tokens, heads, hd = q.shape
    groups = cache_k.shape[2]
    length = cache_k.shape[1]
    keys = cache_k[:tokens].permute(0, 2, 1, 3)  # [tokens, groups, len, hd]
    values = cache_v[:tokens].permute(0, 2, 1, 3)
    qg = q.view(tokens, groups, heads // groups, hd).float()
    scores = torch.matmul(qg, keys.float().transpose(-1, -2)) * scale
    keep = torch.arange(length, device=q.device).view(1, 1, 1, length) <= positions.view(-1, 1, 1, 1)
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.matmul(probs, values.float()).reshape(tokens, heads, hd).to(q.dtype)


def cache_attention(q: Tensor, cache_k: Tensor, cache_v: Tensor, positions: Tensor, scale: float) -> Tensor:
    """Decode attention: q [tokens, heads, hd] (token t in slot t) over keys/values 0..positions[t]
    of cache_k/cache_v [slots, len, groups, hd]; returns [tokens, heads, hd]. On CUDA: flash
    attention's variable-length kernel, slot t's keys starting at t * len and `seqused_k` of them
    used, so it reads only the keys each sequence has (and one graph serves every length)."""
    if not q.is_cuda:
        return cache_attention_reference(q, cache_k, cache_v, positions, scale)
    tokens, length, groups, hd = q.shape[0], cache_k.shape[1], cache_k.shape[2], q.shape[2]
    cu_q = torch.arange(tokens + 1, dtype=torch.int32, device=q.device)
    return torch.ops.aten._flash_attention_forward(
        q, cache_k.view(-1, groups, hd), cache_v.view(-1, groups, hd), cu_q, cu_q * length, 1, length,
        0.0, False, False, scale=scale, seqused_k=(positions + 1).to(torch.int32))[0]


def check_cache_attention(device: torch.device, dtype: torch.dtype, heads: int, groups: int, hd: int) -> None:
    """Raise unless `cache_attention` runs here and matches its reference (e.g. a torch build whose
    flash kernel ignores `seqused_k` would attend to stale cache rows)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(3, heads, hd, generator=g).to(device, dtype)
    kc, vc = (torch.randn(4, 64, groups, hd, generator=g).to(device, dtype) for _ in range(2))
    positions = torch.tensor([0, 17, 63], device=device)
    got = cache_attention(q, kc, vc, positions, hd ** -0.5).float()
    want = cache_attention_reference(q, kc, vc, positions, hd ** -0.5).float()
    err = (got - want).abs().max().item()
    if not err < 2e-2:
        raise RuntimeError(f"cache attention differs from its reference by {err:.3g}")
