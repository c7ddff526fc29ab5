"""Policy losses (chosen by name from `POLICY_LOSSES`) and the entropy bonus.

Every loss takes token tensors `[batch, T]` of one micro-batch:
    log_prob       log pi_theta(a_t | s_t) of the sampled tokens (differentiable);
    old_log_prob   log-probs of the policy that sampled them (constants);
    advantages     per-token advantages (constants);
    mask           non-zero at the tokens the policy generated;
and the mini-batch's `LossDenominators`. It returns `(loss, diagnostics)`: `loss` is this
micro-batch's contribution to the mini-batch loss under `params.agg_mode` (sum contributions over
micro-batches, see `aggregation`), and `diagnostics` maps names to detached 0-dim tensors that are
token-mean contributions summing the same way:
    pg_loss            the loss, detached;
    pg_clipfrac        fraction of valid tokens whose surrogate was clipped (the clipped term won);
    pg_clipfrac_lower  fraction of valid tokens where the dual clip bound was active (A < 0);
    ppo_kl             approximate KL(pi_old || pi_theta), token mean of old_log_prob - log_prob.

The log-ratio log_prob - old_log_prob is clamped to [-20, 20] before exp: a token whose
probability collapsed must give a large but finite ratio, not inf * 0 = NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from verl_mcore.algo.aggregation import AGG_MODES, LossDenominators, aggregate_loss, masked_token_mean
from verl_mcore.utils.checks import same_device

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossParams",
    "compute_policy_loss",
    "entropy_bonus",
    "gspo_loss",
    "ppo_loss",
    "reinforce_loss",
    "should_compute_entropy",
    "truncated_is_weights",
]

LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio is clamped above only, at 10, as verl's compute_policy_loss_gspo does
# (the clamp also zeroes the gradient of a sequence past it).
GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class PolicyLossParams:
    """Hyper-parameters of the policy losses (from `actor.*` in the config).

    agg_mode: one of aggregation.AGG_MODES.
    clip_ratio_low, clip_ratio_high: the ratio is clipped to [1 - low, 1 + high] (PPO, GSPO).
    clip_ratio_c: dual-clip bound (PPO): for A < 0 the loss is at most -A * clip_ratio_c; > 1.
    """

    agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0

    def __post_init__(self):
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode={self.agg_mode!r} is not one of {list(AGG_MODES)}")
        if not (0 <= self.clip_ratio_low < 1) or self.clip_ratio_high < 0:
            raise ValueError(
                f"actor.clip_ratio_low={self.clip_ratio_low} must be in [0, 1) and "
                f"actor.clip_ratio_high={self.clip_ratio_high} must be >= 0"
            )
        if self.clip_ratio_c <= 1:
            raise ValueError(f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip lower bound)")


def _check_shapes(where: str, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor):
    same_device(where, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, mask=mask)
    if mask.dim() != 2 or not (log_prob.shape == old_log_prob.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"{where}: log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)}, "
            f"advantages {tuple(advantages.shape)} and mask {tuple(mask.shape)} must all be "
            "[batch, response_len]"
        )


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, params: PolicyLossParams) -> tuple[Tensor, Tensor]:
    """max(-A * r, -A * clip(r, 1 - low, 1 + high)) per token, and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    denoms: LossDenominators,
    params: PolicyLossParams,
    token_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual clip, per token:

        r   = exp(clamp(log_prob - old_log_prob, -20, 20))
        l1  = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        l   = min(l1, -A clip_ratio_c)   if A < 0   (dual clip: bounds the loss of a bad action
              l1                         otherwise   whose ratio exploded)
    aggregated with `params.agg_mode`. Shapes and diagnostics: see the module docstring.
    """
    _check_shapes("ppo_loss", log_prob, old_log_prob, advantages, mask)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    clip1, clipped = _clipped_surrogate(ratio, advantages, params)
    dual_bound = -advantages * params.clip_ratio_c
    negative = advantages < 0
    lower_clipped = negative & (clip1 > dual_bound)
    loss_mat = torch.where(negative, torch.minimum(clip1, dual_bound), clip1)
    loss = aggregate_loss(_weighted(loss_mat, token_weights), mask, params.agg_mode, denoms)
    return loss, {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_token_mean(clipped.to(loss_mat.dtype), mask, denoms),
        "pg_clipfrac_lower": masked_token_mean(lower_clipped.to(loss_mat.dtype), mask, denoms),
        "ppo_kl": masked_token_mean(-log_ratio, mask, denoms),
    }


def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    denoms: LossDenominators,
    params: PolicyLossParams,
    token_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level, length-normalised ratio.

        log s_i   = (1 / n_i) sum_{valid t} (log_prob_it - old_log_prob_it)
        log s_it  = sg(log s_i) + log_prob_it - sg(log_prob_it)    (value s_i, per-token gradient)
        l_it      = max(-A s_it, -A clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))
    (log s_it clamped above at 10, as verl does: beyond it the loss is constant and the gradient
    0; no lower clamp, exp of a very negative value is 0), no dual clip. The paper averages per sequence
    (agg_mode seq-mean-token-mean) with small clip ranges (about 3e-4 / 4e-4).
    """
    _check_shapes("gspo_loss", log_prob, old_log_prob, advantages, mask)
    valid = mask.bool()
    token_log_ratio = torch.where(valid, log_prob - old_log_prob, log_prob.new_zeros(()))
    seq_log_ratio = token_log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)
    log_ratio = seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()
    ratio = log_ratio.clamp(max=GSPO_LOG_RATIO_MAX).exp()
    loss_mat, clipped = _clipped_surrogate(ratio, advantages, params)
    loss = aggregate_loss(_weighted(loss_mat, token_weights), mask, params.agg_mode, denoms)
    return loss, {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_token_mean(clipped.to(loss_mat.dtype), mask, denoms),
        "pg_clipfrac_lower": masked_token_mean(torch.zeros_like(loss_mat), mask, denoms),
        "ppo_kl": masked_token_mean(-(log_prob - old_log_prob), mask, denoms),
    }


def reinforce_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    denoms: LossDenominators,
    params: PolicyLossParams,
    token_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient (REINFORCE; GPG): l_t = -A_t * log_prob_t, no ratio, no clipping.

    `old_log_prob` only feeds the ppo_kl diagnostic; the clip fractions are 0. The clip fields of
    `params` are not used.
    """
    _check_shapes("reinforce_loss", log_prob, old_log_prob, advantages, mask)
    loss = aggregate_loss(_weighted(-advantages * log_prob, token_weights), mask, params.agg_mode,
                          denoms)
    no_clip = torch.zeros_like(log_prob, dtype=loss.dtype)
    return loss, {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_token_mean(no_clip, mask, denoms),
        "pg_clipfrac_lower": masked_token_mean(no_clip, mask, denoms),
        "ppo_kl": masked_token_mean(old_log_prob - log_prob, mask, denoms),
    }


# name (actor.policy_loss) -> fn(log_prob, old_log_prob, advantages, mask, denoms, params,
#                               token_weights)
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_loss,
    "gspo": gspo_loss,
    "reinforce": reinforce_loss,
    "gpg": reinforce_loss,  # GPG's objective is plain -A * log pi; same function under its name
}


def compute_policy_loss(
    name: str,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    denoms: LossDenominators,
    params: PolicyLossParams,
    token_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dispatch to `POLICY_LOSSES[name]` (actor.policy_loss). token_weights: constant per-token
    factors of the loss (truncated_is_weights), None for 1."""
    try:
        fn = POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r} (actor.policy_loss); choose one of {sorted(POLICY_LOSSES)}") from None
    return fn(log_prob, old_log_prob, advantages, mask, denoms, params, token_weights)


def _weighted(loss_mat: Tensor, token_weights: Optional[Tensor]) -> Tensor:
    return loss_mat if token_weights is None else loss_mat * token_weights


def truncated_is_weights(old_log_prob: Tensor, engine_log_prob: Tensor, mask: Tensor,
                         cap: float) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights `[B, R]` of the trainer's policy against the engine's:

        w_t = min(exp(old_log_prob_t - engine_log_prob_t), cap)     (0 where mask is 0)

    old_log_prob: the actor's recomputed log-probs of the sampled tokens; engine_log_prob: the
    engine's own (the policy that actually sampled: older weights in one_step_off, another
    numeric path always). The policy loss multiplies each token's loss by w_t (a constant),
    which corrects the gradient for sampling from the engine's policy; the cap bounds the
    variance. This is verl's token-level truncated IS (`tis_imp_ratio_cap`; rollout_is with
    level=token, mode=truncate) and NeMo-RL's truncated importance sampling. The log-ratio is
    clamped to [-20, 20] as in the losses. Metrics: the mean weight and the fraction of tokens
    the cap truncated (`rollout/tis_clip_fraction`)."""
    same_device("truncated_is_weights", old_log_prob=old_log_prob,
                engine_log_prob=engine_log_prob, mask=mask)
    if cap <= 0:
        raise ValueError(f"rollout.tis_cap={cap} must be > 0")
    ratio = (old_log_prob - engine_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    valid = mask.bool()
    weights = torch.where(valid, ratio.clamp(max=cap), ratio.new_zeros(())).detach()
    count = max(int(valid.sum()), 1)
    return weights, {"rollout/tis_weight_mean": float(weights[valid].sum()) / count,
                     "rollout/tis_clip_fraction": int(((ratio > cap) & valid).sum()) / count}


# ---------------------------------------------------------------------------------------------
# Entropy bonus
# ---------------------------------------------------------------------------------------------


def should_compute_entropy(entropy_coeff: float, log_entropy: bool) -> bool:
    """Whether the forward pass must produce per-token entropies at all.

    Entropy needs a second reduction over the (vocab-parallel) logits; skip it unless it enters
    the loss (coefficient non-zero) or the caller wants it logged.
    """
    return entropy_coeff != 0 or log_entropy


def entropy_bonus(
    entropy: Optional[Tensor],
    mask: Tensor,
    denoms: LossDenominators,
    entropy_coeff: float,
    agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss term rewarding entropy: `-entropy_coeff * aggregate_loss(entropy, mask, agg_mode)`.

    `entropy, mask: [batch, T]`; add the returned term to the policy loss. With coefficient 0 the
    term is a constant 0 (no graph through the entropy); `entropy` may then be None (not computed,
    see `should_compute_entropy`). Diagnostics: {"entropy": token-mean contribution} when given.
    """
    metrics: dict[str, Tensor] = {}
    if entropy is not None:
        metrics["entropy"] = masked_token_mean(entropy, mask, denoms)
    if entropy_coeff == 0:
        return mask.new_zeros((), dtype=torch.float32), metrics
    if entropy is None:
        raise ValueError(
            f"entropy_bonus: actor.entropy_coeff={entropy_coeff} but no entropy was computed; "
            "request entropies when should_compute_entropy(...) is true"
        )
    return -entropy_coeff * aggregate_loss(entropy, mask, agg_mode, denoms), metrics
