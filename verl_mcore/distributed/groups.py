"""Process groups, built once and passed explicitly.

Training layout: megatron-core `parallel_state` with TP × CP × (EP) × DP × PP in megatron's default
order "tp-cp-ep-dp-pp", so a TP group is a run of consecutive ranks.
Generation layout: TP_g = rollout.tensor_parallel_size, no PP, DP_g = world / TP_g, with TP_g
dividing TP_t (k = TP_t / TP_g). Inside each training TP group, runs of k consecutive ranks are
"micro-DP" groups: all-gathering their k training shards yields one contiguous TP_g shard (the
same slice megatron would give that rank at TP_g). A generation TP group takes one rank from each
micro-DP group (stride k), so its members hold the TP_g shards 0..TP_g-1 (HybridFlow's scheme;
with PP > 1, the stages are first gathered within the pipeline group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class GroupLayout:
    """Pure rank arithmetic for a layout: which global ranks form each group. No communication."""

    world_size: int
    tp: int
    pp: int
    cp: int = 1
    tp_gen: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_gen(self) -> int:
        return self.world_size // self.tp_gen

    @property
    def micro_dp(self) -> int:
        return self.tp // self.tp_gen

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank: training (megatron order tp-cp-dp-pp, tp fastest) and
        generation (tp_gen: its TP_g shard index; dp_gen: its generation replica)."""
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        k = self.micro_dp
        replica_in_tp_group = tp_rank % k
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank,
                "tp_gen": tp_rank // k, "micro_dp": replica_in_tp_group,
                "dp_gen": (rank // self.tp) * k + replica_in_tp_group}

    def tp_groups(self) -> list[list[int]]:
        return [list(range(s, s + self.tp)) for s in range(0, self.world_size, self.tp)]

    def pp_groups(self) -> list[list[int]]:
        stride = self.world_size // self.pp
        return [list(range(s, self.world_size, stride)) for s in range(stride)]

    def dp_groups(self) -> list[list[int]]:
        block = self.tp * self.cp * self.dp  # ranks of one pipeline stage
        groups = []
        for stage in range(self.pp):
            for inner in range(self.tp * self.cp):
                groups.append([stage * block + inner + d * self.tp * self.cp for d in range(self.dp)])
        return groups

    def gen_tp_groups(self) -> list[list[int]]:
        k = self.micro_dp
        return [tp_group[j::k] for tp_group in self.tp_groups() for j in range(k)]

    def gen_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same TP_g shard: one per generation replica."""
        return [[r for r in range(self.world_size) if self.coords(r)["tp_gen"] == g]
                for g in range(self.tp_gen)]

    def micro_dp_groups(self) -> list[list[int]]:
        """Runs of k = TP_t / TP_g consecutive ranks inside each training TP group."""
        k = self.micro_dp
        return [tp_group[i:i + k] for tp_group in self.tp_groups() for i in range(0, self.tp, k)]


@dataclass(frozen=True)
class ParallelGroups:
    """Everything a rank needs to know about its groups; held once, passed explicitly."""

    layout: GroupLayout
    rank: int
    # megatron-core ProcessGroupCollection for the training model (tp, pp, dp, cp, ...)
    train: Any
    gen_tp: Any
    gen_dp: Any
    micro_dp: Any
    # ProcessGroupCollection for a generation-layout model (tp = gen_tp; pp, cp, embd = this rank)
    gen: Any = None

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)["tp"]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)["pp"]

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)["dp"]

    @property
    def gen_tp_rank(self) -> int:
        return self.layout.coords(self.rank)["tp_gen"]

    @property
    def gen_dp_rank(self) -> int:
        return self.layout.coords(self.rank)["dp_gen"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


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


def build_groups(cfg, distributed_timeout_minutes: int = 30) -> ParallelGroups:
    """Initialise megatron-core parallel_state from `cfg.parallel` and add the generation groups.

    torch.distributed must already be initialised (see launch.init_distributed).
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    p = cfg.parallel
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = GroupLayout(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                         p.context_parallel_size, cfg.rollout.tensor_parallel_size)
    vpp = p.virtual_pipeline_model_parallel_size
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=p.expert_model_parallel_size,
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
        gen=ProcessGroupCollection(tp=gen_tp, pp=alone, cp=alone, embd=alone, pos_embd=alone,
                                   dp=gen_dp, dp_cp=gen_dp, mp=gen_tp, tp_cp=gen_tp),
    )


def destroy_groups() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
