"""Routing metrics of a mixture-of-experts model's training passes: the load-balancing loss and
the tokens each expert received.

Per optimizer step (one `forward_backward` with gradients):

- `moe_aux_loss`: megatron's load-balancing loss (without its coefficient), the mean over the MoE
  layers of each layer's loss per micro-batch, averaged over data-parallel ranks. megatron's
  routers record it in a process-wide tracker (moe_utils) only when the loss is applied (training
  forward with gradients, coefficient > 0); the tracker is cleared when a pass begins, so a role
  reads only its own pass (actor and critic share the process).
- `moe_tokens_per_expert_max` / `_mean`: the (token, expert) assignments of the step's real and
  padded tokens, summed over micro-batches and data-parallel ranks, per MoE layer and expert;
  the largest and the mean over layers and experts. max / mean = 1 is a perfectly balanced step;
  with top-k of E experts, mean = tokens * k / E. Counted by a forward hook on each router
  (its routing map [tokens, E]), on the device, read once per step.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter


class RoutingMetrics:
    """The routers of one engine's model chunks and their per-step counts."""

    def __init__(self, chunks: Iterable[torch.nn.Module], pg_collection, num_layers: int):
        self.pg = pg_collection
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self.layers = sorted({r.layer_number for r in self.routers})  # 1-based, global
        num_experts = self.routers[0].config.num_moe_experts if self.routers else 0
        self.num_layers = num_layers
        self.counts = None
        if self.routers:
            device = self.routers[0].weight.device
            self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
            for r in self.routers:
                r.register_forward_hook(self._count)

    def _count(self, router, _inputs, output) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return  # log-prob and value passes are not the step's routing
        _, routing_map = output  # [tokens, E] bool
        self.counts[router.layer_number - 1] += routing_map.sum(0).to(torch.float64)

    def begin(self) -> None:
        """Before a training pass: forget earlier passes (this engine's and other roles')."""
        moe_utils.clear_aux_losses_tracker()
        if self.counts is not None:
            self.counts.zero_()

    def take(self, num_micro_batches: int) -> dict[str, float]:
        """The step's metrics, the same on every rank (collective over PP and DP)."""
        if self.counts is None:
            return {}
        counts = self.counts.clone()
        if self.pg.pp.size() > 1:  # each stage counted its own layers
            dist.all_reduce(counts, group=self.pg.pp)
        dp = getattr(self.pg, "dp_cp", None) or self.pg.dp
        if dp.size() > 1:  # each DP (and CP) rank routed its own tokens
            dist.all_reduce(counts, group=dp)
        moe = counts[[layer - 1 for layer in self._all_layers(counts)]]
        out = {"moe_tokens_per_expert_max": float(moe.max()),
               "moe_tokens_per_expert_mean": float(moe.mean())}
        loss = self._aux_loss(num_micro_batches, dp)
        if loss is not None:
            out["moe_aux_loss"] = loss
        moe_utils.clear_aux_losses_tracker()
        return out

    def _all_layers(self, counts: torch.Tensor) -> list[int]:
        """The MoE layers of the whole model (other stages' too): rows that routed tokens."""
        return [i + 1 for i in range(self.num_layers) if counts[i].sum() > 0] or self.layers

    def _aux_loss(self, num_micro_batches: int, dp) -> float | None:
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        names = [n for n in tracker if n.endswith("load_balancing_loss")]
        if not names:
            return None  # coefficient 0: megatron neither applies nor records it
        values = sum(tracker[n]["values"].double() for n in names) / num_micro_batches
        values = values.to(self.counts.device)
        if self.pg.pp.size() > 1:
            dist.all_reduce(values, group=self.pg.pp)
        if dp.size() > 1:  # gloo has no AVG
            dist.all_reduce(values, group=dp)
            values /= dp.size()
        routed = values.nonzero().flatten()
        return float(values[routed].mean()) if routed.numel() else 0.0
