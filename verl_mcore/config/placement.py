"""The placement section resolved for a job of `world` ranks: which ranks run each role, with
its layout (TP, PP, CP, DP), and every problem of it named by its key.

    placement:                      # 8 ranks on one node
      actor: [0, 1, 2, 3]           # with its rollout engine (and the reference, left out)
      critic: [4, 5]
      reward_model: [6, 7]

`Placement` is the pure rank arithmetic and its checks (no communication: config validation and
the planner use it); distributed/placement.py's `RolePlacement` adds this rank's process groups
and the exchanges between the sets.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from verl_mcore.config.schema import RoleSetConfig
from verl_mcore.errors import ConfigError

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
