"""KL penalties between the policy and the reference model, and the KL coefficient controllers.

A penalty is a per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens,
`[batch, T]` each. It is used in one of two places:
- in the reward (`algorithm.use_kl_in_reward`): `apply_kl_penalty` subtracts beta * kl from the
  token rewards before the advantages, with beta from a controller (fixed or adaptive);
- in the actor loss (`actor.use_kl_loss`): `kl_loss` aggregates it like any other loss term and
  the caller adds `kl_loss_coef * loss`; gradients flow through `logp`.

Estimators, with log r = logp - ref_logp (Schulman, "Approximating KL Divergence"):
    k1  = log r                                  unbiased, can be negative
    abs = |log r|
    k2  = 0.5 * (log r)^2
    k3  = exp(-log r) - 1 + log r   ("low_var_kl"): unbiased, >= 0, low variance; log r is clamped
          to [-20, 20] before exp and the result to [-10, 10] so one wild token cannot blow up.

verl's names are accepted with verl's meaning, so a verl config runs unchanged: "kl" is k1 (verl's
default), "mse" is k2, and a name ending in "+" ("k3+", "low_var_kl+", "k1+", ...) takes its value
from the named estimator and its gradient from k2 (a straight-through estimate: k1's and k3's
expected gradients are not KL's, k2's is). Without a gradient (the in-reward KL) "+" changes nothing.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from verl_mcore.algo.aggregation import LossDenominators, aggregate_loss
from verl_mcore.utils.checks import same_device

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KL_PENALTIES",
    "apply_kl_penalty",
    "kl_loss",
    "kl_penalty",
    "make_kl_controller",
]

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    same_device("KL penalty", logp=logp, ref_logp=ref_logp)
    if logp.shape != ref_logp.shape:
        raise ValueError(f"KL penalty: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    return logp - ref_logp


def _k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return _log_ratio(logp, ref_logp)


def _abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return _log_ratio(logp, ref_logp).abs()


def _k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * _log_ratio(logp, ref_logp).square()


def _k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    neg_log_ratio = (-_log_ratio(logp, ref_logp)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (neg_log_ratio.exp() - neg_log_ratio - 1).clamp(-K3_CLAMP, K3_CLAMP)


def _with_k2_gradient(estimate: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """The "+" form of an estimator: its value, k2's gradient."""
    def penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
        k2 = _k2(logp, ref_logp)
        return k2 - k2.detach() + estimate(logp, ref_logp).detach()
    return penalty


_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}

# name -> fn(logp [batch, T], ref_logp [batch, T]) -> kl [batch, T]; config/schema.py's KLKind
# lists the same names (a test keeps them equal).
KL_PENALTIES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    **_ESTIMATORS,
    **{name + "+": _with_k2_gradient(fn) for name, fn in _ESTIMATORS.items()},
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate `[batch, T]` of the kind named `kind` (a key of KL_PENALTIES).

    Values at masked positions are computed but meaningless; callers mask them.
    """
    try:
        fn = KL_PENALTIES[kind]
    except KeyError:
        raise ValueError(f"unknown KL penalty {kind!r}; choose one of {sorted(KL_PENALTIES)}") from None
    return fn(logp, ref_logp)


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    denoms: LossDenominators,
    kind: str = "low_var_kl",
    agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL loss term of the actor: `aggregate_loss(kl_penalty(logp, ref_logp, kind), ...)`.

    `logp, ref_logp, mask: [batch, T]`. Returns `(loss, {"kl_loss": detached loss})`; the loss is a
    micro-batch contribution (see aggregation), differentiable w.r.t. `logp`. Multiply by
    `kl_loss_coef` and add it to the policy loss.
    """
    loss = aggregate_loss(kl_penalty(logp, ref_logp.detach(), kind), mask, agg_mode, denoms)
    return loss, {"kl_loss": loss.detach()}


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kl_ctrl: "KLController",
    kind: str = "k1",
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[Tensor, dict[str, float]]:
    """Subtract beta * kl from the token rewards at valid positions (`algorithm.use_kl_in_reward`).

    `token_rewards, logp, ref_logp, mask: [batch, T]`; beta = `kl_ctrl.value`.
    Returns `(rewards [batch, T], {"current_kl": ..., "kl_coef": beta})`. Masked positions keep
    their reward unchanged (estimators ignore them). current_kl is the mean over sequences with a
    valid token of each sequence's token-mean KL (verl counts a sequence without one as KL 0 in
    its mean; a response always has a valid token, its EOS, so the trainer's batches do not differ),
    over all ranks of `group` (a collective), so that the controller update that follows,
    `kl_ctrl.update(current_kl, n_steps=batch_size)`, is the same on every rank. This function does not update the controller.
    """
    same_device("apply_kl_penalty", token_rewards=token_rewards, logp=logp, ref_logp=ref_logp, mask=mask)
    if not (token_rewards.shape == logp.shape == mask.shape):
        raise ValueError(
            f"apply_kl_penalty: token_rewards {tuple(token_rewards.shape)}, logp {tuple(logp.shape)} "
            f"and mask {tuple(mask.shape)} must all be [batch, response_len]"
        )
    valid = mask.bool()
    kl = kl_penalty(logp, ref_logp, kind)
    zero = kl.new_zeros(())
    kl = torch.where(valid, kl, zero)
    beta = float(kl_ctrl.value)
    rewards = torch.where(valid, token_rewards - beta * kl.to(token_rewards.dtype), token_rewards)

    row_tokens = valid.sum(dim=-1)
    row_kl = kl.to(torch.float64).sum(dim=-1) / row_tokens.clamp(min=1)
    stats = torch.stack([row_kl.sum(), (row_tokens > 0).sum().to(torch.float64)])
    if group is not None:
        dist.all_reduce(stats, group=group)
    current_kl = float(stats[0] / stats[1]) if stats[1] > 0 else 0.0
    return rewards, {"current_kl": current_kl, "kl_coef": beta}


# ---------------------------------------------------------------------------------------------
# Controllers: beta for the in-reward penalty
# ---------------------------------------------------------------------------------------------


class FixedKLController:
    """Constant coefficient beta = `kl_coef`."""

    kind = "fixed"

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No change; present so callers treat both controllers alike."""

    def state_dict(self) -> dict[str, Union[str, float]]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, self.kind)
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive beta (Ziegler et al. 2019): steer the observed KL towards `target_kl`.

    update: e = clip(current_kl / target_kl - 1, -0.2, 0.2); beta *= 1 + e * n_steps / horizon,
    where n_steps is the number of samples the KL was measured on (the batch size) and horizon
    the number of samples over which the error would be corrected.
    """

    kind = "adaptive"

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController: target_kl ({target_kl}) and horizon ({horizon}) must be positive"
            )
        self.value = float(kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update: current_kl is {current_kl}, not finite")
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Union[str, float, int]]:
        return {"kind": self.kind, "value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """Restore beta; target and horizon stay as configured (a resumed run may change them)."""
        _check_kind(state, self.kind)
        self.value = float(state["value"])


KLController = Union[FixedKLController, AdaptiveKLController]


def _check_kind(state: dict, kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(
            f"KL controller checkpoint holds a {state.get('kind')!r} controller but the config asks "
            f"for {kind!r}; set algorithm.kl_ctrl.type={state.get('kind')} or start without its state"
        )


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: Optional[float] = None, horizon: Optional[int] = None
) -> KLController:
    """Build the controller named `kind` ("fixed" or "adaptive"; the latter needs target and horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("adaptive KL controller needs target_kl and horizon (algorithm.kl_ctrl)")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; choose 'fixed' or 'adaptive' (algorithm.kl_ctrl.type)")
