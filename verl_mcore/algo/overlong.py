"""DAPO's two treatments of responses that run into the length limit (Yu et al. 2025, sec. 3.4).

Soft overlong punishment (`reward.overlong_buffer: {enable, len, penalty_factor}`): a response of
L tokens, with L_max = data.max_response_length and L_cache = len, gets

    expected = L_max - L_cache
    penalty  = min(-(L - expected) / L_cache * penalty_factor, 0)         (0 >= penalty >= -factor)

added to its score: nothing up to `expected` tokens, then linearly more, down to -penalty_factor
at L_max. This is verl's formula (verl/workers/reward_manager/dapo.py, `overlong_reward`), with
verl's key names under `reward.` instead of `reward_model.`.

    Which L. verl's L is `valid_response_length`, the sum of the response's attention mask: every
    response token up to and including the first EOS (verl/utils/torch_functional.py
    get_response_mask keeps the EOS), all of them for a response that hit the limit, tool-output
    tokens included (they are in the attention mask; only the loss mask drops them). Ours is the
    same count: the engines keep the stop token as the response's last token (rollout/base.py
    SampleOutput.token_ids), and `TrainBatch.response_lens` (seq_lens - prompt_lens) counts every
    response token whether the loss mask keeps it or not. One difference, with no effect: an
    empty response is laid out as one masked pad token (engine/batch.py), so L = 1 where verl
    would have 0; `expected` is at least 1 (the config check), so the penalty is 0 either way.

    Where the differences from verl are. The penalty is applied to the training scores only
    (`overlong_scores`, called where a step scores its samples), so GRPO's group statistics, the
    critic's returns, `critic/score/*` and, with ReMax, the greedy baseline's score all see it, as
    in verl; validation scores do not (verl's val_reward_fn adds it there too, which would move
    val/<source>/* and pass@n with the response length). The penalty is a config section, not a
    reward manager: it composes with every reward source. verl's `log` flag (per-sample
    `overlong_reward` extras) has no counterpart; the batch metrics below are always logged while
    enabled. verl's default penalty_factor is 0.0 (enabled, it would penalise nothing); ours is
    1.0, the DAPO paper's.

Overlong filtering (`actor.mask_truncated_samples`): samples whose finish reason is "length"
(the engine stopped them at data.max_response_length) are left out of the actor's loss. Their
response mask is zeroed in the batch the actor's update gets (`actor_batch`): they then have no
valid token, so in every `actor.loss_agg_mode` they add nothing to the loss and count neither in
N_tok nor in N_seq, the mini-batch denominators (algo/aggregation.py: sequences with no valid
token count for nothing), on every micro-batch and DP rank alike. They still take their share of
the forward/backward compute (the mini-batch sizes stay those of the config). Only the actor
leaves them out: the advantages (GRPO's group mean and std) still include their scores, and the
critic still learns their returns. The DAPO paper masks the loss of truncated samples; NeMo-RL
(grpo.overlong_filtering) and SkyRL (generator.apply_overlong_filtering) zero their loss mask the
same way. A stop token sampled exactly at the limit is "stop", not truncated.

Metrics (while enabled; names beside the existing `reward/<source>/mean` and `actor/*`):
    reward/overlong/penalty_mean     mean penalty over the batch's samples (<= 0)
    reward/overlong/fraction         fraction of samples penalised (penalty < 0, verl's `overlong`)
    actor/masked_truncated_fraction  fraction of samples left out of the actor's loss
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from verl_mcore.utils.checks import same_device

if TYPE_CHECKING:  # annotations only: algo sits below config in the layers
    from verl_mcore.config import Config

__all__ = ["actor_batch", "mask_samples", "overlong_penalty", "overlong_scores", "truncated"]


def overlong_penalty(response_lens: Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> Tensor:
    """`response_lens [B]` (tokens of each response, stop token included) -> `[B]` float32
    penalties, each in [-penalty_factor, 0] for lengths up to `max_response_length` (module
    docstring). Computed in float64 and rounded once."""
    if buffer_len <= 0:
        raise ValueError(f"overlong_penalty: buffer_len={buffer_len} must be > 0 "
                         "(reward.overlong_buffer.len)")
    expected = max_response_length - buffer_len
    exceed = response_lens.to(torch.float64) - expected
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0).to(torch.float32)


def truncated(finish: Sequence[str], device: torch.device | str = "cpu") -> Tensor:
    """`[B]` bool: the samples whose finish reason is "length" (cut at the length limit)."""
    return torch.tensor([f == "length" for f in finish], dtype=torch.bool, device=device)


def mask_samples(response_mask: Tensor, drop: Tensor) -> Tensor:
    """`response_mask [B, R]` with the rows where `drop [B]` (bool) is true zeroed, same dtype."""
    same_device("mask_samples", response_mask=response_mask, drop=drop)
    if drop.shape != response_mask.shape[:1]:
        raise ValueError(f"mask_samples: drop {tuple(drop.shape)} must be [B] for response_mask "
                         f"{tuple(response_mask.shape)}")
    return response_mask * (~drop).to(response_mask.dtype)[:, None]


def overlong_scores(cfg: Config, rollout: Any, scores: Tensor) -> tuple[Tensor, dict[str, float]]:
    """The step's `scores [B]` with reward.overlong_buffer's penalty added, and its metrics; the
    scores themselves and {} while it is off. `rollout`: the samples scored (`.train`, a
    TrainBatch, gives each response's length)."""
    ob = cfg.reward.overlong_buffer
    if not ob.enable:
        return scores, {}
    lens = rollout.train.response_lens.to(scores.device)
    penalty = overlong_penalty(lens, cfg.data.max_response_length, ob.len, ob.penalty_factor)
    metrics = {"reward/overlong/penalty_mean": float(penalty.mean()),
               "reward/overlong/fraction": float((penalty < 0).float().mean())}
    return scores + penalty.to(scores.dtype), metrics


def actor_batch(cfg: Config, rollout: Any) -> tuple[Any, dict[str, float]]:
    """The batch the actor's update trains on, and its metrics: `rollout.train` itself while
    actor.mask_truncated_samples is off; else a copy whose response mask leaves out the samples
    `rollout.finish` says were cut at the length limit (module docstring). The critic's and the
    metrics' batch (`rollout.train`) keeps its mask."""
    batch = rollout.train
    if not cfg.actor.mask_truncated_samples:
        return batch, {}
    drop = truncated(rollout.finish, batch.response_mask.device)
    masked = dataclasses.replace(batch, response_mask=mask_samples(batch.response_mask, drop))
    return masked, {"actor/masked_truncated_fraction": float(drop.float().mean())}
