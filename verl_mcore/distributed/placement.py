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
the set's first rank over the whole job (`RolePlacement.on`, `share_rollout`). The ranks of other
sets meanwhile run their own phases, so the sets overlap where the algorithm lets them: the
reference pass on the actor set while the reward set scores; the critic's update on its set
while the actor set updates the actor. Colocated, every role runs on every rank and nothing is
broadcast: the step is exactly the colocated program.

`Placement` is the pure rank arithmetic and its checks (no communication: config validation and
the planner use it); `RolePlacement` adds this rank's process groups and the exchanges.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

ROLES = ("actor", "reference", "critic", "reward_model")
# Every set placement.* can name: the model roles, and the generation engine's own ranks.
SETS = ROLES + ("rollout",)


@dataclass(frozen=True)
class RoleSet:
    """The global ranks of one role and its layout there (DP = len(ranks) / (TP × PP × CP))."""

    ranks: tuple[int, ...]
    tp: int
    pp: int
    cp: int = 1
    vpp: Optional[int] = None

    @property
    def dp(self) -> int:
        return len(self.ranks) // (self.tp * self.pp * self.cp)

    def describe(self) -> str:
        return f"{format_ranks(self.ranks)} (TP={self.tp} PP={self.pp} DP={self.dp})"


def format_ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 6] -> '0-3,6'."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def parse_ranks(spec: Any, key: str) -> list[int]:
    """[4, 5] | "4-5" | "0-3,8-11" | 6 -> a list of ints, in the order written; ValueError naming
    `key` on anything else."""
    if isinstance(spec, bool):
        raise ValueError(f"{key}: expected ranks such as [4, 5] or \"4-5\", got {spec!r}")
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, (list, tuple)):
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in spec):
            raise ValueError(f"{key}: expected a list of rank numbers, got {list(spec)!r}")
        return list(spec)
    if isinstance(spec, str):
        out = []
        for part in spec.replace(" ", "").split(","):
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if not m:
                raise ValueError(f"{key}: {spec!r} is not a rank list such as \"0-3,6\"")
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if hi < lo:
                raise ValueError(f"{key}: the range {part!r} runs backwards")
            out += range(lo, hi + 1)
        return out
    raise ValueError(f"{key}: expected ranks such as [4, 5] or \"4-5\", got {spec!r}")


def run_roles(cfg) -> list[str]:
    """The roles this config's run has: the actor always; the reference when a KL term reads its
    log-probs; the critic for GAE; the reward models when reward.sources has one."""
    roles = ["actor"]
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        roles.append("reference")
    if cfg.uses_critic:
        roles.append("critic")
    if any(s.type == "reward_model" for s in cfg.reward.sources):
        roles.append("reward_model")
    if cfg.placement.rollout is not None:
        roles.append("rollout")
    return roles


@dataclass(frozen=True)
class Placement:
    """Every role of the run -> its RoleSet, for a job of `world` ranks."""

    world: int
    sets: dict  # role -> RoleSet, the run's roles only

    @classmethod
    def resolve(cls, cfg, world: int, gpus_per_node: Optional[int] = None) -> "Placement":
        """The run's placement; ConfigError listing every problem (placement_errors)."""
        from verl_mcore.config import ConfigError

        placement, errors = _resolve(cfg, world, gpus_per_node)
        if errors:
            raise ConfigError("invalid placement:\n  - " + "\n  - ".join(errors))
        return placement

    @property
    def colocated(self) -> bool:
        """Every role on every rank (today's default)."""
        return all(len(s.ranks) == self.world for s in self.sets.values())

    def ranks(self, role: str) -> tuple[int, ...]:
        return self.sets[role].ranks

    def leader(self, role: str) -> int:
        """The rank whose copy of a role's result is broadcast: the set's first."""
        return self.sets[role].ranks[0]

    def roles_of(self, rank: int) -> list[str]:
        return [role for role, s in self.sets.items() if rank in s.ranks]

    def distinct_sets(self) -> list[RoleSet]:
        """Each different RoleSet once, in role order (roles on an identical set share groups)."""
        out: list[RoleSet] = []
        for s in self.sets.values():
            if s not in out:
                out.append(s)
        return out

    def describe(self) -> str:
        """One line per set: 'actor, reference: 0-3 (TP=2 PP=1 DP=2)'."""
        lines = []
        for s in self.distinct_sets():
            roles = [r for r, t in self.sets.items() if t == s]
            lines.append(f"{', '.join(roles)}: {s.describe()}")
        return "; ".join(lines)


def placement_errors(cfg, world: int, gpus_per_node: Optional[int] = None) -> list[str]:
    """Every problem of placement.* for a job of `world` ranks (config/validate.py)."""
    return _resolve(cfg, world, gpus_per_node)[1]


def _resolve(cfg, world: int, gpus_per_node: Optional[int]) -> tuple[Optional[Placement], list[str]]:
    from verl_mcore.config.schema import RoleSetConfig

    p = cfg.parallel
    roles = run_roles(cfg)
    errors: list[str] = []
    given: dict[str, RoleSetConfig] = {}
    for role in SETS:
        spec = getattr(cfg.placement, role)
        if spec is None:
            continue
        if role not in roles:
            errors.append(f"placement.{role} is set, but this run has no {role.replace('_', ' ')} "
                          f"({_why_absent(role)}): remove it")
            continue
        given[role] = spec if isinstance(spec, RoleSetConfig) else RoleSetConfig(ranks=spec)
    sets: dict[str, RoleSet] = {}
    for role in roles:
        spec = given.get(role)
        key = f"placement.{role}"
        if spec is None:
            if role == "actor":
                sets[role] = RoleSet(tuple(range(world)), p.tensor_model_parallel_size,
                                     p.pipeline_model_parallel_size, p.context_parallel_size,
                                     p.virtual_pipeline_model_parallel_size)
            elif "actor" in sets:
                sets[role] = _with_layout(sets["actor"], p, None, None)
            continue
        ranks, errs = _ranks_of(spec, key, world, gpus_per_node)
        errors += errs
        if errs:
            continue
        if role == "actor" and (spec.tensor_model_parallel_size or spec.pipeline_model_parallel_size):
            errors.append("placement.actor: the actor's layout is parallel.tensor_model_parallel_size"
                          " / pipeline_model_parallel_size; set it there")
            continue
        if role == "rollout":
            if spec.tensor_model_parallel_size or spec.pipeline_model_parallel_size:
                errors.append("placement.rollout: the rollout set's layout is "
                              "rollout.tensor_parallel_size (TP_g, no pipeline); set it there")
            else:  # TP_g replicas, each holding every layer
                sets[role] = RoleSet(tuple(ranks), cfg.rollout.tensor_parallel_size, 1)
            continue
        sets[role] = _with_layout(RoleSet(tuple(ranks), 1, 1), p, spec.tensor_model_parallel_size,
                                  spec.pipeline_model_parallel_size)
    if errors or "actor" not in sets:
        return None, errors
    for role in roles:  # roles left out go where the actor is, with their own layout defaults
        if role not in sets:
            sets[role] = _with_layout(sets["actor"], p, None, None)
    errors += _set_errors(sets, world, cfg)
    return (None if errors else Placement(world, sets)), errors


def _why_absent(role: str) -> str:
    return {"reference": "no KL term: actor.use_kl_loss and algorithm.use_kl_in_reward are off",
            "critic": "only algorithm.adv_estimator=gae uses one",
            "reward_model": "reward.sources has no source of type reward_model"}.get(role, "")


def _ranks_of(spec, key: str, world: int, gpus_per_node: Optional[int]) -> tuple[list[int], list[str]]:
    if (spec.ranks is None) == (spec.nodes is None):
        return [], [f"{key}: give exactly one of ranks (e.g. [4, 5]) and nodes (e.g. \"1\")"]
    try:
        if spec.ranks is not None:
            ranks = parse_ranks(spec.ranks, key)
            where = "GPU index / rank"
            beyond = [r for r in ranks if not 0 <= r < world]
            if beyond:
                return [], [f"{key}: {where} {format_ranks(beyond)} is beyond the job's {world} "
                            f"ranks (0-{world - 1})"]
        else:
            per_node = gpus_per_node or world
            nodes = parse_ranks(spec.nodes, key + ".nodes")
            count = world // per_node
            beyond = [n for n in nodes if not 0 <= n < count]
            if beyond:
                return [], [f"{key}.nodes: node {format_ranks(beyond)} is beyond the job's {count} "
                            f"node(s) of {per_node} GPUs (0-{count - 1})"]
            ranks = [n * per_node + g for n in nodes for g in range(per_node)]
    except ValueError as e:
        return [], [str(e)]
    if not ranks:
        return [], [f"{key}: no ranks"]
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        return [], [f"{key}: rank {format_ranks(twice)} is listed more than once"]
    return ranks, []


def _with_layout(base: RoleSet, p, tp: Optional[int], pp: Optional[int]) -> RoleSet:
    """`base`'s ranks at the given TP / PP, parallel.*'s where None (its virtual stages only
    with parallel.*'s PP)."""
    pp_ = pp or p.pipeline_model_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size if pp_ == p.pipeline_model_parallel_size else None
    return RoleSet(base.ranks, tp or p.tensor_model_parallel_size, pp_, p.context_parallel_size, vpp)


def _set_errors(sets: dict, world: int, cfg) -> list[str]:
    errors = []
    items = list(sets.items())
    p = cfg.parallel
    default = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size)
    for i, (role, s) in enumerate(items):
        if role == "rollout":
            continue  # its own rules below
        size = s.tp * s.pp * s.cp
        # Colocated at parallel.*: config/validate.py's world-size rule says it for the job.
        everywhere = len(s.ranks) == world and (s.tp, s.pp, s.cp) == default
        if len(s.ranks) % size and not everywhere:
            where = "parallel" if role == "actor" else f"placement.{role}"
            errors.append(
                f"placement.{role}: {len(s.ranks)} rank(s) {format_ranks(s.ranks)} cannot hold "
                f"TP×PP×CP = {s.tp}×{s.pp}×{s.cp} = {size}: the set size must be a multiple of it "
                f"(set {where}.tensor_model_parallel_size / pipeline_model_parallel_size, or give "
                f"the role more ranks)")
        for other, t in items[:i]:
            shared = set(s.ranks) & set(t.ranks)
            if shared and set(s.ranks) != set(t.ranks):
                errors.append(
                    f"placement.{other} ({format_ranks(t.ranks)}) and placement.{role} "
                    f"({format_ranks(s.ranks)}) share rank(s) {format_ranks(shared)} but are not "
                    f"the same set: roles share ranks only as identical sets")
            elif shared and s.ranks != t.ranks:
                errors.append(f"placement.{other} and placement.{role} hold the same ranks in "
                              f"another order ({list(t.ranks)} vs {list(s.ranks)}): write them "
                              f"in one order")
    idle = sorted(set(range(world)) - {r for s in sets.values() for r in s.ranks})
    if idle:
        errors.append(f"rank(s) {format_ranks(idle)} of the job's {world} run no role: add them to "
                      f"a role in placement.*, or start {world - len(idle)} ranks")
    actor, tp_g = sets["actor"], cfg.rollout.tensor_parallel_size
    if "rollout" in sets:
        errors += _rollout_set_errors(sets, tp_g)
    elif len(actor.ranks) % tp_g and len(actor.ranks) < world:  # else validate's world rule
        errors.append(f"rollout.tensor_parallel_size={tp_g} does not fit the actor's "
                      f"{len(actor.ranks)} rank(s) {format_ranks(actor.ranks)}: each generation "
                      f"replica is TP_g ranks of the actor set")
    if cfg.parallel.expert_model_parallel_size > 1 and not all(len(s.ranks) == world for s in sets.values()):
        errors.append("parallel.expert_model_parallel_size > 1 runs colocated only: leave "
                      "placement.* unset")
    return errors


def _rollout_set_errors(sets: dict, tp_g: int) -> list[str]:
    """placement.rollout: GPUs of its own (no training role on them), whole TP_g replicas, and
    not rank 0, which keeps the run's records (metrics, validation, checkpoint bookkeeping)."""
    errors, ranks = [], sets["rollout"].ranks
    for role, s in sets.items():
        shared = set(ranks) & set(s.ranks)
        if role != "rollout" and shared:
            errors.append(f"placement.rollout ({format_ranks(ranks)}) shares rank(s) "
                          f"{format_ranks(shared)} with placement.{role}: the rollout set runs on "
                          f"GPUs of its own (leave placement.rollout unset to generate on the "
                          f"actor's ranks)")
    if len(ranks) % tp_g:
        errors.append(f"placement.rollout: {len(ranks)} rank(s) {format_ranks(ranks)} do not "
                      f"divide into replicas of rollout.tensor_parallel_size={tp_g}")
    if 0 in ranks:
        errors.append(f"placement.rollout ({format_ranks(ranks)}) holds rank 0, which keeps the "
                      f"run's records (metrics, validation, checkpoints): give the rollout set "
                      f"other ranks, e.g. the job's last GPUs")
    return errors


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
        import datetime

        import torch.distributed as dist

        from verl_mcore.distributed.groups import GroupLayout, build_set_groups

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
        from verl_mcore.engine.engine import training_device

        if self._everywhere(role):
            return compute().to(training_device())
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
        return out.to(training_device()) if out is not None else None

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
        import torch.distributed as dist

        from verl_mcore.distributed.groups import collective_device

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
        import torch.distributed as dist

        from verl_mcore.distributed.groups import collective_device

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

    def share_rollout(self, part, prompts, vocab_size: int,
                      failure: Optional[BaseException] = None):
        """The generating set's gathered rollout batch (rollout.gather.RolloutPart; the rollout
        set's with placement.rollout, else the actor's) on every rank, broadcast as tensors from
        that set's first rank (rollout.gather.broadcast_part); the dataset rows are not sent,
        each rank takes them from its own copy of the batch's prompts (`prompts`, the global
        batch on ranks outside the generating set: their loader hands out all of it).

        `failure`: what stopped this generating rank's work; the first rank's is agreed in the
        broadcast's header, so every rank raises instead of waiting for a batch that will not
        come."""
        from verl_mcore.rollout.gather import broadcast_part

        generating = self.placement.ranks(self.generating_set)
        if len(generating) == self.placement.world:
            if failure is not None:
                raise failure
            return part
        src = generating[0]
        rows = None if self.rank in generating else prompts.rows
        return broadcast_part(part, src, None, vocab_size, rows, failure=failure,
                              who=f"the {self.generating_set} set ({format_ranks(generating)})")

    def gather_metrics(self, metrics: dict, step: int) -> dict:
        """Every rank's metrics of the step merged on every rank (each role's from its own set),
        plus each set's phase times as `timing_s/<set>/<phase>` (<set>: its roles joined by
        '+'); raises on every rank when a set's work failed this step (`run`). Small dicts of
        floats, once a step."""
        import torch.distributed as dist

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
                raise _failure_class(kind)(
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


class RoleSetFailure(RuntimeError):
    """Raised on the ranks of other sets when a role set's phase failed."""


def _failure_class(kind: str) -> type:
    """The failing set's exception class where the trainer treats it specially (every rank then
    stops the same way: NonFiniteError commits pending saves), else RoleSetFailure."""
    from verl_mcore import trainer
    from verl_mcore.reward.manager import RewardFailureError
    from verl_mcore.rollout.sync_check import WeightSyncError

    known = {"NonFiniteError": trainer.NonFiniteError, "RewardFailureError": RewardFailureError,
             "WeightSyncError": WeightSyncError}
    return known.get(kind, RoleSetFailure)
