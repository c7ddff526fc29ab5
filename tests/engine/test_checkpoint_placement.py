"""Checkpoints of roles on sets of their own, in the one format colocated runs write: on 4 gloo
ranks the actor on [0, 1] at TP=2 and the critic on [2] at TP=1 (rank 3 holds neither) save
through RunCheckpoints, every rank taking part; a colocated run at TP=2 × DP=2 resumes from that
checkpoint, and the placed run from a colocated one. The oracle is the run that did not stop:
the two optimizer steps after the resume give its losses and gradient norms (model, Adam
moments and step, LR schedule all show in the second step), and the trainer state comes back."""
from __future__ import annotations

from functools import partial

import pytest

from tests.engine.test_checkpoint_layouts import _children_allowed
from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

REL = 1e-4
ACTOR, CRITIC = (0, 1), (2,)


def _weights():
    from tests.engine import common as C

    return C.reference_weights("actor"), C.reference_weights("critic", seed=3)


def _provider(role, pg):
    from tests.engine import common as C
    from verl_mcore.models.gpt import build_gpt_model

    def build(config, pre_process, post_process, vp_stage):
        return build_gpt_model(C.arch(), config, role=role, pre_process=pre_process,
                               post_process=post_process, vp_stage=vp_stage, use_te=False,
                               vocab_divisible_by=C.VOCAB // 2, pg_collection=pg)

    return build


def _roles(full, pgs):
    """(actor, critic) on this rank: pgs = {role: ProcessGroupCollection or None}."""
    import torch

    from tests.distributed.tiny_gpt import load_sharded
    from tests.engine import common as C
    from verl_mcore.config.schema import CriticConfig
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.critic import Critic
    from verl_mcore.engine.engine import MegatronEngine

    acfg = C.actor_config(ppo_epochs=1)
    ccfg = CriticConfig(max_tokens_per_microbatch=32, optim=C.optim_config(lr=1e-2))
    out = []
    for role, weights, cfg in (("actor", full[0], acfg), ("critic", full[1], ccfg)):
        pg = pgs[role]
        if pg is None:
            out.append(None)
            continue
        torch.manual_seed(0)
        engine = MegatronEngine(_provider(role, pg), C.transformer_config(pg.tp.size()), pg,
                                dtype="fp32", optim=cfg.optim, lr_decay_steps=4,
                                load_weights=partial(load_sharded, full=weights, tp_group=pg.tp))
        out.append(Actor(engine, cfg, mini_batch_size=16) if role == "actor" else
                   Critic(engine, cfg, mini_batch_size=16, ppo_epochs=1))
    return out


def _steps(actor, critic, seeds):
    """Per step: (actor loss, grad norm) on the actor's ranks, (critic ...) on the critic's."""
    from tests.engine import common as C

    out = []
    for seed in seeds:
        batch = C.make_batch(seed=seed, num=16)
        row = {}
        for name, role in (("actor", actor), ("critic", critic)):
            if role is not None:
                _, steps = role.update(batch)
                row[name] = (steps[0]["loss"], steps[0]["grad_norm"])
        out.append(row)
    return out


def _checkpoints(root, placed):
    from verl_mcore.checkpoints import RunCheckpoints
    from verl_mcore.config.schema import CheckpointConfig

    return RunCheckpoints(CheckpointConfig(), root, with_critic=True,
                          role_ranks={"actor": ACTOR, "critic": CRITIC} if placed else None)


def _placed_pgs():
    from megatron.core import parallel_state

    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import GroupLayout, build_set_groups

    cpu_compat.install()
    actor, critic, _ = build_set_groups([GroupLayout(2, 2, 1, ranks=ACTOR),
                                         GroupLayout(1, 1, 1, ranks=CRITIC),
                                         GroupLayout(1, 1, 1, ranks=(3,))], 5)
    assert not parallel_state.model_parallel_is_initialized()
    return {"actor": actor and actor.train, "critic": critic and critic.train}


def _train_save_train(rank, world_size, root, full, placed, resume_root=None):
    """Step 1, save (trainer state {"step": 1}), steps 2 and 3. With resume_root: then fresh
    roles resumed from there, steps 2 and 3 again."""
    from tests.engine import common as C
    from verl_mcore.config.schema import CheckpointConfig
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import destroy_groups

    cpu_compat.install()
    pgs = _placed_pgs() if placed else {"actor": C.init_layout(tp=2), "critic": C.init_layout(tp=2)}
    try:
        actor, critic = _roles(full, pgs)
        out = {"first": _steps(actor, critic, [1])}
        with _children_allowed():
            ckpts = _checkpoints(root, placed)
            ckpts.save(1, actor, critic, {"step": 1})
            ckpts.close()
        out["after"] = _steps(actor, critic, [2, 3])
        if resume_root is not None:
            actor, critic = _roles(full, pgs)
            with _children_allowed():
                out["state"] = _checkpoints(resume_root, placed).resume(CheckpointConfig(),
                                                                        actor, critic)
            out["resumed"] = _steps(actor, critic, [2, 3])
        return out
    finally:
        destroy_groups()


def _weights_body(rank, world_size):
    from verl_mcore.distributed import cpu_compat

    cpu_compat.install()
    return _weights()


def _merged(results, key):
    """Per step {role: (loss, grad_norm)} from each role's first rank of a placed run."""
    return [{"actor": a["actor"], "critic": c["critic"]}
            for a, c in zip(results[ACTOR[0]][key], results[CRITIC[0]][key])]


def _close(name, got, want):
    import torch

    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    err = ((got - want).abs() / want.abs().clamp(min=1e-3)).max().item()
    assert err <= REL, f"{name}: max relative error {err:.2e} > {REL}\n got {got.tolist()}\n want {want.tolist()}"


def _compare(name, got_steps, want_steps):
    """Every role this rank ran (a placed rank runs one, or none)."""
    for role in ("actor", "critic"):
        got = [s[role] for s in got_steps if role in s]
        if got:
            _close(f"{name} {role} (loss, grad_norm)", got, [s[role] for s in want_steps])


def test_placed_and_colocated_checkpoints_resume_each_other(tmp_path):
    full = run_on_ranks(_weights_body, 1, (), timeout=120)[0]
    placed_root, colocated_root = str(tmp_path / "placed"), str(tmp_path / "colocated")
    placed = run_on_ranks(_train_save_train, 4, (placed_root, full, True), timeout=300)
    colocated = run_on_ranks(_train_save_train, 4, (colocated_root, full, False, placed_root),
                             timeout=300)
    resumed = run_on_ranks(_train_save_train, 4, (str(tmp_path / "again"), full, True,
                                                  colocated_root), timeout=300)
    assert placed[3] == {"first": [{}], "after": [{}, {}]}  # rank 3 holds neither role
    want = colocated[0]
    for r in ACTOR + CRITIC:  # placed and colocated start alike and run alike
        _compare(f"rank {r} placed, step 1", placed[r]["first"], want["first"])
        _compare(f"rank {r} placed, steps 2-3", placed[r]["after"], want["after"])
        _compare(f"rank {r} placed, resumed from colocated", resumed[r]["resumed"], want["after"])
        assert resumed[r]["state"] == {"step": 1}
    for r, res in enumerate(colocated):
        _compare(f"rank {r} colocated, resumed from placed", res["resumed"],
                 _merged(placed, "after"))
        assert res["state"] == {"step": 1}
    # Not vacuous: the steps after the checkpoint differ from the one before it.
    assert want["after"][1]["actor"][0] != want["first"][0]["actor"][0]
