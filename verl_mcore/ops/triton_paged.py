"""Decode attention over a paged KV cache in Triton (`decode.paged_attention(flash="triton")`).

torch 2.11's flash kernel takes no block table, and csrc/paged_attention.cu, which does, streams
its keys on CUDA cores: with r = 6 query heads a KV group it needs ~6 fp32 FMAs per byte of K/V
and measured 1.3-2.2x slower than flash (bench/RESULTS.md, 2026-12-06). This kernel does the
products on tensor cores, as flash does, over the same paged cache:

  * stage 1, one program per (sequence, KV group, split): the group's r query heads as the rows
    of one tile (padded to 16, the smallest tensor-core tile), the split's keys in tiles of
    BLOCK_N (each key's row looked up in the block table: any block size), scores = q kᵀ and
    acc += p v as tl.dot, an online softmax per head in fp32 (base 2, q pre-scaled by
    scale·log2 e); each K/V row is read once for all heads of its group. It writes the split's
    (max, sum, unnormalised acc) to a float32 workspace;
  * stage 2, one program per (sequence, head): the log-sum-exp combine of the splits. A split
    whose share is empty has sum 0 and weight 0; a sequence of no keys gets zeros.

Each sequence's keys are cut into `splits` equal shares on the device (from seq_lens), and the
launch depends on shapes only, so one CUDA graph replays for any mix of lengths. p is rounded to
the cache dtype before the p·v product, as in flash attention. The native engine's default decode
attention on a GPU (behind `decode.paged_triton_supported`): on an H100 it reached 62-95% of the
copy bandwidth at the engine's decode shapes where torch's flash kernel, reading the same keys
unpaged, reached 46-80% (bench/RESULTS.md, 2026-12-06). Its oracle is
`decode.paged_attention_reference`, on a GPU and on the CPU under TRITON_INTERPRET=1 (fp16/fp32:
the interpreter has no bf16).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

BLOCK_N = 64  # keys a stage-1 iteration reads (a [BLOCK_N, hd] tile of K and of V)
MIN_ROWS = 16  # query rows of a tensor-core tile


def available() -> Optional[str]:
    """None when Triton is importable, else why not."""
    import importlib.util

    return None if importlib.util.find_spec("triton") is not None else "triton is not installed"


def splits_for(batch: int, groups: int, max_len: int, sms: int) -> int:
    """Shares of each sequence's keys, from shapes only (graph-safe): about four stage-1 programs
    per SM, each share of the longest possible sequence at least 4 tiles of keys."""
    programs = batch * groups
    return max(1, min(-(-4 * sms // programs), max_len // (4 * BLOCK_N), 64))


def _kernels():
    # Optional heavy dependency: the kernels' module imports triton at its top.
    from verl_mcore.ops import _triton_paged_kernels as k

    return k.partial, k.prefix_partial, k.combine


def _warps(hd: int, rows: int) -> int:
    """Warps of a stage-1 program: 8 from a [16, 128] accumulator up (at 4 warps ptxas spilled
    registers for hd 128: 255 registers and 272-536 bytes of spills, sm_90, Triton 3.6)."""
    return 8 if hd * rows >= 128 * 16 else 4


def cascade_members(r: int) -> int:
    """Sequences of one prefix group (their r query heads each are the rows of one tile of at
    most 64): groups sharing more are cut into several."""
    return max(1, min(8, 64 // r))


def paged_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, splits: Optional[int] = None,
                    cascade: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """`decode.paged_attention` (q [b, heads, hd] over the first seq_lens[i] keys of sequence i in
    blocks block_table[i, :] of cache_k/cache_v [blocks, block_size, groups, hd]) by the Triton
    kernels; `splits` None: `splits_for` the shapes.

    cascade (shared prompt prefixes): (members int32 [G, cascade_members(r)] -- the sequences of
    each prefix group, -1 padded --, plen int32 [G] -- the keys the group shares, 0 for an unused
    row --, first int32 [b] -- where each sequence's own keys start: its group's plen, or 0).
    A group's members must hold the same blocks for their first plen keys (plen a multiple of the
    block size, at most each member's seq_len: nothing checks either); those keys are read once
    for the group (stage 1 of the prefix), the rest per sequence, and the combine merges both."""
    partial, prefix_partial, combine = _kernels()
    b, heads, hd = q.shape
    page, groups = cache_k.shape[1], cache_k.shape[2]
    if heads % groups or hd & (hd - 1) or hd < 16:
        raise ValueError(f"triton paged attention: {heads} heads over {groups} KV groups, head dim {hd} "
                         "(heads a multiple of groups, hd a power of two >= 16)")
    width = block_table.shape[1]
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        splits = splits_for(b, groups, width * page, sms)
    r = heads // groups
    q = q.contiguous()
    out = torch.empty_like(q)
    acc = torch.empty(b, heads, splits, hd, device=q.device, dtype=torch.float32)
    ml = torch.empty(b, heads, splits, 2, device=q.device, dtype=torch.float32)
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    scale_log2 = float(scale) * math.log2(math.e)
    first = cascade[2].to(torch.int32).contiguous() if cascade is not None else lens  # (unread without)
    partial[(b, groups, splits)](q, cache_k, cache_v, table, lens, first, acc, ml, scale_log2, width,
                                 HEADS=heads, GROUPS=groups, R=r, R_PAD=max(MIN_ROWS, 1 << (r - 1).bit_length()),
                                 HD=hd, PAGE=page, BN=BLOCK_N, SPLITS=splits, HAS_FIRST=cascade is not None,
                                 num_warps=_warps(hd, max(MIN_ROWS, r)), num_stages=2)
    pacc, pml = acc, ml  # (unread without a cascade)
    if cascade is not None:
        members, plen = cascade[0].to(torch.int32).contiguous(), cascade[1].to(torch.int32).contiguous()
        n_max = cascade_members(r)
        if members.dim() != 2 or members.shape[1] != n_max or plen.shape != members.shape[:1]:
            raise ValueError(f"triton paged attention: cascade members must be [G, {n_max}] with plen [G], got "
                             f"{tuple(members.shape)} and {tuple(plen.shape)}")
        pacc, pml = torch.empty_like(acc), torch.empty_like(ml)
        prefix_partial[(members.shape[0], groups, splits)](
            q, cache_k, cache_v, table, members, plen, pacc, pml, scale_log2, width, HEADS=heads, GROUPS=groups,
            R=r, N_MAX=n_max, ROWS_PAD=max(MIN_ROWS, 1 << (n_max * r - 1).bit_length()), HD=hd, PAGE=page,
            BN=BLOCK_N, SPLITS=splits, num_warps=_warps(hd, n_max * r), num_stages=2)
    combine[(b * heads,)](acc, ml, pacc, pml, first, out, HEADS=heads, HD=hd, SPLITS=splits,
                          S_PAD=max(2, 1 << (splits - 1).bit_length()), HAS_PREFIX=cascade is not None,
                          num_warps=4)
    return out
