"""Log-probabilities of target tokens and entropy from vocab-parallel logits.

`logprob_entropy(logits, target, tp_group, temperature, ...)` never gathers the vocabulary: each
tensor-parallel rank reduces its shard `[tokens, V_local]` to four numbers per token (local max,
sum of exps, exp-weighted sum of differences, the target logit if it lives there; see
`reference.py`), and two all-reduces over `tp_group` of those O(tokens) statistics give
log p(target) and the entropy. The backward writes grad-logits in one pass from the saved
per-token logZ and E[z], so no [tokens, V_local] temporary is kept between forward and backward.

The statistics and the backward come from the CUDA kernels (csrc/) when the extension is loaded and
the logits are on a GPU, otherwise from the pure-torch reference; which one is decided once, at
import. Both are torch.library custom ops (`verl_mcore::logprob_entropy`,
`verl_mcore::logprob_entropy_backward`) with fake implementations and registered autograd, so they
trace under torch.compile.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from verl_mcore.ops import reference
from verl_mcore.ops import _groups
from verl_mcore.ops._extension import extension

__all__ = ["logprob_entropy"]

def _stats_reference(logits: Tensor, target: Tensor, vocab_start: int, inv_temp: float) -> Tensor:
    return reference.local_stats(logits, target, vocab_start, inv_temp)


def _grad_reference(logits, target, vocab_start, inv_temp, logz, ez, g_logp, g_ent) -> Tensor:
    return reference.grad_logits(logits, target, vocab_start, inv_temp, logz, ez, g_logp, g_ent)


def _use_kernel(logits: Tensor) -> bool:
    return logits.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _stats_kernel(logits: Tensor, target: Tensor, vocab_start: int, inv_temp: float) -> Tensor:
    if not _use_kernel(logits):
        return _stats_reference(logits, target, vocab_start, inv_temp)
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    return extension().lpe_forward(logits, target.long(), vocab_start, inv_temp, stream)


def _grad_kernel(logits, target, vocab_start, inv_temp, logz, ez, g_logp, g_ent) -> Tensor:
    if not _use_kernel(logits):
        return _grad_reference(logits, target, vocab_start, inv_temp, logz, ez, g_logp, g_ent)
    f32 = [t.to(torch.float32).contiguous() for t in (logz, ez, g_logp, g_ent)]
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    return extension().lpe_backward(logits, target.long(), vocab_start, inv_temp, *f32, stream)


def _forward(stats_fn, logits, target, inv_temp, vocab_start, group_name):
    stats = stats_fn(logits, target, vocab_start, inv_temp)
    logp, entropy, logz, ez = reference.combine_stats(stats, _groups.lookup(group_name, "verl_mcore::logprob_entropy"))
    return logp, entropy, logz, ez


@torch.library.custom_op("verl_mcore::logprob_entropy", mutates_args=())
def _logprob_entropy_op(
    logits: Tensor, target: Tensor, inv_temp: float, vocab_start: int, group_name: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`logits [tokens, V_local], target [tokens]` -> `(logp, entropy, logZ, Ez)`, each `[tokens]`."""
    return _forward(_stats_reference, logits, target, inv_temp, vocab_start, group_name)


@torch.library.custom_op("verl_mcore::logprob_entropy_backward", mutates_args=())
def _logprob_entropy_backward_op(
    logits: Tensor,
    target: Tensor,
    inv_temp: float,
    vocab_start: int,
    logz: Tensor,
    ez: Tensor,
    g_logp: Tensor,
    g_ent: Tensor,
) -> Tensor:
    """grad-logits `[tokens, V_local]` (logits' dtype) from the saved per-token logZ and Ez."""
    return _grad_reference(logits, target, vocab_start, inv_temp, logz, ez, g_logp, g_ent)


if extension() is not None:
    # The one-time dispatch: GPU tensors go to the kernels from now on.
    @_logprob_entropy_op.register_kernel("cuda")
    def _logprob_entropy_cuda(logits, target, inv_temp, vocab_start, group_name):
        return _forward(_stats_kernel, logits, target, inv_temp, vocab_start, group_name)

    @_logprob_entropy_backward_op.register_kernel("cuda")
    def _logprob_entropy_backward_cuda(logits, target, inv_temp, vocab_start, logz, ez, g_logp, g_ent):
        return _grad_kernel(logits, target, vocab_start, inv_temp, logz, ez, g_logp, g_ent)


@_logprob_entropy_op.register_fake
def _(logits, target, inv_temp, vocab_start, group_name):
    out = logits.new_empty(logits.shape[0], dtype=reference.compute_dtype(logits))
    return out, torch.empty_like(out), torch.empty_like(out), torch.empty_like(out)


@_logprob_entropy_backward_op.register_fake
def _(logits, target, inv_temp, vocab_start, logz, ez, g_logp, g_ent):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, target, inv_temp, vocab_start, _ = inputs
    _, _, logz, ez = output
    ctx.save_for_backward(logits, target, logz, ez)
    ctx.inv_temp, ctx.vocab_start = inv_temp, vocab_start
    ctx.mark_non_differentiable(logz, ez)


def _backward(ctx, g_logp, g_ent, _g_logz, _g_ez):
    logits, target, logz, ez = ctx.saved_tensors
    if g_logp is None:
        g_logp = torch.zeros_like(logz)
    if g_ent is None:
        g_ent = torch.zeros_like(logz)
    grad = _logprob_entropy_backward_op(logits, target, ctx.inv_temp, ctx.vocab_start, logz, ez, g_logp, g_ent)
    return grad, None, None, None, None


torch.library.register_autograd("verl_mcore::logprob_entropy", _backward, setup_context=_setup_context)


def logprob_entropy(
    logits: Tensor,
    target: Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    vocab_start: Optional[int] = None,
    compute_entropy: bool = True,
) -> tuple[Tensor, Optional[Tensor]]:
    """Per-token log p(target) and entropy of softmax(logits / temperature) over the full vocabulary.

    Args:
        logits: `[..., V_local]` this rank's vocabulary shard (float32, bfloat16, float16 or
            float64), e.g. `[seq, batch, V_local]` straight from a vocab-parallel output layer.
        target: `[...]` integer token ids in the full vocabulary.
        tp_group: the tensor-parallel group the vocabulary is split over (None: unsplit).
        temperature: logits are divided by it (> 0), as the sampler did.
        vocab_start: first vocabulary id of this shard; default `rank(tp_group) * V_local`
            (megatron-core's equal split).
        compute_entropy: when False the entropy is not returned (None).

    Returns:
        `(logp, entropy)`, each `[...]`, float32 (float64 for float64 logits); both differentiable
        with respect to `logits`. A target outside every shard gives a meaningless log-prob: mask
        such tokens (padding, ignore-index) in the loss.
    """
    if not temperature > 0 or math.isinf(temperature):
        raise ValueError(f"logprob_entropy: temperature must be positive and finite, got {temperature}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logprob_entropy: target has shape {tuple(target.shape)} but logits {tuple(logits.shape)} "
            "need target to be logits.shape[:-1]"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"logprob_entropy: target must hold integer token ids, got {target.dtype}")
    vocab_local = logits.shape[-1]
    group_name = _groups.group_name(tp_group)
    if vocab_start is None:
        vocab_start = dist.get_rank(tp_group) * vocab_local if group_name else 0
    flat_logits = logits.reshape(-1, vocab_local)
    flat_target = target.reshape(-1).long()
    logp, entropy, _, _ = _logprob_entropy_op(flat_logits, flat_target, 1.0 / temperature, int(vocab_start), group_name)
    return logp.view(target.shape), (entropy.view(target.shape) if compute_entropy else None)
