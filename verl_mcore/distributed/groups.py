"""Process groups, built once and passed explicitly.

Training layout: TP × CP × (EP) × DP × PP in megatron's default order "tp-cp-ep-dp-pp", so a TP
group is a run of consecutive ranks of the layout's set.
Generation layout: TP_g = rollout.tensor_parallel_size, no PP, DP_g = set size / TP_g, with TP_g
dividing TP_t (k = TP_t / TP_g). Inside each training TP group, runs of k consecutive ranks are
"micro-DP" groups: all-gathering their k training shards yields one contiguous TP_g shard (the
same slice megatron would give that rank at TP_g). A generation TP group takes one rank from each
micro-DP group (stride k), so its members hold the TP_g shards 0..TP_g-1 (HybridFlow's scheme;
with PP > 1, the stages are first gathered within the pipeline group).

Role sets (placement): a layout lives on a set of global ranks (`GroupLayout.ranks`); the
arithmetic runs on local indices 0..n-1 and every group is returned in global ranks (local i ->
ranks[i]). `build_set_groups` builds the groups of every set on every rank. Colocated (one
layout over the whole world in rank order) it initialises megatron's parallel_state exactly as
before; otherwise parallel_state is left uninitialised and each set gets a hand-built
ProcessGroupCollection, so a megatron call that falls back to the global groups fails loudly
("... is not initialized") instead of reducing over the wrong ranks.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch.distributed as dist


@dataclass(frozen=True)
class GroupLayout:
    """Pure rank arithmetic for a layout: which global ranks form each group. No communication.

    world_size: the size of the layout's set; ranks: its global ranks in order (None: 0..n-1).
    vpp: virtual pipeline stages per rank (None or 1: none)."""

    world_size: int
    tp: int
    pp: int
    cp: int = 1
    tp_gen: int = 1
    ranks: Optional[tuple[int, ...]] = None
    vpp: Optional[int] = None

    def __post_init__(self):
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(self.ranks))
            if len(self.ranks) != self.world_size:
                raise ValueError(f"GroupLayout: world_size={self.world_size} but {len(self.ranks)} "
                                 f"ranks {list(self.ranks)}")

    @property
    def members(self) -> tuple[int, ...]:
        """The set's global ranks, in order."""
        return self.ranks if self.ranks is not None else tuple(range(self.world_size))

    def index(self, rank: int) -> int:
        """The local index of global `rank` in this set (ValueError naming the set if absent)."""
        try:
            return self.members.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in this layout's set {list(self.members)}") from None

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_gen(self) -> int:
        return self.world_size // self.tp_gen

    @property
    def micro_dp(self) -> int:
        return self.tp // self.tp_gen

    def coords(self, index: int) -> dict[str, int]:
        """Coordinates of the set's local index `index` (a global rank when the set is the whole
        world in order): training (megatron order tp-cp-dp-pp, tp fastest) and generation
        (tp_gen: its TP_g shard index; dp_gen: its generation replica)."""
        tp_rank = index % self.tp
        cp_rank = (index // self.tp) % self.cp
        dp_rank = (index // (self.tp * self.cp)) % self.dp
        pp_rank = index // (self.tp * self.cp * self.dp)
        k = self.micro_dp
        replica_in_tp_group = tp_rank % k
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank,
                "tp_gen": tp_rank // k, "micro_dp": replica_in_tp_group,
                "dp_gen": (index // self.tp) * k + replica_in_tp_group}

    def _global(self, groups: list[list[int]]) -> list[list[int]]:
        m = self.members
        return [[m[i] for i in g] for g in groups]

    def _local_tp(self) -> list[list[int]]:
        return [list(range(s, s + self.tp)) for s in range(0, self.world_size, self.tp)]

    def _local_by(self, *varying: str) -> list[list[int]]:
        """Local groups whose members differ only in the coordinates `varying` (each group in
        increasing index order, groups by their first member)."""
        fixed = [c for c in ("tp", "cp", "dp", "pp") if c not in varying]
        by_key: dict[tuple, list[int]] = {}
        for i in range(self.world_size):
            c = self.coords(i)
            by_key.setdefault(tuple(c[f] for f in fixed), []).append(i)
        return sorted(by_key.values(), key=lambda g: g[0])

    def tp_groups(self) -> list[list[int]]:
        return self._global(self._local_tp())

    def pp_groups(self) -> list[list[int]]:
        stride = self.world_size // self.pp
        return self._global([list(range(s, self.world_size, stride)) for s in range(stride)])

    def dp_groups(self) -> list[list[int]]:
        block = self.tp * self.cp * self.dp  # ranks of one pipeline stage
        groups = []
        for stage in range(self.pp):
            for inner in range(self.tp * self.cp):
                groups.append([stage * block + inner + d * self.tp * self.cp for d in range(self.dp)])
        return self._global(groups)

    def cp_groups(self) -> list[list[int]]:
        return self._global(self._local_by("cp"))

    def dp_cp_groups(self) -> list[list[int]]:
        return self._global(self._local_by("dp", "cp"))

    def tp_cp_groups(self) -> list[list[int]]:
        return self._global(self._local_by("tp", "cp"))

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (TP × PP: one model replica), megatron's 'tp-pp'."""
        return self._global(self._local_by("tp", "pp"))

    def stage_groups(self) -> list[list[int]]:
        """All ranks of one pipeline stage (TP × CP × DP), megatron's tp-dp-cp group."""
        return self._global(self._local_by("tp", "cp", "dp"))

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline group (tied embeddings' gradient sync); the one
        rank of the group when PP = 1 (megatron's default embedding ranks)."""
        return [sorted({g[0], g[-1]}, key=g.index) for g in self.pp_groups()]

    def position_embedding_groups(self) -> list[list[int]]:
        return [[g[0]] for g in self.pp_groups()]

    def gen_tp_groups(self) -> list[list[int]]:
        k = self.micro_dp
        return [tp_group[j::k] for tp_group in self.tp_groups() for j in range(k)]

    def gen_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same TP_g shard: one per generation replica."""
        return self._global([[i for i in range(self.world_size) if self.coords(i)["tp_gen"] == g]
                             for g in range(self.tp_gen)])

    def micro_dp_groups(self) -> list[list[int]]:
        """Runs of k = TP_t / TP_g consecutive ranks inside each training TP group."""
        k = self.micro_dp
        return [tp_group[i:i + k] for tp_group in self.tp_groups() for i in range(0, self.tp, k)]

    def key(self) -> tuple:
        """What makes two layouts share their groups: the same ranks and sizes."""
        return (self.members, self.tp, self.pp, self.cp, self.tp_gen, self.vpp or 1)


@dataclass(frozen=True)
class ParallelGroups:
    """Everything a rank needs to know about its groups in one role set; held once, passed
    explicitly. `rank` is this process's global rank; every coordinate (tp_rank, dp_rank,
    gen_dp_rank, ...) is its position inside the set."""

    layout: GroupLayout
    rank: int
    # megatron-core ProcessGroupCollection for the training model (tp, pp, dp, cp, ...)
    train: Any
    gen_tp: Any
    gen_dp: Any
    micro_dp: Any
    # ProcessGroupCollection for a generation-layout model (tp = gen_tp; pp, cp, embd = this rank)
    gen: Any = None
    # Every rank of the set (collectives over the whole role); the world when colocated.
    whole: Any = None

    @property
    def index(self) -> int:
        """This rank's local index in its set."""
        return self.layout.index(self.rank)

    @property
    def members(self) -> tuple[int, ...]:
        """The set's global ranks."""
        return self.layout.members

    @property
    def leader(self) -> int:
        """Global rank of the set's first member: where the role's single copies are written."""
        return self.layout.members[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def _coord(self, name: str) -> int:
        return self.layout.coords(self.index)[name]

    @property
    def tp_rank(self) -> int:
        return self._coord("tp")

    @property
    def pp_rank(self) -> int:
        return self._coord("pp")

    @property
    def dp_rank(self) -> int:
        return self._coord("dp")

    @property
    def cp_rank(self) -> int:
        return self._coord("cp")

    @property
    def gen_tp_rank(self) -> int:
        return self._coord("tp_gen")

    @property
    def gen_dp_rank(self) -> int:
        return self._coord("dp_gen")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def seed_rng(self, seed: int) -> None:
        """megatron's model-parallel RNG tracker seeded for this set's TP rank (dropout in TP
        regions, GPU weight init); its own default reads parallel_state, which a placed run does
        not initialise. One tracker per process: a rank of two layouts seeds with one of them."""
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=self.tp_rank, ep_rank=0,
                                                        etp_rank=self.tp_rank)


def collective_device(group=None):
    """Where a collective over `group` takes its tensors: NCCL moves only CUDA tensors (the
    current device), gloo only host ones."""
    import torch

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _new_subgroups(groups: list[list[int]], rank: int):
    """Create every group (all ranks must call new_group for each) and return the one holding rank."""
    mine = None
    for ranks in groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


class _GroupMaker:
    """new_group for every rank list of every set, in one order on all ranks (new_group is
    collective over the world); one group per distinct rank list (a single-rank set's tp, dp,
    pp, ... are all one group). `made` keeps them for destroy_groups."""

    made: list = []

    def __init__(self, timeout_minutes: int):
        self.timeout = datetime.timedelta(minutes=timeout_minutes)
        self.rank = dist.get_rank()
        self.cache: dict[tuple[int, ...], Any] = {}

    def mine(self, groups: list[list[int]]):
        """Create `groups` (every rank), return the one holding this rank (None if none)."""
        found = None
        for ranks in groups:
            key = tuple(ranks)
            if key not in self.cache:
                self.cache[key] = dist.new_group(list(key), timeout=self.timeout)
                _GroupMaker.made.append(self.cache[key])
            if self.rank in key:
                found = self.cache[key]
        return found


def generation_collection(gen_tp, gen_dp, alone, whole):
    """The ProcessGroupCollection of a generation-layout model: TP_g, no PP / CP, and every
    expert of a MoE model on each rank (EP_g = 1: the engine replicates experts and slices each
    over TP_g like a dense MLP, rollout/moe_mlp.py), so the expert groups are the dense ones."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=gen_tp, pp=alone, cp=alone, embd=alone, pos_embd=alone,
                                  dp=gen_dp, dp_cp=gen_dp, mp=gen_tp, tp_cp=gen_tp,
                                  ep=alone, expt_tp=gen_tp, tp_ep=gen_tp, tp_ep_pp=gen_tp,
                                  expt_dp=gen_dp, tp_dp_cp=whole)


def _set_groups(layout: GroupLayout, make: _GroupMaker) -> Optional[ParallelGroups]:
    """Every group of one set, created on every rank; this rank's ParallelGroups or None."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    lay = layout
    train = dict(
        tp=make.mine(lay.tp_groups()), pp=make.mine(lay.pp_groups()), dp=make.mine(lay.dp_groups()),
        cp=make.mine(lay.cp_groups()), dp_cp=make.mine(lay.dp_cp_groups()),
        tp_cp=make.mine(lay.tp_cp_groups()), mp=make.mine(lay.mp_groups()),
        embd=make.mine(lay.embedding_groups()), pos_embd=make.mine(lay.position_embedding_groups()),
        tp_dp_cp=make.mine(lay.stage_groups()),
    )
    whole = make.mine([list(lay.members)])
    alone = make.mine([[r] for r in lay.members])
    gen_tp = make.mine(lay.gen_tp_groups())
    gen_dp = make.mine(lay.gen_dp_groups())
    micro_dp = make.mine(lay.micro_dp_groups())
    if make.rank not in lay.members:
        return None
    # Without expert parallelism (placement refuses EP > 1): experts are split like the dense
    # layers (expert TP = TP, EP = 1), so their groups are the dense ones. The distributed
    # optimizer reduces its grad statistics over the whole set (one optimizer instance).
    train.update(ep=alone, expt_tp=train["tp"], tp_ep=train["tp"], tp_ep_pp=train["mp"],
                 expt_dp=train["dp_cp"], intra_dp_cp=train["dp_cp"],
                 intra_expt_dp=train["dp_cp"], intra_dist_opt=whole)
    return ParallelGroups(
        layout=lay, rank=make.rank, train=ProcessGroupCollection(**train),
        gen_tp=gen_tp, gen_dp=gen_dp, micro_dp=micro_dp,
        gen=generation_collection(gen_tp, gen_dp, alone, whole), whole=whole)


def build_set_groups(layouts: Sequence[GroupLayout],
                     distributed_timeout_minutes: int = 30,
                     expert_model_parallel_size: int = 1) -> list[Optional[ParallelGroups]]:
    """The process groups of every role set; per layout, this rank's ParallelGroups or None
    when it is not in that set. Collective: every rank of the world calls it with the same list.
    Identical layouts (same ranks and sizes) give the same object.

    One layout over the whole world in rank order (the colocated default): megatron's
    parallel_state is initialised from it and its groups are used, exactly as build_groups
    always did. Otherwise parallel_state stays uninitialised and each set's groups are built
    here (see the module docstring)."""
    for lay in layouts:
        if lay.world_size % (lay.tp * lay.pp * lay.cp):
            raise ValueError(f"build_set_groups: the set {list(lay.members)} ({lay.world_size} "
                             f"ranks) does not divide into TP×PP×CP = {lay.tp}×{lay.pp}×{lay.cp}")
    keys = [lay.key() for lay in layouts]
    distinct = list(dict.fromkeys(keys))
    world = dist.get_world_size()
    if len(distinct) == 1 and layouts[0].members == tuple(range(world)):
        groups = _colocated_groups(layouts[0], distributed_timeout_minutes,
                                   expert_model_parallel_size)
        return [groups for _ in layouts]
    if expert_model_parallel_size != 1:
        raise ValueError(f"expert_model_parallel_size={expert_model_parallel_size}: role sets "
                         "of their own (placement.*) are built without expert parallelism; "
                         "run colocated or set it to 1")
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_set_groups: megatron's parallel_state is already initialised; "
                           "role sets of their own must not see its world-wide groups "
                           "(destroy_groups() first)")
    make = _GroupMaker(distributed_timeout_minutes)
    by_key = {}
    for lay, key in zip(layouts, keys):
        if key not in by_key:
            by_key[key] = _set_groups(lay, make)
    return [by_key[k] for k in keys]


def _colocated_groups(layout: GroupLayout, distributed_timeout_minutes: int,
                      expert_model_parallel_size: int) -> ParallelGroups:
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    vpp = layout.vpp
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=expert_model_parallel_size,
        distributed_timeout_minutes=distributed_timeout_minutes,
    )
    # Our rank arithmetic must agree with megatron's, or every later slice would be wrong.
    assert parallel_state.get_tensor_model_parallel_rank() == layout.coords(rank)["tp"]
    assert parallel_state.get_pipeline_model_parallel_rank() == layout.coords(rank)["pp"]
    assert parallel_state.get_data_parallel_rank() == layout.coords(rank)["dp"]
    gen_tp = _new_subgroups(layout.gen_tp_groups(), rank)
    gen_dp = _new_subgroups(layout.gen_dp_groups(), rank)
    micro_dp = _new_subgroups(layout.micro_dp_groups(), rank)
    alone = _new_subgroups([[r] for r in range(world)], rank)
    return ParallelGroups(
        layout=layout,
        rank=rank,
        train=ProcessGroupCollection.use_mpu_process_groups(),
        gen_tp=gen_tp,
        gen_dp=gen_dp,
        micro_dp=micro_dp,
        gen=generation_collection(gen_tp, gen_dp, alone, dist.group.WORLD),
        whole=dist.group.WORLD,
    )


def build_groups(cfg, distributed_timeout_minutes: int = 30) -> ParallelGroups:
    """The colocated groups of `cfg.parallel` over the whole world (every role on every rank):
    megatron-core parallel_state initialised, plus the generation groups.

    torch.distributed must already be initialised (see launch.init_distributed).
    """
    p = cfg.parallel
    layout = GroupLayout(dist.get_world_size(), p.tensor_model_parallel_size,
                         p.pipeline_model_parallel_size, p.context_parallel_size,
                         cfg.rollout.tensor_parallel_size,
                         vpp=p.virtual_pipeline_model_parallel_size)
    return build_set_groups([layout], distributed_timeout_minutes,
                            p.expert_model_parallel_size)[0]


def destroy_groups() -> None:
    """megatron's parallel_state and the role sets' groups built here."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    for group in _GroupMaker.made:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # already destroyed (a test pool's reset)
            pass
    _GroupMaker.made.clear()
