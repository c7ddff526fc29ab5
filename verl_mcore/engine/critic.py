"""Critic role: values of the response states and the clipped value-loss update.

The critic's model returns one scalar per position, `[b, s, 1]` (a GPTModel whose output layer is
a value head). The value of response token j is read at the position that precedes it (the state
from which the token was sampled), the same position the actor's log-prob comes from.

Update: ppo_epochs x mini-batches, each one optimizer step on the sum over micro-batches and DP
ranks of the clipped value loss (verl_mcore.algo.value_loss) with the mini-batch's global
denominators; see actor.py for the loop.
"""
from __future__ import annotations

from typing import Optional

import torch

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

    def _loss(self, denoms, out, mb):
        f = mb.fields
        values = response_values(out, mb)
        loss, metrics = value_loss(
            values, f["values"], f["returns"], loss_mask(mb), denoms, self.cfg.cliprange_value, self.agg_mode
        )
        metrics["loss"] = loss.detach()
        return loss, metrics

    def update(self, batch: TrainBatch) -> tuple[dict[str, float], list[dict[str, float]]]:
        """Returns (summary with "critic/" keys, per-step metrics); see Actor.update."""
        batch.require("values", "returns", role="Critic.update")
        steps = run_ppo_epochs(
            self.engine, batch, self.mini_batch_size, self.ppo_epochs, self.mb_kwargs, self._loss, self.norm_len
        )
        return summarize("critic", steps, self.engine, batch, self.ppo_epochs, 1), [s for s, _ in steps]
