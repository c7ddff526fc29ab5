"""Pure-torch reference of the vocab-parallel log-prob / entropy statistics and their gradient.

This is the CPU implementation of `verl_mcore.ops.logprob_entropy` and the oracle the CUDA kernels
(csrc/logprob_entropy.cu) are tested against; both compute exactly these quantities. (The GAE
reference is gae_reference.py.)

Per token i of a shard holding vocabulary ids [vocab_start, vocab_start + V_local), with
z = logits * inv_temp, the local statistics are

    m  = max_j z_ij,   s = sum_j exp(z_ij - m),   sd = sum_j exp(z_ij - m) * (z_ij - m),
    zt = z_i,target if the target lies in this shard else 0,

which combine across shards (`combine_stats`) into logZ = log sum exp z, log p(target) = zt - logZ
and entropy H = logZ - E_p[z] = log S - SD / S (relative to the global max, free of cancellation).
Work is done a block of tokens at a time so that extra memory stays O(block * V_local + tokens).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

# Elements per block of tokens processed at once (the fp32 temporaries are a few of these).
_BLOCK_ELEMENTS = 1 << 22
# Differences below this are clamped, so that -inf logits contribute exp = 0 and 0 * d = 0.
_MIN_DIFF = -1e30


def compute_dtype(logits: Tensor) -> torch.dtype:
    """float64 logits are computed in float64, everything else in float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _blocks(tokens: int, vocab: int):
    step = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
    for start in range(0, tokens, step):
        yield start, min(tokens, start + step)


def _target_in_shard(target: Tensor, vocab_start: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(local index clamped into the shard [tokens], whether the target is in the shard [tokens])."""
    local = target - vocab_start
    inside = (local >= 0) & (local < vocab)
    return local.clamp(0, max(vocab - 1, 0)), inside


def local_stats(logits: Tensor, target: Tensor, vocab_start: int, inv_temp: float) -> Tensor:
    """`logits [tokens, V_local], target [tokens] -> stats [tokens, 4]` = (m, s, sd, zt), see module doc."""
    tokens, vocab = logits.shape
    dtype = compute_dtype(logits)
    stats = torch.empty(tokens, 4, dtype=dtype, device=logits.device)
    local, inside = _target_in_shard(target, vocab_start, vocab)
    for lo, hi in _blocks(tokens, vocab):
        x = logits[lo:hi].to(dtype)  # [block, V_local]
        m = x.max(dim=-1).values  # [block], in logits units
        d = (x - m[:, None]).clamp_min(_MIN_DIFF)
        e = torch.exp(d * inv_temp)
        stats[lo:hi, 0] = m * inv_temp
        stats[lo:hi, 1] = e.sum(dim=-1)
        stats[lo:hi, 2] = (e * d).sum(dim=-1) * inv_temp
        xt = x.gather(1, local[lo:hi, None]).squeeze(1)
        stats[lo:hi, 3] = torch.where(inside[lo:hi], xt * inv_temp, torch.zeros_like(xt))
    return stats


def combine_stats(stats: Tensor, group: Optional[dist.ProcessGroup]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Local `stats [tokens, 4]` -> global `(logp, entropy, logZ, Ez)`, each `[tokens]`.

    Over `group` (the tensor-parallel group holding the vocabulary shards): one MAX all-reduce of
    m, then one SUM all-reduce of (s, sd, zt) rescaled to the global max. O(tokens) traffic.
    """
    m, s, sd, zt = stats.unbind(dim=-1)
    if group is not None and dist.get_world_size(group) > 1:
        big_m = m.clone()
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
        shift = m - big_m  # <= 0; -inf (or nan for an all -inf shard) where the shard is empty
        empty = s == 0
        scale = torch.where(empty, torch.zeros_like(s), torch.exp(shift))
        moved = torch.where(empty, torch.zeros_like(s), scale * (sd + shift * s))
        summed = torch.stack([scale * s, moved, zt], dim=-1)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        m, (s, sd, zt) = big_m, summed.unbind(dim=-1)
    log_s = torch.log(s)
    mean_shift = sd / s  # E_p[z] - m
    logz = m + log_s
    return zt - logz, log_s - mean_shift, logz, m + mean_shift


def grad_logits(
    logits: Tensor,
    target: Tensor,
    vocab_start: int,
    inv_temp: float,
    logz: Tensor,
    ez: Tensor,
    g_logp: Tensor,
    g_ent: Tensor,
) -> Tensor:
    """d(sum g_logp*logp + g_ent*entropy)/d logits, `[tokens, V_local]` in the logits' dtype.

    grad_ij = inv_temp * (g_logp_i * (1[j == target_i] - p_ij) - g_ent_i * p_ij * (z_ij - Ez_i)),
    p_ij = exp(z_ij - logZ_i): only per-token statistics are needed, not the forward's temporaries.
    """
    tokens, vocab = logits.shape
    dtype = compute_dtype(logits)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    local, inside = _target_in_shard(target, vocab_start, vocab)
    glp = g_logp.to(dtype) * inv_temp
    gh = g_ent.to(dtype) * inv_temp
    logz, ez = logz.to(dtype), ez.to(dtype)
    for lo, hi in _blocks(tokens, vocab):
        z = logits[lo:hi].to(dtype) * inv_temp  # [block, V_local]
        p = torch.exp(z - logz[lo:hi, None])
        g = p * (-glp[lo:hi, None] - gh[lo:hi, None] * (z - ez[lo:hi, None]))
        onehot = torch.where(inside[lo:hi], glp[lo:hi], torch.zeros_like(glp[lo:hi]))
        g.scatter_add_(1, local[lo:hi, None], onehot[:, None])
        grad[lo:hi] = g.to(logits.dtype)
    return grad
