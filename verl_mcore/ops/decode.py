"""Fused ops of the native engine's decode step (csrc/decode.cu), with their torch references.

    rmsnorm(residual, delta, weight, eps) -> out        residual += delta (in place) when delta given
    rope_cache(qkv, cos, sin, positions, rows, cache_k, cache_v, groups, r, hd) -> q
    swiglu(x) -> silu(x[..., :f]) * x[..., f:]   (the MLP's gated activation of its fused gate/up rows)
    paged_attention(q, cache_k, cache_v, block_table, seq_lens, scale) -> out   (over a paged KV
                        cache: torch's flash kernel, csrc/paged_attention.cu with flash="kernel",
                        ops/triton_paged.py with flash="triton")

`available(tensor)` says whether the kernels serve a tensor (a CUDA tensor and the extension
loaded); the references run everywhere and are the tests' oracle. All ops are forward-only.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from verl_mcore.ops import triton_paged
from verl_mcore.ops._extension import extension, extension_status


def available(t: Tensor) -> bool:
    return t.is_cuda and extension() is not None and hasattr(extension(), "rope_cache")


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def kernel_available(t: Tensor) -> bool:
    """Whether csrc/paged_attention.cu serves `t` (an extension built before it has no such op)."""
    return available(t) and hasattr(extension(), "paged_attention")


# csrc/paged_attention.cu kMaxHeads: a CTA serves up to this many query heads of one KV group.
_KERNEL_HEADS_PER_CTA = 8


def paged_kernel_splits(batch: int, heads: int, groups: int, max_len: int, sms: int) -> int:
    """Split-K factor of the paged-attention kernel, from shapes only (a CUDA graph captured with it
    replays for every mix of lengths). The kernel runs a CTA per (sequence, KV group, up to 8 heads)
    over the sequence's keys; when those CTAs are fewer than the SMs, each sequence's keys are cut
    into `splits` equal shares so that about two CTAs per SM stream, but each share of the longest
    possible sequence (`max_len` = width x block_size) keeps >= 256 keys: every split writes
    (and the combine rereads) r x hd floats a head, small against 256 rows of K and V."""
    ctas = batch * groups * -(-(heads // groups) // _KERNEL_HEADS_PER_CTA)
    if ctas >= sms:
        return 1
    return max(1, min(-(-2 * sms // ctas), max_len // 256, 64))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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


def cache_rows(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Flat row (block * block_size + offset) of each sequence's `positions` [b] in a paged cache;
    `block_table` [b, width] holds each sequence's blocks in order."""
    blocks = block_table.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).long()
    return blocks * block_size + positions % block_size


def rope_cache_reference(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, rows: Tensor,
                         cache_k: Tensor, cache_v: Tensor, groups: int, r: int, hd: int) -> Tensor:
    tokens = positions.shape[0]
    qkv = qkv.reshape(tokens, groups, r + 2, hd)
    c = cos[positions].view(tokens, 1, 1, hd)
    s = sin[positions].view(tokens, 1, 1, hd)
    qk = rotary(qkv[:, :, : r + 1], c, s)
    cache_k[rows] = qk[:, :, r]
    cache_v[rows] = qkv[:, :, r + 1]
    return qk[:, :, :r].reshape(tokens, groups * r, hd)


def rope_cache(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, rows: Tensor, cache_k: Tensor,
               cache_v: Tensor, groups: int, r: int, hd: int) -> Tensor:
    """One token per sequence. qkv [tokens, groups * (r + 2) * hd] in megatron's group-interleaved
    order; cos/sin [max_pos, hd]; positions and rows int64 [tokens]; cache_k/cache_v
    [cache_rows, groups, hd] (a paged cache's blocks, flattened). Rotates q and k by each token's
    position, writes k and v into cache row `rows[t]`, returns q [tokens, groups * r, hd]."""
    if available(qkv):
        return extension().rope_cache(qkv.contiguous(), cos, sin, positions, rows, cache_k, cache_v, groups,
                                      r, hd, _stream(qkv))
    return rope_cache_reference(qkv, cos, sin, positions, rows, cache_k, cache_v, groups, r, hd)


def swiglu_reference(x: Tensor) -> Tensor:
    """megatron's gated SiLU of fc1's [gate; up] output: silu(gate), rounded, times up."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def swiglu(x: Tensor) -> Tensor:
    """x [..., 2f] -> silu(x[..., :f]) * x[..., f:] [..., f]: one kernel for torch's two."""
    if available(x) and hasattr(extension(), "swiglu") and x.dtype in (torch.bfloat16, torch.float16,
                                                                        torch.float32):
        return extension().swiglu(x.contiguous(), _stream(x))
    return swiglu_reference(x)


def paged_attention_reference(q: Tensor, cache_k: Tensor, cache_v: Tensor, block_table: Tensor,
                              seq_lens: Tensor, scale: float) -> Tensor:
    """Gathers every sequence's blocks (all `width` of them; keys past seq_lens masked), in float32."""
    b, heads, hd = q.shape
    block, groups = cache_k.shape[1], cache_k.shape[2]
    width = block_table.shape[1]
    rows = block_table.long()
    keys = cache_k[rows].view(b, width * block, groups, hd).permute(0, 2, 1, 3).float()
    values = cache_v[rows].view(b, width * block, groups, hd).permute(0, 2, 1, 3).float()
    qg = q.view(b, groups, heads // groups, hd).float()
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [b, groups, r, keys]
    keep = torch.arange(width * block, device=q.device).view(1, 1, 1, -1) < seq_lens.view(-1, 1, 1, 1)
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.matmul(probs, values).reshape(b, heads, hd).to(q.dtype)


def paged_attention(q: Tensor, cache_k: Tensor, cache_v: Tensor, block_table: Tensor, seq_lens: Tensor,
                    scale: float, flash: Optional[str] = None, cascade=None) -> Tensor:
    """Decode attention over a paged KV cache: q [b, heads, hd] (one token per sequence) over the
    first seq_lens[i] keys of sequence i, which sit in blocks block_table[i, 0], [i, 1], ... of
    cache_k/cache_v [blocks, block_size, groups, hd]. Returns [b, heads, hd].

    flash="paged" (where `paged_flash_supported` said yes: CUDA, bf16/fp16): flash attention's
    paged variable-length kernel, reading only each sequence's own keys, one launch for every mix
    of lengths (so one CUDA graph serves them all). flash="sequence" (`sequence_flash_supported`;
    for torch builds whose flash kernel takes no block table): every sequence holds one block (a
    contiguous slot); the variable-length kernel reads block_table[i, 0]'s first seq_lens[i]
    keys. flash="kernel" (`paged_kernel_supported`; bf16/fp16 where the csrc/ extension has it):
    csrc/paged_attention.cu, reading only each sequence's own keys once for all heads of a KV
    group, any block size, split-K by `paged_kernel_splits`. flash="triton"
    (`paged_triton_supported`): ops/triton_paged.py, the same reads with the products on tensor
    cores; with `cascade` (triton_paged.paged_attention's), the keys a prefix group shares read
    once for the group (other modes ignore it: their results are the same). Otherwise the
    reference, which reads
    all `width` blocks of every row (graph-safe too: no host sync)."""
    if flash == "triton":
        return triton_paged.paged_attention(q, cache_k, cache_v, block_table, seq_lens, scale, cascade=cascade)
    if flash == "kernel" and kernel_available(q):
        max_len = block_table.shape[1] * cache_k.shape[1]
        splits = paged_kernel_splits(q.shape[0], q.shape[1], cache_k.shape[2], max_len, _sm_count(q.device))
        return extension().paged_attention(q.contiguous(), cache_k, cache_v, block_table.to(torch.int32),
                                           seq_lens.to(torch.int32), float(scale), splits, _stream(q))
    if flash == "sequence":
        b, block = q.shape[0], cache_k.shape[1]
        groups, hd = cache_k.shape[2], cache_k.shape[3]
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        # Each sequence's keys start at its block; with seqused_k only the starts are read.
        starts = F.pad(block_table[:, 0] * block, (0, 1))
        return torch.ops.aten._flash_attention_forward(
            q, cache_k.view(-1, groups, hd), cache_v.view(-1, groups, hd), cu_q, starts, 1, block, 0.0, False,
            False, scale=scale, seqused_k=seq_lens.to(torch.int32))[0]
    if flash == "paged":
        b = q.shape[0]
        max_k = block_table.shape[1] * cache_k.shape[1]
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        return torch.ops.aten._flash_attention_forward(
            q, cache_k, cache_v, cu_q, cu_q * max_k, 1, max_k, 0.0, False, False, scale=scale,
            seqused_k=seq_lens.to(torch.int32), block_table=block_table)[0]
    return paged_attention_reference(q, cache_k, cache_v, block_table, seq_lens, scale)


def _matches_reference(device: torch.device, heads: int, groups: int, hd: int, dtype: torch.dtype,
                       block: int, per: int, attend) -> Optional[str]:
    """None when `attend(q, cache_k, cache_v, table, lens, scale)` -> [outputs] matches
    `paged_attention_reference` on three sequences of `per` blocks each, out of order, with
    lengths 1, mid-table and the whole table; else why not (any exception: not here)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        b = 3
        kc, vc = (torch.randn(b * per + 1, block, groups, hd, generator=g).to(device, dtype) for _ in range(2))
        table = (torch.randperm(b * per, generator=g) + 1).view(b, per).to(device, torch.int32)
        lens = torch.tensor([1, per * block // 2 + 3, per * block], dtype=torch.int32, device=device)
        q = torch.randn(b, heads, hd, generator=g).to(device, dtype)
        want = paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5).float()
        err = max((got.float() - want).abs().max().item()
                  for got in attend(q, kc, vc, table, lens, hd ** -0.5))
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None if err < 2e-2 else f"differs from the reference by {err:.3g}"


def paged_flash_supported(device: torch.device, heads: int = 4, groups: int = 2, hd: int = 64,
                          dtype: torch.dtype = torch.bfloat16, block_size: int = 256) -> Optional[str]:
    """None when torch's flash kernel reads a paged cache with `block_size`-token blocks here, for
    this head layout and dtype, and matches the reference (GQA, lengths that end mid-block, blocks
    out of order); else why not."""
    return _matches_reference(device, heads, groups, hd, dtype, block_size, 3,
                              lambda *a: [paged_attention(*a, flash="paged")])


def sequence_flash_supported(device: torch.device, heads: int = 4, groups: int = 2, hd: int = 64,
                             dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """`paged_flash_supported` for flash="sequence": one block per sequence, blocks out of order."""
    return _matches_reference(device, heads, groups, hd, dtype, 64, 1,
                              lambda *a: [paged_attention(*a, flash="sequence")])


def paged_kernel_supported(device: torch.device, heads: int = 4, groups: int = 2, hd: int = 64,
                           dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """`paged_flash_supported` for flash="kernel" (csrc/paged_attention.cu): 16-token blocks out of
    order, lengths of 1, mid-table and the whole table (320 keys: three non-empty shares), with one
    split and with three."""
    if device.type != "cuda":
        return "not a CUDA device"
    if extension() is None or not hasattr(extension(), "paged_attention"):
        return f"the csrc/ extension has no paged_attention kernel ({extension_status()})"
    return _matches_reference(
        device, heads, groups, hd, dtype, 16, 20,
        lambda q, kc, vc, table, lens, scale: [
            extension().paged_attention(q, kc, vc, table, lens, scale, splits, _stream(q)) for splits in (1, 3)])


def paged_triton_supported(device: torch.device, heads: int = 4, groups: int = 2, hd: int = 64,
                           dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """`paged_flash_supported` for flash="triton" (ops/triton_paged.py): 16-token blocks out of
    order, lengths of 1, mid-table and the whole table, with one split and with three."""
    if device.type != "cuda":
        return "not a CUDA device"
    missing = triton_paged.available()
    if missing:
        return missing
    plain = _matches_reference(
        device, heads, groups, hd, dtype, 16, 20,
        lambda q, kc, vc, table, lens, scale: [
            triton_paged.paged_attention(q, kc, vc, table, lens, scale, splits=splits) for splits in (1, 3)])
    return plain or _cascade_matches_reference(device, heads, groups, hd, dtype)


def _cascade_matches_reference(device: torch.device, heads: int, groups: int, hd: int,
                               dtype: torch.dtype) -> Optional[str]:
    """The Triton kernel's cascade (the engine's with n > 1 samples a prompt): three sequences
    that share their first two 16-token blocks, in group rows of the kernel's size, against the
    reference; None when it matches, else why not."""
    try:
        g = torch.Generator(device="cpu").manual_seed(1)
        b, block, per = 3, 16, 4
        kc, vc = (torch.randn(b * per + 1, block, groups, hd, generator=g).to(device, dtype) for _ in range(2))
        table = (torch.randperm(b * per, generator=g) + 1).view(b, per).to(torch.int32)
        table[1:, :2] = table[0, :2]  # the shared prompt blocks
        lens = torch.tensor([2 * block + 1, 3 * block, per * block], dtype=torch.int32)
        n_max = triton_paged.cascade_members(heads // groups)
        members = torch.full((b, n_max), -1, dtype=torch.int32)
        for row, start in enumerate(range(0, b, n_max)):
            chunk = torch.arange(start, min(b, start + n_max), dtype=torch.int32)
            members[row, : len(chunk)] = chunk
        rows = -(-b // n_max)
        plen = torch.tensor([2 * block] * rows + [0] * (b - rows), dtype=torch.int32)
        first = torch.full((b,), 2 * block, dtype=torch.int32)
        q = torch.randn(b, heads, hd, generator=g).to(device, dtype)
        table, lens = table.to(device), lens.to(device)
        want = paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5).float()
        got = triton_paged.paged_attention(q, kc, vc, table, lens, hd ** -0.5, splits=2, cascade=tuple(
            t.to(device) for t in (members, plen, first)))
        err = (got.float() - want).abs().max().item()
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        return f"cascade: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None if err < 2e-2 else f"cascade: differs from the reference by {err:.3g}"
