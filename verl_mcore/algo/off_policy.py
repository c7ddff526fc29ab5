"""Per-token off-policy corrections: the engine sampled with its policy (pi_engine, the behaviour
policy: older weights in one_step_off, another numeric path always), the loss is built on the
actor's recomputed log-probs (pi_old, the proximal policy), and these correct for the gap.

Every function takes response-aligned `[B, R]` tensors of one step's batch:
    old_log_prob     log pi_old of the sampled tokens (the old-log-prob pass)
    engine_log_prob  log pi_engine of the same tokens (the engine's own, Rollout.engine_log_probs)
    mask             the response (loss) mask, non-zero at the tokens that train
and works on the token log-ratio

    log rho_t = clamp(log pi_old_t - log pi_engine_t, -20, 20)

(the clamp is verl's SAFETY_BOUND and the losses' LOG_RATIO_CLAMP: a token whose probability
collapsed gives a huge finite ratio, never inf).

    correction            config                        effect on the actor's loss
    truncated IS          rollout.tis_cap=C             each token's loss times min(rho_t, C)
                          (policy_loss.truncated_is_weights; verl rollout_is=token, threshold C)
    masked IS / IcePop    rollout.correction.token_mask=k
                          tokens with rho_t outside [1/k, k] leave the loss and its normaliser
                          (verl rollout_rs=token_k1 with threshold k; before, rollout_rs=token)
    sequence mask         rollout.correction.seq_mask=k
                          samples whose geometric-mean ratio exp(mean_t log rho_t) (over their
                          valid tokens) is outside [1/k, k] leave the loss and its normaliser
                          (verl rollout_rs=seq_mean_k1; before, rollout_rs=geometric)
    decoupled PPO         rollout.correction.decoupled=true [, decoupled_cap=C]
                          the PPO clip around pi_old (the proximal policy) as always, each
                          token's loss times rho_t = pi_old / pi_engine, and with a cap, 0 where
                          rho_t > C (AReaL's ppo_actor_loss_fn with behav_imp_weight_cap)

How they reach the loss. Weights become `TrainBatch.is_weights`, which the policy loss multiplies
into each token's loss (policy_loss `token_weights`). Masks become the response mask of the batch
the actor's update trains on, so a rejected token is out of the policy loss, the entropy bonus
and the KL loss alike, and out of their denominators (N_tok, and N_seq once a sample has no valid
token left: algo/aggregation.py) in every actor.loss_agg_mode, on every micro-batch and DP rank.
The masks and the weights are computed from the batch's response mask independently and combine
(the weights of rejected tokens no longer matter): token_mask=k with tis_cap=k is IcePop as its
paper states it (the kept tokens weighted by their ratio, which the cap then never truncates),
verl's "token IS + token RS".

Where they differ from verl's rollout_corr (verl/trainer/ppo/rollout_corr_helper.py):
  - bounds are symmetric, [1/k, k]. verl also takes "lower_upper" thresholds, whose meaning for
    its k1 options is on pi_engine / pi_old (newer verl) or pi_old / pi_engine (older verl): an
    asymmetric bound would change meaning with the version, a symmetric one does not;
  - the advantages, rewards, the critic and the batch metrics keep the full response mask. verl's
    trainer hands the rejected mask to the advantage estimator too; GRPO-family advantages at the
    kept tokens are the same, GAE's returns are not (the critic here learns every token);
  - the geometric mean is taken over the clamped token log-ratios (as newer verl's seq_mean_k1;
    older verl clamped the mean instead: the two differ only where a token's |log rho| > 20);
  - not offered: sequence-level IS weights, verl's IcePop flavour of rollout_is (weights zeroed
    outside the bounds with the tokens kept in the normaliser: that is decoupled_cap's rule for
    the upper side), the per-token veto, batch-normalised weights, bypass mode, the k2/k3 and
    binary-KL rejection statistics;
  - metric names: `rollout/...`, beside the existing rollout/tis_* (verl's rollout_corr/...).

AReaL's decoupled objective differs from rollout.tis_cap only in the cap: AReaL zeroes a weight
above it, keeping the token in the normaliser (its loss_mask_count), where truncation keeps the
token at weight C. AReaL does not clamp the log-ratio (here: 20, a weight of 4.9e8).

Metrics (Python floats; over the valid tokens of `mask`, or the samples with one):
    rollout/ratio_mean, _max, _min       rho_t, whenever a rollout.correction option is on
    rollout/token_mask_fraction          tokens token_mask rejected
    rollout/token_mask_seq_fraction      samples with at least one token it rejected
    rollout/seq_mask_fraction            samples seq_mask rejected
    rollout/seq_mask_token_fraction      tokens in them
    rollout/seq_ratio_mean, _max, _min   the samples' geometric-mean ratios
    rollout/masked_token_fraction        tokens out of the loss after both masks
    rollout/decoupled_weight_mean, _max  the decoupled weights (capped ones count as 0)
    rollout/decoupled_capped_fraction    tokens decoupled_cap set to 0
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from verl_mcore.algo.policy_loss import LOG_RATIO_CLAMP
from verl_mcore.utils.checks import same_device

__all__ = ["OffPolicyCorrection", "correct_off_policy", "decoupled_weights", "log_ratio",
           "sequence_ratio_mask", "token_ratio_mask"]


def _check(where: str, old_log_prob: Tensor, engine_log_prob: Tensor, mask: Tensor) -> None:
    same_device(where, old_log_prob=old_log_prob, engine_log_prob=engine_log_prob, mask=mask)
    if mask.dim() != 2 or not (old_log_prob.shape == engine_log_prob.shape == mask.shape):
        raise ValueError(f"{where}: old_log_prob {tuple(old_log_prob.shape)}, engine_log_prob "
                         f"{tuple(engine_log_prob.shape)} and mask {tuple(mask.shape)} must all be "
                         "[batch, response_len]")


def _bound(key: str, k: float) -> float:
    """log k of a [1/k, k] bound, checked (k > 1: k = 1 would keep only exactly equal tokens)."""
    if not k > 1 or not math.isfinite(k):
        raise ValueError(f"{key}={k} must be a finite number > 1 (tokens kept within [1/k, k])")
    return math.log(k)


def log_ratio(old_log_prob: Tensor, engine_log_prob: Tensor, mask: Tensor) -> Tensor:
    """`[B, R]` log rho_t = clamp(old_log_prob - engine_log_prob, -20, 20), 0 where mask is 0."""
    _check("log_ratio", old_log_prob, engine_log_prob, mask)
    lr = (old_log_prob - engine_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask.bool(), lr, lr.new_zeros(())).detach()


def _valid_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Mean of `x` over `valid` (bool, same shape); 0 when nothing is valid."""
    return torch.where(valid, x, x.new_zeros(())).sum() / valid.sum().clamp(min=1)


def _valid_max(x: Tensor, valid: Tensor) -> Tensor:
    """Max of `x` over `valid`; 0 when nothing is valid (no host sync to find out)."""
    m = torch.where(valid, x, x.new_full((), -math.inf)).max()
    return torch.where(valid.any(), m, m.new_zeros(()))


def _valid_min(x: Tensor, valid: Tensor) -> Tensor:
    m = torch.where(valid, x, x.new_full((), math.inf)).min()
    return torch.where(valid.any(), m, m.new_zeros(()))


def token_ratio_mask(old_log_prob: Tensor, engine_log_prob: Tensor, mask: Tensor,
                     k: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked IS / IcePop: `mask` `[B, R]` (same dtype) with the tokens whose rho_t lies outside
    [1/k, k] zeroed (bounds included in the kept range), and its metrics as 0-dim tensors:
    rollout/token_mask_fraction (valid tokens rejected) and rollout/token_mask_seq_fraction
    (samples with a valid token, that lost at least one)."""
    log_k = _bound("rollout.correction.token_mask", k)
    lr = log_ratio(old_log_prob, engine_log_prob, mask)
    valid = mask.bool()
    rejected = valid & (lr.abs() > log_k)
    rows = valid.any(-1)
    return mask * (~rejected).to(mask.dtype), {
        "rollout/token_mask_fraction": _valid_mean(rejected.double(), valid),
        "rollout/token_mask_seq_fraction": _valid_mean(rejected.any(-1).double(), rows),
    }


def sequence_ratio_mask(old_log_prob: Tensor, engine_log_prob: Tensor, mask: Tensor,
                        k: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence mask by the geometric-mean ratio: `mask` `[B, R]` (same dtype) with every token
    of the samples whose exp(mean over valid t of log rho_t) lies outside [1/k, k] zeroed, and
    its metrics as 0-dim tensors: rollout/seq_mask_fraction (samples with a valid token
    rejected), rollout/seq_mask_token_fraction (valid tokens in them), rollout/seq_ratio_mean,
    _max, _min (the geometric-mean ratios of the samples with a valid token). A sample with no
    valid token has ratio 1 and is kept (it trains nothing anyway)."""
    log_k = _bound("rollout.correction.seq_mask", k)
    lr = log_ratio(old_log_prob, engine_log_prob, mask)
    valid = mask.bool()
    rows = valid.any(-1)  # [B]
    seq_lr = lr.sum(-1) / valid.sum(-1).clamp(min=1)  # [B] mean log-ratio over valid tokens
    rejected = rows & (seq_lr.abs() > log_k)  # [B]
    seq_ratio = seq_lr.exp()
    return mask * (~rejected).to(mask.dtype)[:, None], {
        "rollout/seq_mask_fraction": _valid_mean(rejected.double(), rows),
        "rollout/seq_mask_token_fraction": _valid_mean(
            rejected[:, None].expand_as(valid).double(), valid),
        "rollout/seq_ratio_mean": _valid_mean(seq_ratio, rows),
        "rollout/seq_ratio_max": _valid_max(seq_ratio, rows),
        "rollout/seq_ratio_min": _valid_min(seq_ratio, rows),
    }


def decoupled_weights(old_log_prob: Tensor, engine_log_prob: Tensor, mask: Tensor,
                      cap: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled-PPO importance weights `[B, R]` (detached): rho_t = pi_old / pi_engine
    at valid tokens, 0 where rho_t > cap (AReaL's behav_imp_weight_cap; the token stays in the
    loss mask, so in the normaliser) and outside the mask. Metrics as 0-dim tensors:
    rollout/decoupled_weight_mean, _max (over valid tokens, capped ones as 0) and
    rollout/decoupled_capped_fraction."""
    if cap is not None and not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"rollout.correction.decoupled_cap={cap} must be a finite number > 0")
    lr = log_ratio(old_log_prob, engine_log_prob, mask)
    valid = mask.bool()
    ratio = lr.exp()
    capped = valid & (ratio > cap) if cap is not None else torch.zeros_like(valid)
    weights = torch.where(valid & ~capped, ratio, ratio.new_zeros(()))
    return weights, {
        "rollout/decoupled_weight_mean": _valid_mean(weights, valid),
        "rollout/decoupled_weight_max": _valid_max(weights, valid),
        "rollout/decoupled_capped_fraction": _valid_mean(capped.double(), valid),
    }


@dataclass(frozen=True)
class OffPolicyCorrection:
    """What `correct_off_policy` decided for one batch.

    weights    [B, R] per-token factors of the policy loss (TrainBatch.is_weights), or None
    loss_mask  [B, R] the actor's response mask with rejected tokens zeroed, or None (no mask)
    metrics    name -> float (module docstring)
    """

    weights: Optional[Tensor]
    loss_mask: Optional[Tensor]
    metrics: dict[str, float]


def correct_off_policy(old_log_prob: Tensor, engine_log_prob: Tensor, mask: Tensor, *,
                       token_mask: Optional[float] = None, seq_mask: Optional[float] = None,
                       decoupled: bool = False,
                       decoupled_cap: Optional[float] = None) -> OffPolicyCorrection:
    """The rollout.correction options on one batch (`[B, R]` inputs, the module docstring's):
    the masks of token_mask and seq_mask, both from `mask`, multiplied into one loss mask; the
    decoupled weights; their metrics and the ratio's (rollout/ratio_mean, _max, _min) read back
    from the device once."""
    _check("correct_off_policy", old_log_prob, engine_log_prob, mask)
    valid = mask.bool()
    ratio = log_ratio(old_log_prob, engine_log_prob, mask).exp()
    stats: dict[str, Tensor] = {"rollout/ratio_mean": _valid_mean(ratio, valid),
                                "rollout/ratio_max": _valid_max(ratio, valid),
                                "rollout/ratio_min": _valid_min(ratio, valid)}
    loss_mask = None
    for k, fn in ((token_mask, token_ratio_mask), (seq_mask, sequence_ratio_mask)):
        if k is not None:
            kept, m = fn(old_log_prob, engine_log_prob, mask, k)
            loss_mask = kept if loss_mask is None else loss_mask * kept
            stats.update(m)
    if loss_mask is not None:
        stats["rollout/masked_token_fraction"] = _valid_mean((~loss_mask.bool()).double(), valid)
    weights = None
    if decoupled:
        weights, m = decoupled_weights(old_log_prob, engine_log_prob, mask, decoupled_cap)
        stats.update(m)
    elif decoupled_cap is not None:
        raise ValueError(f"rollout.correction.decoupled_cap={decoupled_cap} without "
                         "rollout.correction.decoupled=true caps nothing")
    values = torch.stack([v.detach().double() for v in stats.values()]).tolist()  # one sync
    return OffPolicyCorrection(weights, loss_mask, dict(zip(stats, values)))
