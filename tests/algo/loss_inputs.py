"""Shared inputs for the loss tests: random float64 micro-batches and the losses under test."""
from __future__ import annotations

import torch

from tests.algo import reference as ref
from verl_mcore.algo.kl import kl_loss
from verl_mcore.algo.policy_loss import PolicyLossParams, compute_policy_loss, entropy_bonus
from verl_mcore.algo.value_loss import value_loss

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def loss_batch(seed: int, batch: int = 8, length: int = 9) -> dict[str, torch.Tensor]:
    """Finite float64 inputs on the masks of `reference.random_batch`.

    log-ratios spread over about +-1 so that both clip bounds and the dual clip are hit; a few
    tokens get extreme ratios (e^25, e^-25) to exercise the log-ratio clamp; the first has A < 0.
    """
    b = ref.random_batch(seed, batch, length)
    g = torch.Generator().manual_seed(1000 + seed)
    shape = (batch, length)
    log_prob = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    old_log_prob = log_prob + torch.randn(shape, generator=g, dtype=torch.float64) * 0.6
    old_log_prob[-1, 0] = log_prob[-1, 0] - 25.0
    old_log_prob[-2, 0] = log_prob[-2, 0] + 25.0
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    advantages = torch.randn(shape, generator=g, dtype=torch.float64)
    advantages[-1, 0] = -abs(advantages[-1, 0]) - 0.1  # ratio e^25 with A < 0: the dual clip
    return {
        "mask": b["mask"],
        "log_prob": log_prob,
        "old_log_prob": old_log_prob,
        "ref_log_prob": log_prob + torch.randn(shape, generator=g, dtype=torch.float64) * 0.5,
        "advantages": advantages,
        "values": values,
        "old_values": values + torch.randn(shape, generator=g, dtype=torch.float64) * 0.5,
        "returns": torch.randn(shape, generator=g, dtype=torch.float64),
        "entropy": torch.rand(shape, generator=g, dtype=torch.float64) * 2,
    }


def run_loss(name: str, inputs: dict[str, torch.Tensor], leaf: torch.Tensor, denoms, mode: str):
    """Loss `name` on `inputs` with its differentiable input replaced by `leaf`.

    Returns (loss, diagnostics). `differentiable_input(name)` says which input `leaf` stands for.
    """
    m = inputs["mask"]
    if name in ("ppo", "gspo", "reinforce"):
        params = PolicyLossParams(agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
        return compute_policy_loss(name, leaf, inputs["old_log_prob"], inputs["advantages"], m, denoms, params)
    if name == "value":
        return value_loss(leaf, inputs["old_values"], inputs["returns"], m, denoms, clip_eps=0.2, agg_mode=mode)
    if name.startswith("kl_"):
        return kl_loss(leaf, inputs["ref_log_prob"], m, denoms, kind=name[3:], agg_mode=mode)
    if name == "entropy":
        return entropy_bonus(leaf, m, denoms, entropy_coeff=0.01, agg_mode=mode)
    raise ValueError(name)


LOSSES = ["ppo", "gspo", "reinforce", "value", "kl_k1", "kl_abs", "kl_k2", "kl_k3", "entropy"]


def differentiable_input(name: str) -> str:
    return {"value": "values", "entropy": "entropy"}.get(name, "log_prob")
