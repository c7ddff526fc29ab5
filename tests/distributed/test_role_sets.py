"""Roles on role sets of their own (placement), with megatron's parallel_state never initialised:
on 4 gloo ranks the actor trains on A=[0,1] at TP=2, the critic on B=[2] at TP=1 and the
reward model scores on C=[3]; each set's losses, gradient norms and scores equal the colocated
1-rank run of the same weights and data (the tolerances of tests/engine/test_layouts.py). A
PP=2 set [2,3] beside a TP=2 set [0,1] trains the actor as the 1-rank run does."""
from __future__ import annotations

import pytest

from tests.models import hf_factory
from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

REL = 1e-4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("role_sets")
    out = {"actor": hf_factory.save_tiny_model("qwen2", str(root / "actor"), seed=1,
                                               vocab_size=256),
           "rm": hf_factory.save_tiny_model("qwen2", str(root / "rm"), seed=3, seq_cls=True,
                                            vocab_size=256)}
    for d in out.values():  # within the 256 embeddings (see tests/engine/test_reward_model.py)
        hf_factory.write_tokenizer(d, 250)
    return out


def _config(dirs, tp):
    from verl_mcore.config import Config

    return Config.load(None, [
        f"model.path={dirs['actor']}", f"parallel.tensor_model_parallel_size={tp}",
        "reward.sources=[{name: rm, type: reward_model, path: " + dirs["rm"]
        + ", dtype: fp32, max_tokens_per_microbatch: 24}]"])


def _actor_step(cfg, groups, info):
    import torch

    from tests.engine import common as C
    from verl_mcore import build
    from verl_mcore.engine.actor import Actor

    torch.manual_seed(0)
    acfg = C.actor_config(max_tokens_per_microbatch=40, ppo_epochs=1)
    engine = build.build_engine(cfg, groups, info, "actor", "fp32", optim=acfg.optim)
    _, steps = Actor(engine, acfg, mini_batch_size=16).update(C.make_batch(seed=1, num=16))
    return [(s["loss"], s["grad_norm"], s["entropy"]) for s in steps]


def _critic_step(cfg, groups, info):
    import torch

    from tests.engine import common as C
    from verl_mcore import build
    from verl_mcore.config.schema import CriticConfig
    from verl_mcore.engine.critic import Critic

    torch.manual_seed(0)
    ccfg = CriticConfig(max_tokens_per_microbatch=32, optim=C.optim_config(lr=1e-2))
    engine = build.build_engine(cfg, groups, info, "critic", "fp32", optim=ccfg.optim)
    _, steps = Critic(engine, ccfg, mini_batch_size=16, ppo_epochs=1).update(
        C.make_batch(seed=1, num=16))
    return [(s["loss"], s["grad_norm"]) for s in steps]


def _rm_scores(cfg, groups, info):
    from tests.engine import common as C
    from verl_mcore import build

    scorer = build.build_reward_models(cfg, groups, info)["rm"]
    return scorer.score(C.make_batch(seed=2, num=6), rows=[{}] * 6, responses=[""] * 6)


def _colocated_body(rank, world_size, dirs):
    from verl_mcore import build
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups, destroy_groups

    cpu_compat.install()
    cfg = _config(dirs, 1)
    groups = build_groups(cfg)
    try:
        info = build.load_model_info(cfg)
        return {"actor": _actor_step(cfg, groups, info), "critic": _critic_step(cfg, groups, info),
                "rm": _rm_scores(cfg, groups, info)}
    finally:
        destroy_groups()


def _placed_body(rank, world_size, dirs, sets):
    """sets: [(role, ranks, tp, pp)]; each rank runs the role of its set."""
    from megatron.core import parallel_state

    from verl_mcore import build
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import GroupLayout, build_set_groups, destroy_groups

    cpu_compat.install()
    cfg = _config(dirs, 2)  # the actor's TP: the run's padded vocabulary
    layouts = [GroupLayout(len(ranks), tp, pp, ranks=ranks) for _, ranks, tp, pp in sets]
    built = build_set_groups(layouts, 5)
    try:
        assert not parallel_state.model_parallel_is_initialized()
        mine = [(role, g) for (role, *_), g in zip(sets, built) if g is not None]
        assert len(mine) == 1, mine
        role, groups = mine[0]
        assert groups.members == sets[[s[0] for s in sets].index(role)][1]
        info = build.load_model_info(cfg)
        step = {"actor": _actor_step, "critic": _critic_step, "rm": _rm_scores}[role.split(":")[0]]
        return {"role": role, "result": step(cfg, groups, info), "leader": groups.leader,
                "index": groups.index}
    finally:
        destroy_groups()


def _close(name, got, want):
    import torch

    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    err = ((got - want).abs() / want.abs().clamp(min=1e-3)).max().item()
    assert err <= REL, f"{name}: max relative error {err:.2e} > {REL}\n got {got.tolist()}\n want {want.tolist()}"


@pytest.fixture(scope="module")
def oracle(dirs):
    return run_on_ranks(_colocated_body, 1, args=(dirs,), timeout=240)[0]


def test_roles_on_their_own_sets_match_the_colocated_run(dirs, oracle):
    sets = [("actor", (0, 1), 2, 1), ("critic", (2,), 1, 1), ("rm", (3,), 1, 1)]
    results = run_on_ranks(_placed_body, 4, args=(dirs, sets), timeout=300)
    assert [r["role"] for r in results] == ["actor", "actor", "critic", "rm"]
    assert [r["leader"] for r in results] == [0, 0, 2, 3]
    assert [r["index"] for r in results] == [0, 1, 0, 0]
    for rank, r in enumerate(results):
        if r["role"] == "rm":
            diff = (r["result"] - oracle["rm"]).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} reward-model scores: max abs diff {diff:.2e}"
        else:
            _close(f"rank {rank} {r['role']} (loss, grad_norm, ...)", r["result"], oracle[r["role"]])


def test_a_pipeline_set_beside_a_tensor_parallel_set(dirs, oracle):
    sets = [("actor", (0, 1), 2, 1), ("actor:pp", (2, 3), 1, 2)]
    results = run_on_ranks(_placed_body, 4, args=(dirs, sets), timeout=300)
    for rank, r in enumerate(results):
        _close(f"rank {rank} {r['role']}", r["result"], oracle["actor"])
