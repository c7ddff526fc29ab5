"""Clipped value loss of the critic."""
from __future__ import annotations

import torch
from torch import Tensor

from verl_mcore.algo.aggregation import LossDenominators, aggregate_loss, masked_token_mean
from verl_mcore.utils.checks import same_device

__all__ = ["value_loss"]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    denoms: LossDenominators,
    clip_eps: float,
    agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO value loss with the prediction clipped around the rollout-time value, per token:

        v_clip = clamp(values, old_values - clip_eps, old_values + clip_eps)
        l      = 0.5 * max((values - returns)^2, (v_clip - returns)^2)

    `values` (differentiable), `old_values`, `returns`, `mask`: `[batch, T]`, computed in float32
    at least (bf16 critic outputs are upcast; float64 stays float64); `clip_eps` is critic.cliprange_value. Returns the
    micro-batch contribution under `agg_mode` (see aggregation) and detached diagnostics
    {"vf_loss", "vf_clipfrac", "vpred_mean"}, each a token-mean contribution. vf_clipfrac is
    verl's: the share of valid tokens where the clipped term is the larger one, which needs the
    clip to have changed the value. The clamp form (verl's clip_by_value) keeps a value inside
    the range exactly as it is; `old + clamp(values - old, -eps, eps)` does not in floating point
    (about 13% of in-range tokens came out an ulp off and counted as clipped).
    """
    same_device("value_loss", values=values, old_values=old_values, returns=returns, mask=mask)
    if mask.dim() != 2 or not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"value_loss: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, "
            f"returns {tuple(returns.shape)} and mask {tuple(mask.shape)} must all be [batch, response_len]"
        )
    if clip_eps < 0:
        raise ValueError(f"value_loss: clip_eps (critic.cliprange_value) must be >= 0, got {clip_eps}")
    dtype = torch.promote_types(values.dtype, torch.float32)  # float32 at least
    values, old_values, returns = values.to(dtype), old_values.to(dtype), returns.to(dtype)
    v_clipped = values.clamp(old_values - clip_eps, old_values + clip_eps)
    unclipped = (values - returns).square()
    clipped = (v_clipped - returns).square()
    loss_mat = 0.5 * (unclipped.maximum(clipped))
    loss = aggregate_loss(loss_mat, mask, agg_mode, denoms)
    return loss, {
        "vf_loss": loss.detach(),
        "vf_clipfrac": masked_token_mean((clipped > unclipped).to(loss_mat.dtype), mask, denoms),
        "vpred_mean": masked_token_mean(values, mask, denoms),
    }
