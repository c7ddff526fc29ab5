"""Advantage estimators: pure tensor functions, chosen by name from `ADV_ESTIMATORS`.

Conventions shared by every function here:

- Token tensors are `[batch, response_len]`: one row per sampled response, left-aligned.
- `mask [batch, response_len]` (bool, or 0/1 of any dtype; non-zero = valid) marks the tokens the
  policy generated. Zeros are padding after the end of a response and also *holes inside it*
  (tool outputs, observations, anything the policy did not produce). Rewards and values at masked
  positions are never read (they may hold anything, even NaN), and every advantage/return at a
  masked position is exactly 0.
- Sequence scores (`scores [batch]`) are outcome rewards, one per response. When an estimator gets
  token rewards, the score of a row is the sum of its rewards at valid positions.
- Groups (`group_ids [batch]`, any integers) are the n samples of one prompt. Grouping is by id, not
  by position, so rows of a group may be anywhere in the batch; a group must not be split across
  data-parallel ranks (its statistics are computed from the rows given).
- Whitening (`masked_whiten`) can span data-parallel ranks: pass `group=` a process group and the
  mean and variance are those of all valid tokens on all its ranks.
- Computation is in float32 at least (float64 stays float64); results are in that dtype and carry
  no autograd history.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from verl_mcore import ops
# GAE and masked whitening are the torch reference of verl_mcore.ops.gae, kept there beside the
# kernel; exported here with the other estimators.
from verl_mcore.ops.gae_reference import check_token_shapes, compute_dtype, gae, masked_whiten
from verl_mcore.utils.checks import same_device

__all__ = [
    "ADV_ESTIMATORS",
    "compute_advantages",
    "discounted_returns",
    "gae",
    "group_ids_from_uids",
    "grpo",
    "masked_whiten",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]


def _check_per_sequence(where: str, mask: Tensor, **tensors: Tensor) -> None:
    same_device(where, mask=mask, **tensors)
    for name, t in tensors.items():
        if t.shape != (mask.shape[0],):
            raise ValueError(
                f"{where}: {name} must be [batch] = ({mask.shape[0]},) to match mask "
                f"{tuple(mask.shape)}, got shape {tuple(t.shape)}"
            )


# ---------------------------------------------------------------------------------------------
# Returns (GAE itself and masked_whiten: ops/gae_reference.py)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go G_t = r_t + gamma * G_next over the valid tokens of each row.

    `rewards, mask: [batch, T] -> [batch, T]`. Same skipping rule as `gae`: G_next is the return of
    the next valid position of the row (0 after its last one, so returns reset at every sequence
    end); masked positions get 0 and their rewards are not read.
    """
    check_token_shapes("discounted_returns", mask, rewards=rewards)
    dtype = compute_dtype(rewards)
    r = rewards.to(dtype)
    valid = mask.bool()
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    zero = r.new_zeros(())
    for t in range(r.shape[1] - 1, -1, -1):
        m = valid[:, t]
        g = r[:, t] + gamma * running
        out[:, t] = torch.where(m, g, zero)
        running = torch.where(m, g, running)
    return out


def _returns_via_ops(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """`discounted_returns`, computed by verl_mcore.ops.gae (the CUDA kernel on GPUs, the loop of
    `gae` on the CPU): with values 0 and lam 1 GAE's recurrence is A_t = r_t + gamma * A_next
    over the valid positions, exactly the reward-to-go (bit for bit on the CPU). On a GPU the
    time loop above would launch ~5 kernels per token position."""
    return ops.gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[1]


# ---------------------------------------------------------------------------------------------
# Group statistics (GRPO, RLOO, REINFORCE++ baseline)
# ---------------------------------------------------------------------------------------------


def group_ids_from_uids(uids: Sequence[object]) -> Tensor:
    """Map per-sample prompt uids (strings or any hashables) to integer group ids `[batch]`.

    Ids are assigned in order of first appearance; equal uids get equal ids.
    """
    index: dict[object, int] = {}
    return torch.tensor([index.setdefault(u, len(index)) for u in uids], dtype=torch.long)


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row group size, group mean and unbiased group std, each `[batch]`.

    Groups of size 1 get std 0 (their callers give them advantage 0 anyway). The sums are in
    float64 whatever the scores' dtype: a float32 group mean is off by an ulp, and for a group of
    equal scores that error divided by a std made of the same error is O(1), not 0. In float64
    n * s is exact for float32 s, so equal scores give mean s and std 0 exactly.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    x = scores.double()
    count = x.new_zeros(num_groups).index_add_(0, inverse, torch.ones_like(x))
    total = x.new_zeros(num_groups).index_add_(0, inverse, x)
    mean = total / count
    dev2 = (x - mean[inverse]) ** 2
    sq = x.new_zeros(num_groups).index_add_(0, inverse, dev2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return tuple(t[inverse].to(scores.dtype) for t in (count, mean, std))


def _broadcast_to_tokens(per_seq: Tensor, mask: Tensor) -> Tensor:
    """`[batch] -> [batch, T]`: the sequence value on its valid tokens, 0 elsewhere."""
    valid = mask.bool()
    return torch.where(valid, per_seq[:, None].expand(valid.shape), per_seq.new_zeros(()))


def _check_group_inputs(where: str, scores: Tensor, group_ids: Tensor, mask: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"{where}: mask must be [batch, response_len], got shape {tuple(mask.shape)}")
    _check_per_sequence(where, mask, scores=scores, group_ids=group_ids)
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(
            f"{where}: group_ids must be an integer tensor, got {group_ids.dtype}; "
            "map string uids with group_ids_from_uids"
        )


@torch.no_grad()
def grpo(
    scores: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO: outcome score normalised within its group, broadcast to the valid tokens.

    `scores [batch]`, `group_ids [batch]` (integers), `mask [batch, T]` -> advantages `[batch, T]`.
    A_i = (s_i - mean_g) / (std_g + eps) with the unbiased std of the group, or s_i - mean_g when
    `norm_by_std=False` (Dr.GRPO). Zero at masked positions.
    Degenerate cases: a group of size 1 has no baseline, its advantage is 0; a group whose scores
    are all equal gets 0 (the numerator is 0). verl gives a lone sample mean 0 and std 1, i.e.
    its raw score; the trainer never meets one (config validation wants rollout.n >= 2).
    """
    _check_group_inputs("grpo", scores, group_ids, mask)
    s = scores.to(compute_dtype(scores))
    count, mean, std = _group_stats(s, group_ids)
    centered = s - mean  # exactly 0 for equal scores (see _group_stats)
    adv = centered / (std + eps) if norm_by_std else centered
    adv = torch.where(count > 1, adv, s.new_zeros(()))
    return _broadcast_to_tokens(adv, mask)


@torch.no_grad()
def rloo(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """RLOO: leave-one-out baseline, A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean_g).

    `scores [batch]`, `group_ids [batch]`, `mask [batch, T]` -> `[batch, T]`, zero at masked
    positions. A group of size 1 has no other sample to compare with: its advantage is 0, as in
    verl's compute_rloo_vectorized_outcome_advantage (verl's compute_rloo_outcome_advantage keeps
    the raw score instead; the trainer never meets one: rollout.n >= 2).
    """
    _check_group_inputs("rloo", scores, group_ids, mask)
    s = scores.to(compute_dtype(scores))
    count, mean, _ = _group_stats(s, group_ids)
    adv = count / (count - 1).clamp(min=1) * (s - mean)
    adv = torch.where(count > 1, adv, s.new_zeros(()))
    return _broadcast_to_tokens(adv, mask)


def _sequence_scores(token_rewards: Tensor, mask: Tensor, scores: Optional[Tensor] = None) -> Tensor:
    """`[batch, T] -> [batch]`: sum of the rewards at valid positions of each row. A row with no
    valid position cannot carry its outcome score in token rewards; with `scores [batch]` given,
    such a row's score is taken from there (it still counts in its group's baseline)."""
    dtype = compute_dtype(token_rewards)
    r = token_rewards.to(dtype)
    valid = mask.bool()
    out = torch.where(valid, r, r.new_zeros(())).sum(-1)
    if scores is not None:
        _check_per_sequence("sequence scores", mask, scores=scores)
        out = torch.where(valid.any(-1), out, scores.to(dtype))
    return out


@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: Tensor,
    mask: Tensor,
    gamma: float,
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted reward-to-go per token, whitened over the batch's valid tokens.

    `token_rewards, mask: [batch, T]` -> `(advantages, returns)`, both `[batch, T]`.
    returns = `discounted_returns(token_rewards, mask, gamma)` (reset at each sequence end, holes
    skipped); advantages = `masked_whiten(returns, mask, group=group)`. Raises if the whole batch
    (over `group`) has fewer than 2 valid tokens; all-masked rows are fine and give zeros.
    """
    check_token_shapes("reinforce_plus_plus", mask, token_rewards=token_rewards)
    returns = _returns_via_ops(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, group=group), returns


@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    scores: Optional[Tensor] = None,
) -> Tensor:
    """REINFORCE++ with a group baseline: (score - group mean), broadcast, whitened over the batch.

    `token_rewards [batch, T]`, `group_ids [batch]`, `mask [batch, T]` -> advantages `[batch, T]`.
    score = sum of the row's valid token rewards (undiscounted outcome); a group of size 1 is its
    own baseline (0 before whitening; verl uses mean 0 there, so its raw score enters the
    whitening and shifts every row; the trainer never meets one: rollout.n >= 2). The centred scores go to the valid tokens of their row and
    are whitened with `masked_whiten(..., group=group)` (raises below 2 valid tokens in total).
    `scores [batch]` (optional): outcome scores of rows without valid tokens (`_sequence_scores`).
    """
    check_token_shapes("reinforce_plus_plus_baseline", mask, token_rewards=token_rewards)
    scores = _sequence_scores(token_rewards, mask, scores)
    _check_group_inputs("reinforce_plus_plus_baseline", scores, group_ids, mask)
    _, mean, _ = _group_stats(scores, group_ids)
    return masked_whiten(_broadcast_to_tokens(scores - mean, mask), mask, group=group)


@torch.no_grad()
def remax(token_rewards: Tensor, baseline_scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax: undiscounted reward-to-go minus the reward of the prompt's greedy response.

    `token_rewards [batch, T]`, `baseline_scores [batch]` (the score the greedy decode of the
    row's prompt received, repeated for every sample of that prompt), `mask [batch, T]`
    -> `(advantages, returns)`, both `[batch, T]`, with returns = `discounted_returns(..., 1.0)`
    and advantages = returns - baseline at valid positions, 0 elsewhere.
    """
    check_token_shapes("remax", mask, token_rewards=token_rewards)
    _check_per_sequence("remax", mask, baseline_scores=baseline_scores)
    returns = _returns_via_ops(token_rewards, mask, 1.0)
    base = baseline_scores.to(returns.dtype)
    return _broadcast_to_tokens(base, mask).neg_().add_(returns), returns


# ---------------------------------------------------------------------------------------------
# Registry: one calling convention for the trainer
# ---------------------------------------------------------------------------------------------


def _require(estimator: str, **inputs: Optional[Tensor]) -> None:
    missing = [name for name, value in inputs.items() if value is None]
    if missing:
        raise ValueError(f"advantage estimator {estimator!r} needs {', '.join(missing)}, which was not given")


def _gae_entry(token_rewards, mask, *, values, group_ids, baseline_scores, gamma, lam,
               norm_by_std, whiten, eps, group, scores):
    _require("gae", values=values)
    # Through verl_mcore.ops: the CUDA kernel on GPU tensors, `gae` (+ masked_whiten) on the
    # CPU; one dispatch, the same numbers (tests/ops/test_gae.py).
    if whiten:
        return ops.gae_whitened(token_rewards, values, mask, gamma, lam, group=group)
    return ops.gae(token_rewards, values, mask, gamma, lam)


def _grpo_entry(token_rewards, mask, *, values, group_ids, baseline_scores, gamma, lam,
                norm_by_std, whiten, eps, group, scores):
    _require("grpo", group_ids=group_ids)
    adv = grpo(_sequence_scores(token_rewards, mask, scores), group_ids, mask, norm_by_std, eps)
    return adv, adv


def _rloo_entry(token_rewards, mask, *, values, group_ids, baseline_scores, gamma, lam,
                norm_by_std, whiten, eps, group, scores):
    _require("rloo", group_ids=group_ids)
    adv = rloo(_sequence_scores(token_rewards, mask, scores), group_ids, mask)
    return adv, adv


def _reinforce_pp_entry(token_rewards, mask, *, values, group_ids, baseline_scores, gamma, lam,
                        norm_by_std, whiten, eps, group, scores):
    return reinforce_plus_plus(token_rewards, mask, gamma, group=group)


def _reinforce_pp_baseline_entry(token_rewards, mask, *, values, group_ids, baseline_scores,
                                 gamma, lam, norm_by_std, whiten, eps, group, scores):
    _require("reinforce_plus_plus_baseline", group_ids=group_ids)
    adv = reinforce_plus_plus_baseline(token_rewards, group_ids, mask, group=group, scores=scores)
    return adv, adv


def _remax_entry(token_rewards, mask, *, values, group_ids, baseline_scores, gamma, lam,
                 norm_by_std, whiten, eps, group, scores):
    _require("remax", baseline_scores=baseline_scores)
    return remax(token_rewards, baseline_scores, mask)


# name -> fn(token_rewards [batch, T], mask [batch, T], **inputs and options) -> (advantages, returns)
# `returns` are the critic's targets for gae; the estimators without a critic return their
# advantages (grpo, rloo, reinforce_plus_plus_baseline) or their reward-to-go there.
ADV_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "gae": _gae_entry,
    "grpo": _grpo_entry,
    "rloo": _rloo_entry,
    "reinforce_plus_plus": _reinforce_pp_entry,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline_entry,
    "remax": _remax_entry,
}


def compute_advantages(
    estimator: str,
    token_rewards: Tensor,
    mask: Tensor,
    *,
    values: Optional[Tensor] = None,
    group_ids: Optional[Tensor] = None,
    baseline_scores: Optional[Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
    group: Optional[dist.ProcessGroup] = None,
    scores: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Run the estimator named `estimator` (a key of `ADV_ESTIMATORS`) on a rollout batch.

    Inputs: `token_rewards, mask [batch, T]`; `values [batch, T]` (gae); `group_ids [batch]`
    (grpo, rloo, reinforce_plus_plus_baseline); `baseline_scores [batch]` (remax); `scores
    [batch]` (optional, the group estimators): outcome scores, read only for rows with no valid
    token, whose token rewards cannot hold them (they still count in their group). Options:
    `gamma, lam` (gae, reinforce_plus_plus), `norm_by_std, eps` (grpo), `whiten` (gae only: masked
    whitening of the advantages over the batch, across `group`'s ranks when given; the other
    estimators whiten or not by definition). Returns `(advantages, returns)`, both `[batch, T]`.
    """
    try:
        fn = ADV_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; choose one of {sorted(ADV_ESTIMATORS)}"
        ) from None
    same_device(f"compute_advantages({estimator!r})", token_rewards=token_rewards, mask=mask,
                values=values, group_ids=group_ids, baseline_scores=baseline_scores, scores=scores)
    return fn(token_rewards, mask, values=values, group_ids=group_ids, baseline_scores=baseline_scores,
              gamma=gamma, lam=lam, norm_by_std=norm_by_std, whiten=whiten, eps=eps, group=group,
              scores=scores)
