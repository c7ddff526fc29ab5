"""Loss aggregation with global denominators, so a split batch sums to the unsplit result.

A mini-batch (one optimizer step) is cut into micro-batches on every data-parallel (DP) rank.
Each micro-batch returns a *contribution*; the mini-batch loss is the plain SUM of contributions
over all micro-batches of all DP ranks. To make that sum, and the gradients it produces, the same
however the mini-batch was split, every denominator is a property of the whole mini-batch on all
DP ranks (`LossDenominators`, computed once per mini-batch by `global_denominators`), never of the
micro-batch at hand.

Notation for one mini-batch: sequences i over all micro-batches and DP ranks, valid tokens t of
sequence i (mask non-zero), l_it the per-token loss, n_i the valid-token count of sequence i,
N_tok = sum_i n_i, N_seq = number of sequences with n_i > 0 (rows with no valid token, such as
padding rows that balance micro-batches, count for nothing), L = `norm_len`.

    mode                      mini-batch loss                        a micro-batch contributes
    token-mean                sum_i sum_t l_it / N_tok               sum over its tokens / N_tok
    seq-mean-token-sum        sum_i (sum_t l_it) / N_seq             sum over its tokens / N_seq
    seq-mean-token-mean       sum_i (sum_t l_it / n_i) / N_seq       sum over its rows of
                                                                     (row mean) / N_seq
    seq-mean-token-sum-norm   sum_i (sum_t l_it / L) / N_seq         sum over its tokens / (N_seq*L)
                              (Dr.GRPO: a constant length L, by default the longest padded
                              response length over the DP group, better the configured maximum)

So token-mean weighs every token of the mini-batch equally; the seq-mean-* modes weigh sequences
equally (a sequence is never split between micro-batches or ranks, so n_i is local). A mini-batch
with no valid token at all contributes 0 (denominators are clamped to at least 1).

Across DP ranks: the contributions are designed for gradients reduced with SUM over the DP group
(`dp_reduce="sum"`, the default): sum of per-rank gradients = gradient of the mini-batch loss.
If the gradient reduction AVERAGES over the DP group instead (megatron-core's DDP default), build
the denominators with `dp_reduce="mean"`: they are divided by the DP world size, so every
contribution, and every gradient, is multiplied by it, and the averaged gradient is again exactly
the mini-batch gradient. Reduce logged losses and diagnostics over DP the same way as gradients.
Across micro-batches the rule is always SUM: a pipeline schedule that divides each micro-batch loss
by the number of micro-batches must be compensated by the caller.

Layout: every row of `loss_mat`/`mask` is ONE sequence (padded `[batch, T]`). A packed (THD)
micro-batch must be unpacked to rows before aggregation; passed as one packed row, the seq-mean
modes would silently treat it as a single sequence. Context parallelism (a sequence split over CP
ranks) is not covered: n_i and N_seq would need a reduction over the CP group first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from verl_mcore.utils.checks import same_device

__all__ = ["AGG_MODES", "LossDenominators", "aggregate_loss", "global_denominators", "masked_token_mean"]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossDenominators:
    """Mini-batch-wide denominators (see the module docstring), equal on every rank and micro-batch.

    num_tokens: N_tok, valid tokens of the mini-batch over all DP ranks (divided by the DP size
        when built with dp_reduce="mean").
    num_seqs:   N_seq, sequences with at least one valid token (same scaling).
    norm_len:   L, the constant length of seq-mean-token-sum-norm (never scaled).
    """

    num_tokens: float
    num_seqs: float
    norm_len: float

    def __post_init__(self):
        if self.norm_len <= 0:
            raise ValueError(f"LossDenominators: norm_len must be positive, got {self.norm_len}")

    @classmethod
    def of(cls, mask: Tensor, norm_len: Optional[float] = None) -> "LossDenominators":
        """Denominators of an unsplit batch `mask [batch, T]` on one rank (no communication)."""
        return global_denominators(mask, norm_len=norm_len)


def global_denominators(
    mask: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    norm_len: Optional[float] = None,
    dp_reduce: Literal["sum", "mean"] = "sum",
) -> LossDenominators:
    """Denominators of a whole mini-batch from this rank's part of it.

    mask: `[batch, T]`, this rank's rows of the mini-batch (all its micro-batches, stacked or
        padded to one T; padding rows with no valid token are allowed and not counted).
    group: the data-parallel process group; None = this rank holds the whole mini-batch.
    norm_len: L for seq-mean-token-sum-norm; default the largest `T` over the group (pass the
        configured maximum response length to make it independent of padding).
    dp_reduce: how the caller reduces gradients over `group` ("sum" or "mean", see module doc).

    Collective over `group` when given (every rank must call it, once per mini-batch).
    """
    if mask.dim() != 2:
        raise ValueError(f"global_denominators: mask must be [batch, response_len], got {tuple(mask.shape)}")
    if dp_reduce not in ("sum", "mean"):
        raise ValueError(f"global_denominators: dp_reduce must be 'sum' or 'mean', got {dp_reduce!r}")
    valid = mask.bool()
    counts = torch.stack([valid.sum(), valid.any(dim=-1).sum()]).to(torch.float64)
    length = torch.tensor([float(mask.shape[-1])], dtype=torch.float64)
    if group is not None:
        # gloo and NCCL both reduce float64; keep the counts exact beyond 2**24 tokens.
        counts = counts.to(mask.device)
        length = length.to(mask.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    num_tokens, num_seqs = (float(c) for c in counts.cpu())
    if dp_reduce == "mean" and group is not None:
        scale = float(dist.get_world_size(group))
        num_tokens, num_seqs = num_tokens / scale, num_seqs / scale
    return LossDenominators(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_len=float(norm_len) if norm_len is not None else float(length.item()),
    )


def _per_row_sums(loss_mat: Tensor, valid: Tensor) -> Tensor:
    # where, not multiply: a NaN/inf loss at a masked position must not reach the result.
    return torch.where(valid, loss_mat, loss_mat.new_zeros(())).sum(dim=-1)


def aggregate_loss(
    loss_mat: Tensor, mask: Tensor, mode: str, denoms: LossDenominators
) -> Tensor:
    """Contribution of one micro-batch to the mini-batch loss under `mode` (a key of AGG_MODES).

    loss_mat: `[batch, T]` per-token losses; mask: `[batch, T]`, non-zero at valid tokens.
    Returns a 0-dim tensor (differentiable w.r.t. loss_mat). The exact formulas are in the module
    docstring; summing the contributions of all micro-batches (and DP ranks) gives the mini-batch
    loss. With `denoms = LossDenominators.of(mask)` the result is the plain loss of this batch.
    """
    same_device("aggregate_loss", loss_mat=loss_mat, mask=mask)
    if loss_mat.shape != mask.shape or mask.dim() != 2:
        raise ValueError(
            f"aggregate_loss: loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must be "
            "the same [batch, response_len] shape"
        )
    valid = mask.bool()
    # An empty mini-batch has only zero sums; dividing them by 1 keeps the result 0, not NaN.
    num_tokens = denoms.num_tokens if denoms.num_tokens > 0 else 1.0
    num_seqs = denoms.num_seqs if denoms.num_seqs > 0 else 1.0
    if mode == "token-mean":
        return _per_row_sums(loss_mat, valid).sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return _per_row_sums(loss_mat, valid).sum() / num_seqs
    if mode == "seq-mean-token-mean":
        row_tokens = valid.sum(dim=-1).clamp(min=1).to(loss_mat.dtype)
        return (_per_row_sums(loss_mat, valid) / row_tokens).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return _per_row_sums(loss_mat, valid).sum() / (num_seqs * denoms.norm_len)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {list(AGG_MODES)}")


def masked_token_mean(x: Tensor, mask: Tensor, denoms: LossDenominators) -> Tensor:
    """Token-mean contribution of a diagnostic (clip fraction, approx KL, entropy), detached.

    `x, mask: [batch, T] -> 0-dim`. Like every contribution, it sums over micro-batches (and over
    DP ranks as the gradients are reduced) to the mini-batch's token mean.
    """
    x = x.detach()
    if not x.dtype.is_floating_point:
        x = x.to(torch.float32)
    return aggregate_loss(x, mask, "token-mean", denoms)
