"""Response-aligned log-probs, entropies and values from a micro-batch's model output.

The model's last stage returns, per position, vocab-parallel logits `[b, s, V_local]` (actor,
reference) or a scalar `[b, s, 1]` (critic). Both are flattened to the micro-batch's token order
(`input_ids.view(-1)`) and read at `MicroBatch.gather_index`, which points response token j of row
i at the position that predicts it. Log-probs and entropies come from `verl_mcore.ops`, which reduces
each TP rank's vocabulary shard to per-token statistics: the vocabulary is never gathered.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from verl_mcore import ops
from verl_mcore.engine.packing import MicroBatch


def _gather(per_token: Tensor, mb: MicroBatch) -> Tensor:
    """`per_token [N]` -> `[n, R]` at gather_index, 0 outside the responses."""
    out = per_token[mb.gather_index]
    return torch.where(mb.gather_valid, out, torch.zeros_like(out))


def response_logprobs(
    logits: Tensor,
    mb: MicroBatch,
    tp_group=None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    vocab_size: Optional[int] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """`logits [b, s, V_local]` -> `(logp [n, R], entropy [n, R] or None)`, float32.

    log p(target) and the entropy of softmax(logits / temperature) over the full vocabulary,
    differentiable w.r.t. the logits; `tp_group` is the group the vocabulary is split over.
    vocab_size: the real vocabulary; ids from it up to the padded size (megatron pads the
    embedding to a multiple of 128 × TP) get no probability, as in the samplers. Without this a
    tiny model's zero padding logits take real mass (36 real ids of 128: log-probs off by 1.27).
    """
    if logits.shape[:-1].numel() != mb.input_ids.numel():
        raise ValueError(
            f"response_logprobs: logits {tuple(logits.shape)} do not match the micro-batch's "
            f"input_ids {tuple(mb.input_ids.shape)}"
        )
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V_local]
    if vocab_size is not None:
        flat = mask_padded_vocab(flat, vocab_size, tp_group)
    logp, entropy = ops.logprob_entropy(
        flat, mb.targets.reshape(-1), tp_group=tp_group, temperature=temperature,
        compute_entropy=compute_entropy,
    )
    return _gather(logp, mb), (_gather(entropy, mb) if entropy is not None else None)


def mask_padded_vocab(flat: Tensor, vocab_size: int, tp_group=None) -> Tensor:
    """Push the logits `[..., V_local]` of padded vocabulary ids (>= vocab_size) to a large
    negative value: this TP rank's shard starts at id rank * V_local.

    Only shards that hold padding pay for a copy; the value is finite so that p * z stays 0 in
    the entropy (-inf would give 0 * -inf = NaN).
    """
    v_local = flat.shape[-1]
    rank = tp_group.rank() if tp_group is not None else 0
    real_here = vocab_size - rank * v_local
    if real_here >= v_local:
        return flat
    cols = torch.arange(v_local, device=flat.device)
    return flat.masked_fill(cols >= max(real_here, 0), -1e4)


def response_values(values: Tensor, mb: MicroBatch) -> Tensor:
    """Critic output `[b, s, 1]` (or `[b, s]`) -> `[n, R]` float32 values of the response states."""
    flat = values.reshape(-1) if values.shape[-1] == 1 or values.dim() == 2 else None
    if flat is None or flat.numel() != mb.input_ids.numel():
        raise ValueError(
            f"response_values: critic output {tuple(values.shape)} is not one value per token of "
            f"input_ids {tuple(mb.input_ids.shape)}"
        )
    return _gather(flat.float(), mb)
