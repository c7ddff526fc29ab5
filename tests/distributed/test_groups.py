import pytest

from tests.multiproc import run_on_ranks
from verl_mcore.distributed.groups import GroupLayout


def test_layout_arithmetic_tp4_pp2_gen2():
    lay = GroupLayout(world_size=16, tp=4, pp=2, tp_gen=2)
    assert lay.dp == 2 and lay.dp_gen == 8 and lay.micro_dp == 2
    assert lay.tp_groups()[1] == [4, 5, 6, 7]
    assert lay.pp_groups()[0] == [0, 8]
    assert lay.dp_groups()[0] == [0, 4] and lay.dp_groups()[4] == [8, 12]
    # micro-DP: consecutive pairs inside a training TP group; their two TP_4 shards form a TP_2 shard
    assert lay.micro_dp_groups()[2] == [4, 5] and lay.micro_dp_groups()[3] == [6, 7]
    # a generation TP group takes one rank of each micro-DP group: TP_2 shards 0 and 1
    assert [4, 6] in lay.gen_tp_groups() and [5, 7] in lay.gen_tp_groups()
    assert lay.coords(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1, "tp_gen": 0, "micro_dp": 1,
                              "dp_gen": 7}
    # every rank is in exactly one group of each kind
    for groups in (lay.tp_groups(), lay.pp_groups(), lay.dp_groups(), lay.gen_tp_groups(),
                   lay.gen_dp_groups(), lay.micro_dp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(16))
    # generation replicas: each gen TP group has members with tp_gen 0..TP_g-1 and one dp_gen
    for g in lay.gen_tp_groups():
        assert [lay.coords(r)["tp_gen"] for r in g] == list(range(lay.tp_gen))
        assert len({lay.coords(r)["dp_gen"] for r in g}) == 1
    assert sorted({lay.coords(r)["dp_gen"] for r in range(16)}) == list(range(8))


def test_layout_gen_equals_train_tp():
    lay = GroupLayout(world_size=4, tp=2, pp=1, tp_gen=2)
    assert lay.gen_tp_groups() == lay.tp_groups() and lay.micro_dp_groups() == [[0], [1], [2], [3]]


def _build(rank, world_size, tp, pp, tp_gen):
    import torch
    import torch.distributed as dist

    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups, destroy_groups

    cpu_compat.install()
    cfg = Config.load(None, [f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.pipeline_model_parallel_size={pp}",
                             f"rollout.tensor_parallel_size={tp_gen}"])
    g = build_groups(cfg)
    out = {}
    for name, group in [("tp", g.train.tp), ("pp", g.train.pp), ("dp", g.train.dp),
                        ("gen_tp", g.gen_tp), ("gen_dp", g.gen_dp), ("micro_dp", g.micro_dp)]:
        members = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, rank, group=group)
        out[name] = members
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g.gen_tp)
    out["gen_tp_sum"] = t.item()
    destroy_groups()
    return out


@pytest.mark.distributed
def test_build_groups_matches_layout_on_4_ranks():
    results = run_on_ranks(_build, 4, args=(2, 2, 1), timeout=180)
    lay = GroupLayout(4, tp=2, pp=2, tp_gen=1)
    for rank, r in enumerate(results):
        assert r["tp"] in lay.tp_groups() and rank in r["tp"]
        assert r["pp"] in lay.pp_groups() and rank in r["pp"]
        assert r["dp"] == [rank]
        assert r["gen_tp"] == [rank] and r["gen_dp"] == [0, 1, 2, 3]
        assert r["micro_dp"] in lay.micro_dp_groups() and len(r["micro_dp"]) == 2
        assert r["micro_dp"] == lay.tp_groups()[rank // 2]
        assert r["gen_tp_sum"] == rank


def test_layout_on_an_offset_set_returns_global_ranks():
    """A role set [4..7] at TP=2 × PP=2: the same groups as ranks 0..3, shifted by 4."""
    base = GroupLayout(4, tp=2, pp=2, tp_gen=1)
    lay = GroupLayout(4, tp=2, pp=2, tp_gen=1, ranks=(4, 5, 6, 7))
    shift = lambda groups: [[r + 4 for r in g] for g in groups]  # noqa: E731
    for name in ("tp_groups", "pp_groups", "dp_groups", "gen_tp_groups", "gen_dp_groups",
                 "micro_dp_groups", "mp_groups", "dp_cp_groups", "embedding_groups"):
        assert getattr(lay, name)() == shift(getattr(base, name)()), name
    assert lay.coords(lay.index(6)) == base.coords(2)
    assert lay.embedding_groups() == [[4, 6], [5, 7]]
    with pytest.raises(ValueError, match="rank 1 is not in this layout's set"):
        lay.index(1)


def test_layout_on_a_non_contiguous_set():
    """Ranks (1, 3, 6, 7) at TP=2, DP=2, TP_g=1: local index i is global rank ranks[i]."""
    lay = GroupLayout(4, tp=2, pp=1, tp_gen=1, ranks=(1, 3, 6, 7))
    assert lay.tp_groups() == [[1, 3], [6, 7]]
    assert lay.dp_groups() == [[1, 6], [3, 7]]
    assert lay.pp_groups() == [[1], [3], [6], [7]]
    assert lay.micro_dp_groups() == [[1, 3], [6, 7]]
    assert lay.gen_tp_groups() == [[1], [3], [6], [7]]
    assert lay.gen_dp_groups() == [[1, 3, 6, 7]]
    assert lay.embedding_groups() == [[1], [3], [6], [7]]
    assert lay.coords(lay.index(7)) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0, "tp_gen": 0,
                                        "micro_dp": 1, "dp_gen": 3}
    with pytest.raises(ValueError, match="world_size=3 but 4 ranks"):
        GroupLayout(3, tp=1, pp=1, ranks=(1, 3, 6, 7))
    assert GroupLayout(4, 2, 1).key() == GroupLayout(4, 2, 1, ranks=(0, 1, 2, 3)).key()
