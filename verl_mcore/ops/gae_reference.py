"""The torch reference of `verl_mcore.ops.gae` and `gae_whitened`: GAE over response tokens and
masked whitening, the CPU implementation and the oracle of the CUDA kernel (csrc/gae.cu).

The advantage estimators (`verl_mcore.algo.advantages`, which exports both functions under the
same names) reach GAE through `verl_mcore.ops`: one dispatch, kernel or reference. The
conventions are those of `algo/advantages.py`'s module docstring: token tensors `[batch, T]`,
masked positions never read and 0 in every result, computation in float32 at least.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from verl_mcore.utils.checks import same_device

__all__ = ["check_token_shapes", "compute_dtype", "gae", "masked_whiten"]


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32 at least; float64 inputs stay float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_token_shapes(where: str, mask: Tensor, **tensors: Tensor) -> None:
    """`tensors` are `[batch, response_len]` like `mask`, on its device; ValueError naming `where`."""
    same_device(where, mask=mask, **tensors)
    if mask.dim() != 2:
        raise ValueError(f"{where}: mask must be [batch, response_len], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}; "
                "both must be [batch, response_len]"
            )


@torch.no_grad()
def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over response tokens, skipping masked positions.

    Args:
        rewards: `[batch, T]` token rewards (e.g. the outcome score on the last valid token minus a
            per-token KL penalty).
        values:  `[batch, T]` critic values V_t of the state before token t.
        mask:    `[batch, T]` non-zero at valid tokens.
        gamma, lam: discount and GAE lambda (floats).

    Returns:
        `(advantages, returns)`, both `[batch, T]`, not whitened.

    Exact definition (the CUDA kernel behind `verl_mcore.ops.gae` implements this same recurrence):
    each row is processed independently, from t = T-1 down to 0, with a carried state
    `(next_value, next_adv)` that starts at `(0, 0)` past the end of the row:

        if mask[t]:
            delta_t   = rewards[t] + gamma * next_value - values[t]
            A_t       = delta_t + gamma * lam * next_adv
            R_t       = A_t + values[t]
            next_value, next_adv = values[t], A_t
        else:                      # padding or a hole (tool/observation tokens)
            A_t = 0;  R_t = 0      # state carried through unchanged
            (rewards[t] and values[t] are not read)

    So V_next and A_next are those of the next *valid* position of the row (0 after its last valid
    token), and a hole inside a response is transparent: the tokens on either side of it are
    chained as if it were not there, without extra discounting for its length. A row with no valid
    token gives zeros. With gamma = lam = 1 and a single reward r on the last valid token,
    A_t = r - V_t at every valid t.
    """
    check_token_shapes("gae", mask, rewards=rewards, values=values)
    dtype = compute_dtype(rewards, values)
    r = rewards.to(dtype)
    v = values.to(dtype)
    valid = mask.bool()
    batch, length = r.shape
    advantages = torch.zeros_like(r)
    next_value = r.new_zeros(batch)
    next_adv = r.new_zeros(batch)
    zero = r.new_zeros(())
    for t in range(length - 1, -1, -1):
        m = valid[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + (gamma * lam) * next_adv
        # torch.where (not multiplication) so NaN/inf at masked positions cannot leak through.
        advantages[:, t] = torch.where(m, adv_t, zero)
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
    returns = torch.where(valid, advantages + torch.where(valid, v, zero), zero)
    return advantages, returns


@torch.no_grad()
def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """Normalise `x` to mean 0 and standard deviation 1 over its valid tokens.

    `x, mask: [batch, T] -> [batch, T]` (any matching shapes work). mean = masked mean;
    var = unbiased masked variance (divides by n - 1); result = (x - mean) / sqrt(var + eps), plus
    `mean` again when `shift_mean=False` (scale only). Masked positions are 0 in the result.
    With `group`, n, the sum and the sum of squared deviations are all-reduced over its ranks, so
    every rank whitens with the statistics of the whole data-parallel batch.

    Raises ValueError when fewer than 2 valid tokens exist (over all ranks of `group`): the
    variance is undefined. If all valid values are equal the result is 0 there (finite).
    """
    same_device("masked_whiten", x=x, mask=mask)
    if x.shape != mask.shape:
        raise ValueError(f"masked_whiten: x has shape {tuple(x.shape)} but mask has {tuple(mask.shape)}")
    dtype = compute_dtype(x)
    xv = x.to(dtype)
    valid = mask.bool()
    zero = xv.new_zeros(())
    # Statistics in float64: token counts beyond 2**24 stay exact and large batches sum stably.
    stats = torch.stack([valid.sum().double(), torch.where(valid, xv, zero).double().sum()])
    if group is not None:
        dist.all_reduce(stats, group=group)
    n = int(stats[0].item())
    if n < 2:
        where = f" over {dist.get_world_size(group)} ranks" if group is not None else ""
        raise ValueError(
            f"masked_whiten: needs at least 2 valid tokens to estimate a variance, found {n}{where}; "
            "check the response mask (is every response empty?) or disable whitening"
        )
    mean = stats[1] / n
    sq = torch.where(valid, (xv.double() - mean) ** 2, zero.double()).sum()
    if group is not None:
        dist.all_reduce(sq, group=group)
    var = sq / (n - 1)
    mean, inv_std = mean.to(dtype), torch.rsqrt(var + eps).to(dtype)
    out = (xv - mean) * inv_std
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, zero)
