"""Which ranks run each role, and how the step's data crosses between role sets.

    placement:                      # 8 ranks on one node
      actor: [0, 1, 2, 3]           # with its rollout engine (and the reference, left out)
      critic: [4, 5]
      reward_model: [6, 7]

A role is a model with a job: the actor (its rollout engine with it), the reference, the critic,
the reward models (all of reward.sources' together). Left out, a role runs where the actor runs;
with nothing set every role runs on every rank (colocated, time-shared: the default). Each role
set builds its own TP/PP/DP groups inside its ranks (distributed/groups.build_set_groups) and a
rank builds only its own roles' models.

The step stays one SPMD program. A phase runs on its role's set; its result (the rollout batch,
reward-model scores, log-probs, values) then reaches every other rank as tensors, broadcast from
the set's first rank over the whole job (`RolePlacement.on`, rollout/gather.py `share_rollout`). The ranks of other
sets meanwhile run their own phases, so the sets overlap where the algorithm lets them: the
reference pass on the actor set while the reward set scores; the critic's update on its set
while the actor set updates the actor. Colocated, every role runs on every rank and nothing is
broadcast: the step is exactly the colocated program.

`Placement` (config/placement.py) is the pure rank arithmetic and its checks (no communication:
config validation and the planner use it); `RolePlacement` here adds this rank's process groups
and the exchanges.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from verl_mcore.config.placement import ROLES, Placement, RoleSet, format_ranks
from verl_mcore.distributed.groups import GroupLayout, build_set_groups, collective_device
from verl_mcore.errors import RoleSetFailure, failure_class
from verl_mcore.utils.device import compute_device


class RolePlacement:
    """This rank's view of a Placement: its process groups per role and the exchanges.

    groups[role]: the role's ParallelGroups on its ranks, None on the others.
    """

    def __init__(self, placement: Placement, groups: dict, rank: int, training=None, link=None):
        self.placement, self.groups, self.rank = placement, groups, rank
        # The training ranks (all but placement.rollout's; the world without one), over which
        # the training phases exchange; and the actor set with the rollout set (the weights'
        # way there), None without a rollout set.
        self.training, self.link = training, link
        self.training_ranks = tuple(r for r in range(placement.world)
                                    if "rollout" not in placement.sets
                                    or r not in placement.ranks("rollout"))
        self._held: Optional[tuple[str, BaseException]] = None  # (role, error) of `run`

    @classmethod
    def build(cls, placement: Placement, tp_gen: int, timeout_minutes: int,
              expert_model_parallel_size: int = 1) -> "RolePlacement":
        """Process groups of every set (collective: every rank builds every set's groups)."""
        distinct = placement.distinct_sets()
        # The generation layout lives on the set that generates: the rollout set when there is
        # one, else the actor's.
        generating = placement.sets.get("rollout", placement.sets["actor"])
        layouts = [GroupLayout(len(s.ranks), s.tp, s.pp, s.cp, tp_gen if s == generating else 1,
                               ranks=s.ranks, vpp=s.vpp) for s in distinct]
        built = build_set_groups(layouts, timeout_minutes, expert_model_parallel_size)
        by_set = dict(zip(distinct, built))
        training = link = None
        if "rollout" in placement.sets:  # new_group is collective: every rank, this order
            timeout = datetime.timedelta(minutes=timeout_minutes)
            rollout = set(placement.ranks("rollout"))
            training = dist.new_group([r for r in range(placement.world) if r not in rollout],
                                      timeout=timeout)
            link = dist.new_group(sorted(set(placement.ranks("actor")) | rollout), timeout=timeout)
        return cls(placement, {role: by_set[s] for role, s in placement.sets.items()},
                   dist.get_rank(), training, link)

    @classmethod
    def everywhere(cls, groups, roles=ROLES) -> "RolePlacement":
        """Every role of `roles` on every rank, over `groups` (the ParallelGroups of all of them;
        None without torch.distributed set up): the placement in which each phase simply runs
        where it is called (the Python API's objects)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        every = RoleSet(tuple(range(world)), 1, 1)
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(Placement(world, {role: every for role in roles}),
                   {role: groups if groups is not None else True for role in roles}, rank)

    @property
    def colocated(self) -> bool:
        return self.placement.colocated

    @property
    def generating_set(self) -> str:
        """The set whose ranks run the generation engine: "rollout" or "actor"."""
        return "rollout" if "rollout" in self.placement.sets else "actor"

    @property
    def trains(self) -> bool:
        """Whether this rank takes part in the training phases (every rank but the rollout
        set's)."""
        return self.rank in self.training_ranks

    def seed_rng(self, seed: int) -> None:
        """megatron's model-parallel RNG tracker, seeded for this rank's set (placed runs leave
        parallel_state uninitialised, so the trainer's default seeding cannot reach it)."""
        mine = next((g for g in self.groups.values() if g is not None), None)
        if mine is not None and not self.colocated:
            mine.seed_rng(seed)

    def role_ranks(self) -> dict:
        """{role: its ranks} of the trained roles, for the checkpoints (their leaders write)."""
        return {r: self.placement.ranks(r) for r in ("actor", "critic") if self.has(r)}

    def has(self, role: str) -> bool:
        """Whether the run has `role` (on some ranks)."""
        return role in self.placement.sets

    def runs(self, role: str) -> bool:
        """Whether this rank runs `role` (False for a role the run does not have)."""
        return self.groups.get(role) is not None

    def _everywhere(self, role: str) -> bool:
        """Whether `role` runs on every training rank (nothing of it needs broadcasting)."""
        return set(self.placement.ranks(role)) == set(self.training_ranks)

    def on(self, role: str, compute: Callable[[], torch.Tensor], shape: Sequence[int],
           dtype: torch.dtype = torch.float32, share: bool = True) -> Optional[torch.Tensor]:
        """`compute()` on `role`'s ranks; its result [shape] on the training device, on every
        rank when `share` (broadcast from the set's first rank), else None off the set.

        A failure on the role's ranks raises on every rank: the flag is agreed before the
        broadcast, so the other sets never wait for a result that will not come."""
        if self._everywhere(role):
            return compute().to(compute_device())
        out, failure = None, None
        if self.runs(role):
            try:
                out = compute()
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                failure = e
        if share:
            self._agree(role, failure)
            out = self._broadcast(out, self.placement.leader(role), shape, dtype)
        elif failure is not None:
            raise failure
        return out.to(compute_device()) if out is not None else None

    def run(self, role: str, work: Callable[[], dict]) -> dict:
        """`work()` (e.g. the role's update) on `role`'s ranks; {} elsewhere. Placed, a failure is
        held until the step's end, where gather_metrics raises it on every rank: the other sets
        meanwhile finish their own work of the step instead of waiting on a collective."""
        if not self.runs(role):
            return {}
        if self._everywhere(role):
            return work()
        try:
            return work()
        except Exception as e:  # noqa: BLE001 - raised by gather_metrics on every rank
            self.hold(role, e)
            return {}

    def hold(self, role: str, failure: BaseException) -> None:
        """Keep `failure` of `role`'s work until gather_metrics raises it on every rank (as
        `run` does for an update)."""
        self._held = (role, failure)

    def _agree(self, role: str, failure: Optional[BaseException]) -> None:
        """Raise on every rank when `role`'s phase failed on any of its ranks."""
        flag = torch.tensor([0 if failure is None else self.rank + 1], dtype=torch.int64,
                            device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.training)
        if failure is not None:
            raise failure
        if int(flag[0]):
            raise RoleSetFailure(f"the {role} set (ranks {format_ranks(self.placement.ranks(role))}) "
                                 f"failed on rank {int(flag[0]) - 1}: its log has the error")

    def _broadcast(self, tensor: Optional[torch.Tensor], src: int, shape, dtype,
                   group: Any = "training") -> torch.Tensor:
        """`tensor` of global rank `src` on every rank of `group` (default: the training ranks;
        None: the world)."""
        group = self.training if group == "training" else group
        device = collective_device()
        if self.rank == src:
            buf = tensor.detach().to(device=device, dtype=dtype).contiguous()
            if tuple(buf.shape) != tuple(shape):
                raise RuntimeError(f"rank {src}: a result of shape {tuple(buf.shape)} where "
                                   f"{tuple(shape)} was expected")
        else:
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        return buf if tensor is None or self.rank == src else tensor

    def gather_metrics(self, metrics: dict, step: int) -> dict:
        """Every rank's metrics of the step merged on every rank (each role's from its own set),
        plus each set's phase times as `timing_s/<set>/<phase>` (<set>: its roles joined by
        '+'); raises on every rank when a set's work failed this step (`run`). Small dicts of
        floats, once a step."""
        if self.colocated:
            return metrics
        held, self._held = self._held, None
        failure = None if held is None else (held[0], type(held[1]).__name__, str(held[1]))
        everyone: list = [None] * self.placement.world
        dist.all_gather_object(everyone, (metrics, failure))
        if held is not None:
            raise held[1]
        for rank, (_, failed) in enumerate(everyone):
            if failed is not None:
                role, kind, text = failed
                ranks = (self.placement.ranks(role) if role in self.placement.sets
                         else self.training_ranks)
                raise failure_class(kind)(
                    f"the {role} set (ranks {format_ranks(ranks)}) failed at "
                    f"step {step} on rank {rank}: {kind}: {text}")
        merged: dict = {}
        for rank in sorted(range(self.placement.world), key=lambda r: r != 0):
            for k, v in everyone[rank][0].items():
                merged.setdefault(k, v)  # rank 0's first, then each set's own keys
        for s in self.placement.distinct_sets():
            name = "+".join(r for r, t in self.placement.sets.items() if t == s)
            busy = 0.0
            for k, v in everyone[s.ranks[0]][0].items():
                if k.startswith("timing_s/") and k != "timing_s/step":
                    phase = k[len('timing_s/'):]
                    merged[f"timing_s/{name}/{phase}"] = v
                    busy += 0.0 if phase.startswith("wait") else v
            # Busy share of the step (waiting for another set's batch is not busy): where the
            # sets overlap, each set's share; what the planner's split balances.
            step_s = everyone[s.ranks[0]][0].get("timing_s/step")
            if step_s:
                merged[f"perf/utilisation/{name}"] = min(1.0, busy / step_s)
        return merged
