"""Routing replay: a MoE model's routers forced to experts chosen elsewhere (the rollout engine's),
token by token, with the gating weights recomputed from this model's own router scores.

Why: the engine and the trainer can route a token differently where two experts' scores nearly
tie (other kernels, batch shapes, precision); the token's log-prob under the trainer is then that
of another network, and the PPO ratio breaks. Replaying the engine's choices removes that
difference; the gates still come from the trainer's router (`scores.gather(experts)`, then the
family's normalisation), so the router keeps its gradients.

How: megatron-core 0.16.1's top-k routing (moe_utils.topk_routing_with_score_function) asks the
router's `router_replay` object for the top-k when one is set. `ForcedRouting` installs one per
router (`_LayerReplay`) that computes the router's own top-k and, on the tokens that carry
targets, replaces it by them (rows of -1: the router's own choice: tokens the engine did not
record, padding). It also counts how often the router's own choice differs from the target (the
replay's mismatch metric). The router sees its tokens as [s, b] flattened s-major (or [T, 1]
packed); `force` takes targets [b, s, layers, k] in the micro-batch's layout and lays them out so.

Not with activation recompute (the recomputed forward would replay the next micro-batch's
targets) nor context or sequence parallelism (a router sees a slice of the tokens): the config
validation refuses those with actor.router_replay.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter


class _LayerReplay:
    """Stands in for megatron's RouterReplay on one router."""

    def __init__(self):
        self.targets: Optional[torch.Tensor] = None  # [tokens, k] int64; -1 rows: own choice
        self.last: Optional[torch.Tensor] = None
        # Since the last reset, on the device (no host sync in the forward): tokens that carried
        # targets, and those of them whose own top-k set was another.
        self.forced: torch.Tensor | int = 0
        self.differed: torch.Tensor | int = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, experts = default_compute_topk(scores, topk, num_groups, group_topk)
        self.last = experts.detach()  # the router's own choice in its last forward
        if self.targets is None:
            return probs, experts
        targets = self.targets.to(scores.device)
        if targets.shape != experts.shape:
            raise ValueError(f"routing replay: targets {tuple(targets.shape)} for a router that "
                             f"routed {tuple(experts.shape)} (tokens, top-k)")
        forced = targets[:, 0] >= 0  # [tokens]
        with torch.no_grad():
            same = (experts.sort(-1).values == targets.sort(-1).values).all(-1)
            self.forced = self.forced + forced.sum()
            self.differed = self.differed + (forced & ~same).sum()
        experts = torch.where(forced[:, None], targets, experts)
        # The forced experts' own scores: pre-softmax probabilities, or logits that the caller
        # turns into gates with a softmax over the k of them.
        probs = torch.where(forced[:, None], scores.gather(1, experts), probs)
        return probs, experts


class ForcedRouting:
    """The routers of one model's chunks (this rank's pipeline stages), by global layer."""

    def __init__(self, chunks: Iterable[torch.nn.Module]):
        self.routers: dict[int, _LayerReplay] = {}
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    replay = _LayerReplay()
                    module.router_replay = replay
                    self.routers[module.layer_number - 1] = replay
        if not self.routers:
            raise ValueError("routing replay: the model has no MoE router (a dense model)")

    def force(self, targets: Optional[torch.Tensor]) -> None:
        """Route the next forward's tokens to `targets` [b, s, num_layers, k] (global layer
        index on dim 2; -1: the router's own choice); None: every router routes on its own."""
        for layer, replay in self.routers.items():
            replay.targets = None if targets is None else \
                targets[:, :, layer].transpose(0, 1).reshape(-1, targets.shape[-1]).long()

    def own_choices(self, batch: int) -> torch.Tensor:
        """The experts each router chose on its own in the last forward (before any forcing),
        [b, s, num_layers, k] like `force`'s targets (-1 for layers of other stages and dense
        layers)."""
        any_ = next(iter(self.routers.values())).last
        tokens, k = any_.shape
        out = torch.full((batch, tokens // batch, max(self.routers) + 1, k), -1, dtype=torch.long,
                         device=any_.device)
        for layer, replay in self.routers.items():
            out[:, :, layer] = replay.last.view(tokens // batch, batch, k).transpose(0, 1)
        return out

    def mismatch(self, reset: bool = True) -> tuple[int, int]:
        """(token-layers whose own routing differed from the target, token-layers forced) since
        the last reset, summed over this rank's layers."""
        out = (int(sum(r.differed for r in self.routers.values())),
               int(sum(r.forced for r in self.routers.values())))
        if reset:
            for r in self.routers.values():
                r.forced = r.differed = 0
        return out
