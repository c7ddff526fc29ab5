"""The actor's weights to a rollout set of its own: training layout (TP_t × PP × DP on the actor's
ranks) -> generation layout (TP_g replicas on other ranks), point to point, each rollout rank
receiving only its TP_g shard.

    actor set   [0, 1, 2, 3]  TP_t=2 PP=2 DP=1        rollout set  [4, 5, 6, 7]  TP_g=2: 2 replicas

For each generation tensor, in one fixed order on every rank of both sets, rollout rank
(replica r, TP_g rank j) is served by the actor ranks of DP replica r mod DP_t, at the pipeline
stage that owns the tensor, CP rank 0:
- TP_t = k·TP_g: the k ranks of TP_t shards j·k .. j·k+k-1 each send their whole shard; the
  receiver concatenates them kind by kind (models/weight_map.tp_merge), which is its TP_g shard;
- TP_g = m·TP_t: the rank of TP_t shard j // m sends piece j mod m of its shard
  (weight_map.tp_slice on the shard: each kind's pieces nest, so it is the TP_g shard);
- replicated tensors (norms): one rank sends the whole tensor.
The received tensor is written straight into the generation model's parameters, which live in one
flat buffer (`FlatParameterBuffer`, released between generations like the in-place one). A rollout
rank starts with nothing, so what it receives, its TP_g shard of every tensor, is the lower bound
(`RepartitionStats.min_bytes_received`); no rank assembles more than its own TP_g shard plus the
tensor in flight. LoRA adapters are merged on the sending side, one tensor at a time, exactly as
in the in-place repartition.

Where the in-place repartition (rollout/repartition.py) serves a colocated engine, this one is
for `placement.rollout`: the generation engine on GPUs of its own, so that it can generate the
next batch while the actor set trains (one-step-off asynchronous training, issue 23). The
placement key and the trainer's use of this transfer are not built yet.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from verl_mcore.distributed.groups import GroupLayout
from verl_mcore.models.weight_map import ParamMap, tp_merge, tp_slice
from verl_mcore.rollout.repartition import (FlatParameterBuffer, RepartitionStats, _Entry,
                                            global_param_names, store_into, tensor_kind)


@dataclass(frozen=True)
class Route:
    """Who sends what of one generation tensor to one rollout rank."""

    receiver: int  # global rank in the rollout set
    senders: tuple[int, ...]  # global actor ranks, in the TP order of their pieces
    piece: Optional[tuple[int, int]]  # (index, count): the part of each sender's shard; None: all


@dataclass(frozen=True)
class CrossSetPlan:
    """Pure rank arithmetic of the transfer (no communication): for a tensor owned by pipeline
    stage `stage`, which actor ranks send which part of it to each rollout rank."""

    actor: GroupLayout  # the actor set: its ranks, TP, PP, CP (its tp_gen is not used here)
    rollout_ranks: tuple[int, ...]
    tp_gen: int

    def __post_init__(self):
        object.__setattr__(self, "rollout_ranks", tuple(self.rollout_ranks))
        tp_t, tp_g = self.actor.tp, self.tp_gen
        if not self.rollout_ranks or len(self.rollout_ranks) % tp_g:
            raise ValueError(f"the rollout set's {len(self.rollout_ranks)} rank(s) do not divide "
                             f"into replicas of rollout.tensor_parallel_size={tp_g}")
        if max(tp_t, tp_g) % min(tp_t, tp_g):
            raise ValueError(f"training TP={tp_t} and rollout.tensor_parallel_size={tp_g}: one "
                             "must divide the other for the shards to nest")
        shared = set(self.rollout_ranks) & set(self.actor.members)
        if shared:
            raise ValueError(f"rank(s) {sorted(shared)} are in both the actor and the rollout set")

    def actor_rank(self, tp: int, dp: int, pp: int) -> int:
        """The actor set's global rank at these coordinates, CP rank 0 (CP ranks hold the same
        weights; megatron order tp-cp-dp-pp, tp fastest)."""
        a = self.actor
        return a.members[tp + a.tp * a.cp * (dp + a.dp * pp)]

    def routes(self, stage: int, kind: str) -> list[Route]:
        """One route per rollout rank; replica r is served by the actor's DP replica r mod DP."""
        tp_t, tp_g = self.actor.tp, self.tp_gen
        out = []
        for i, receiver in enumerate(self.rollout_ranks):
            replica, j = divmod(i, tp_g)
            dp = replica % self.actor.dp
            if kind == "replicated":
                senders, piece = (self.actor_rank(j * tp_t // tp_g, dp, stage),), None
            elif tp_t >= tp_g:
                k = tp_t // tp_g
                senders, piece = tuple(self.actor_rank(j * k + t, dp, stage) for t in range(k)), None
            else:
                m = tp_g // tp_t
                senders, piece = (self.actor_rank(j // m, dp, stage),), (j % m, m)
            out.append(Route(receiver, senders, piece))
        return out

    def generation_shape(self, shard_shape: tuple, kind: str) -> tuple:
        """The TP_g shard's shape of a tensor whose TP_t shard has `shard_shape`."""
        if kind == "replicated":
            return tuple(shard_shape)
        dim = 1 if kind == "row" else 0
        shape = list(shard_shape)
        shape[dim] = shape[dim] * self.actor.tp // self.tp_gen
        return tuple(shape)


class CrossSetTransfer:
    """Sends the actor set's training weights into the rollout set's generation model.

    Constructed on every rank of both sets (collective over `group`, the two sets' ranks
    together, or the world when None: the catalog of tensors is agreed there, once) and `run` on
    all of them each time the weights move. train_chunks: this actor rank's training chunks (None
    on rollout ranks); gen_model: this rollout rank's generation model, built at TP_g over the
    rollout set's generation groups (None on actor ranks); merge: {global weight name:
    LoRAAdapter} on actor ranks, sent as W + (alpha/r)·B·A (models/lora.merged_weights);
    fp8: on rollout ranks with rollout.dtype=fp8, `Fp8LinearWeights.in_place(gen_model)`: the
    linear weights are quantized into it as they arrive (the actor still sends its own dtype).
    """

    def __init__(self, plan: CrossSetPlan, rank: int, gated_linear_unit: bool, *,
                 train_chunks: Optional[Iterable[torch.nn.Module]] = None,
                 gen_model: Optional[torch.nn.Module] = None, merge: Optional[dict] = None,
                 group=None, fp8=None):
        self.plan, self.rank = plan, rank
        self.sends = rank in plan.actor.members
        self.receives = rank in plan.rollout_ranks
        if not (self.sends or self.receives):
            raise ValueError(f"rank {rank} is in neither the actor nor the rollout set")
        if self.sends == (train_chunks is None) or self.receives == (gen_model is None):
            raise ValueError(f"rank {rank}: actor ranks give train_chunks, rollout ranks gen_model")
        self.merge = dict(merge or {})
        self.train_params: dict[str, torch.nn.Parameter] = {}
        self.stage = None
        if self.sends:
            for chunk in train_chunks:
                self.train_params.update(global_param_names(chunk))
            self.stage = plan.actor.coords(plan.actor.index(rank))["pp"]
        self.fp8 = fp8
        self.buffer = (FlatParameterBuffer(gen_model, exclude=fp8.parameters() if fp8 else ())
                       if self.receives else None)
        self.gen_params = global_param_names(gen_model) if self.receives else {}
        self.entries = self._catalog(gated_linear_unit, group)
        self.routes = [plan.routes(e.owner_stage, e.kind) for e in self.entries]  # fixed per run

    def _catalog(self, gated: bool, group) -> list[_Entry]:
        """Every generation tensor in the rollout model's order, with the stage that owns it and
        its TP_t shard's shape; a layout or vocabulary mismatch raises here, on every rank,
        before any weight moves."""
        mine = ({n: (tuple(p.shape), p.dtype, self.stage) for n, p in self.train_params.items()}
                if self.sends else None)
        gen = {n: tuple(p.shape) for n, p in self.gen_params.items()} if self.receives else None
        size = dist.get_world_size(group)
        everyone: list = [None] * size
        dist.all_gather_object(everyone, (self.rank, mine, gen), group=group)
        held = {r: m for r, m, _ in everyone if m is not None}
        first = next(g for r, _, g in everyone if r == self.plan.rollout_ranks[0])
        missing = sorted(set(self.plan.actor.members) - set(held))
        if missing:
            raise ValueError(f"cross-set transfer: actor rank(s) {missing} are not in its group")
        entries, problems = [], []
        for name, gen_shape in first.items():
            copies = [m[name] for m in held.values() if name in m]
            if not copies:
                problems.append(f"{name}: no stage of the actor holds it")
                continue
            shard, dtype, stage = min(copies, key=lambda c: c[2])  # a tied copy: the first stage's
            kind = tensor_kind(name, gated)
            expected = self.plan.generation_shape(shard, kind)
            if expected != gen_shape:
                problems.append(f"{name}: the actor's TP={self.plan.actor.tp} shards {shard} make "
                                f"{expected} at TP_g={self.plan.tp_gen}, the rollout model has "
                                f"{gen_shape}")
            entries.append(_Entry(name, stage, shard, dtype, kind))
        if problems:  # every rank computed the same list: all raise together
            raise ValueError("cross-set transfer: the rollout model does not match the actor "
                             "(a padded vocabulary differs when the embedding rows do):\n  "
                             + "\n  ".join(problems))
        return entries

    def _outgoing(self, entry: _Entry, piece: Optional[tuple[int, int]]) -> torch.Tensor:
        """What this actor rank sends of `entry`: its shard (LoRA-merged), or a piece of it."""
        weight = self.train_params[entry.name].detach()
        shard = self.merge[entry.name].merged(weight) if entry.name in self.merge else weight
        if piece is not None:
            shard = tp_slice(ParamMap(entry.name, (), entry.kind), shard, *piece)
        return shard.contiguous()

    @torch.no_grad()
    def run(self) -> RepartitionStats:
        start = time.perf_counter()
        stats = RepartitionStats()
        if self.receives:
            self.buffer.restore()
            stats.generation_bytes = self.buffer.nbytes
            if self.fp8 is not None:
                self.fp8.restore()
                stats.generation_bytes += self.fp8.nbytes
        for entry, routes in zip(self.entries, self.routes):
            works, outgoing, incoming = [], {}, []
            for route in routes:
                if self.rank in route.senders:
                    key = route.piece  # one tensor per piece, shared by the ranks it goes to
                    if key not in outgoing:
                        outgoing[key] = self._outgoing(entry, route.piece)
                    works.append(dist.isend(outgoing[key], dst=route.receiver))
                    stats.bytes_sent += outgoing[key].numel() * outgoing[key].element_size()
                if route.receiver == self.rank:
                    shape = entry.shape if route.piece is None else _piece_shape(entry, route.piece)
                    device = self.gen_params[entry.name].device
                    incoming = [torch.empty(shape, dtype=entry.dtype, device=device)
                                for _ in route.senders]
                    works += [dist.irecv(part, src=src) for src, part in zip(route.senders, incoming)]
            for w in works:
                w.wait()
            # Temporaries: what was copied to be sent (a merge, a piece), and what came in.
            temp = sum(t.numel() * t.element_size() for t in outgoing.values()
                       if t.untyped_storage().data_ptr()
                       != self.train_params[entry.name].untyped_storage().data_ptr())
            if self.receives:
                target = self.gen_params[entry.name]
                full = tp_merge(ParamMap(entry.name, (), entry.kind), incoming)
                temp += store_into(target, full, self.fp8)
                got = sum(p.numel() * p.element_size() for p in incoming)
                stats.bytes_received += got
                stats.min_bytes_received += target.numel() * entry.dtype.itemsize
                temp += got + (got if len(incoming) > 1 else 0)
            stats.peak_temp_bytes = max(stats.peak_temp_bytes, temp)
        stats.seconds = time.perf_counter() - start
        return stats

    def release(self) -> None:
        """Free the rollout model's weights between generations (the next `run` refills them)."""
        if self.buffer is not None:
            self.buffer.release()
        if self.fp8 is not None:
            self.fp8.release()


def _piece_shape(entry: _Entry, piece: tuple[int, int]) -> tuple:
    """The shape of piece (i, m) of `entry`'s TP_t shard (tp_slice on the shard)."""
    return tuple(tp_slice(ParamMap(entry.name, (), entry.kind),
                          torch.empty(entry.shape, device="meta"), *piece).shape)
