"""Critic role: values of the response states and the clipped value-loss update.

The critic's model returns one scalar per position, `[b, s, 1]` (a GPTModel whose output layer is
a value head). The value of response token j is read at the position that precedes it (the state
from which the token was sampled), the same position the actor's log-prob comes from.

Update: ppo_epochs x mini-batches, each one optimizer step on the sum over micro-batches and DP
ranks of the clipped value loss (verl_mcore.algo.value_loss) with the mini-batch's global
denominators; see actor.py for the loop.

Values before the update. The clip centre and the GAE returns need V_old, the values of the
weights before this step's update. When the update is one optimizer step (one epoch, one
mini-batch: the default), every micro-batch's forward pass runs on exactly those weights, so the
update computes V_old itself: per micro-batch, the forward's values, detached, are V_old; the
returns of those rows come from them (GAE is per row) and the loss follows. This saves the
separate forward-only values pass verl runs (a tenth of a PPO step at the bench shape), as the
actor's on-policy update saves the old-log-prob pass. The values are the same computation either
way (dropout is off in every role); with several optimizer steps the pass runs first
(`compute_values`), since later mini-batches see moved weights.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from verl_mcore.algo.value_loss import value_loss
from verl_mcore.engine.actor import loss_mask, micro_batching, run_ppo_epochs, summarize
from verl_mcore.engine.batch import TrainBatch
from verl_mcore.engine.engine import MegatronEngine
from verl_mcore.engine.logprobs import response_values


class Critic:
    """cfg: CriticConfig. mini_batch_size: SAMPLES per optimizer step; ppo_epochs resolved by the
    caller (critic.ppo_epochs or the actor's). agg_mode: loss aggregation of the value loss."""

    def __init__(self, engine: MegatronEngine, cfg, *, mini_batch_size: int, ppo_epochs: int,
                 agg_mode: str = "token-mean", norm_len: Optional[float] = None):
        if engine.optimizer is None:
            raise ValueError("Critic: its engine needs an optimizer (optim=cfg.critic.optim)")
        self.engine = engine
        self.cfg = cfg
        self.mini_batch_size = mini_batch_size
        self.ppo_epochs = ppo_epochs
        self.agg_mode = agg_mode
        self.norm_len = norm_len
        self.mb_kwargs = micro_batching(cfg.max_tokens_per_microbatch, cfg.micro_batch_size_per_gpu)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """`[B, R]` values of the response states (0 outside responses), forward only, every rank."""
        parts = []

        def collect(out, mb):
            parts.append((mb.rows, response_values(out, mb)))
            return None, {}

        self.engine.forward_backward(self.engine.micro_batches(batch, **self.mb_kwargs), collect, forward_only=True)
        return self.engine.gather_rows(parts, batch.num_samples, batch.response_width)

    def is_one_step(self, num_samples: int) -> bool:
        """Whether updating a batch of `num_samples` is one optimizer step (one epoch, one
        mini-batch): then the update's forward passes see the weights before it and can give
        V_old themselves (module docstring)."""
        return self.ppo_epochs == 1 and self.mini_batch_size == num_samples

    def _loss(self, denoms, out, mb):
        f = mb.fields
        values = response_values(out, mb)
        loss, metrics = value_loss(
            values, f["values"], f["returns"], loss_mask(mb), denoms, self.cfg.cliprange_value, self.agg_mode
        )
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _loss_on_own_values(self, returns_of, collected, denoms, out, mb):
        """The value loss of a one-step update whose forward pass gives V_old (module docstring)."""
        f = mb.fields
        values = response_values(out, mb)
        old = values.detach()
        collected.append((mb.rows, old))
        returns = returns_of(f["token_rewards"], old, f["response_mask"])
        loss, metrics = value_loss(values, old, returns, loss_mask(mb), denoms, self.cfg.cliprange_value,
                                   self.agg_mode)
        metrics["loss"] = loss.detach()
        return loss, metrics

    def update(self, batch: TrainBatch, returns_of: Optional[ReturnsFn] = None
               ) -> tuple[dict[str, float], list[dict[str, float]]]:
        """Returns (summary with "critic/" keys, per-step metrics); see Actor.update.

        With `batch.values` and `batch.returns` set, they are the clip centre and the targets.
        Without them (a one-step update, `is_one_step`): `batch.token_rewards` and `returns_of`
        (`returns_of(token_rewards, values, mask) -> returns`, all `[n, R]`, row-wise) are
        needed, and the update writes `batch.values` (V_old, from its own forward passes: the
        same on every rank) before it returns.
        """
        if batch.values is not None or returns_of is None:
            batch.require("values", "returns", role="Critic.update")
            steps = run_ppo_epochs(self.engine, batch, self.mini_batch_size, self.ppo_epochs,
                                   self.mb_kwargs, self._loss, self.norm_len)
        else:
            if not self.is_one_step(batch.num_samples):
                raise ValueError(
                    f"Critic.update: without batch.values the update must be one optimizer step "
                    f"(ppo_epochs={self.ppo_epochs}, mini-batch {self.mini_batch_size} of "
                    f"{batch.num_samples} samples); run compute_values first")
            batch.require("token_rewards", role="Critic.update")
            collected: list = []
            loss = lambda denoms, out, mb: self._loss_on_own_values(returns_of, collected, denoms, out, mb)  # noqa: E731
            steps = run_ppo_epochs(self.engine, batch, self.mini_batch_size, 1, self.mb_kwargs, loss,
                                   self.norm_len)
            batch.values = self.engine.gather_rows(collected, batch.num_samples, batch.response_width)
        return summarize("critic", steps, self.engine, batch, self.ppo_epochs, 1), [s for s, _ in steps]


ReturnsFn = Callable[[Tensor, Tensor, Tensor], Tensor]
