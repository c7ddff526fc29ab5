"""The same PPO updates at every layout: (TP=1, 1 rank) is the oracle for DP=2, PP=2 x VPP=2 and
TP=2 x PP=2 (4 ranks). fp32, identical initial weights, the global batch the same everywhere;
micro-batches are packed by a token budget, so the split into micro-batches and DP shares differs
between layouts while the losses and gradients must not."""
from __future__ import annotations

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

STEPS_BATCH = 16  # samples; mini-batch 8 x ppo_epochs 2 -> 4 optimizer steps
REL = 1e-4


def _body(rank, world_size, tp, pp, vpp):
    import torch

    from tests.engine import common as C
    from verl_mcore.config.schema import CriticConfig
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.critic import Critic

    torch.manual_seed(0)
    batch = C.make_batch(seed=1, num=STEPS_BATCH)
    full = C.reference_weights("actor")
    critic_full = C.reference_weights("critic", seed=3)
    cfg = C.actor_config(max_tokens_per_microbatch=40)
    actor = Actor(C.make_engine("actor", full, tp, pp, vpp, optim=cfg.optim), cfg, mini_batch_size=8)
    logp, entropy = actor.compute_log_prob(batch, compute_entropy=True)
    _, steps = actor.update(batch)

    ccfg = CriticConfig(max_tokens_per_microbatch=32, optim=C.optim_config(lr=1e-2, lr_schedule="constant", lr_warmup_steps=0))
    critic = Critic(C.make_engine("critic", critic_full, tp, pp, vpp, optim=ccfg.optim), ccfg,
                    mini_batch_size=8, ppo_epochs=1)
    values = critic.compute_values(batch)
    _, critic_steps = critic.update(batch)
    return {
        "actor": [(s["loss"], s["grad_norm"], s["pg_clipfrac"], s["entropy"], s["lr"]) for s in steps],
        "critic": [(s["loss"], s["grad_norm"], s["vf_clipfrac"]) for s in critic_steps],
        "logp": logp, "entropy": entropy, "values": values,
    }


def _assert_close(name, got, want):
    import torch

    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    err = ((got - want).abs() / want.abs().clamp(min=1e-3)).max().item()
    assert err <= REL, f"{name}: max relative error {err:.2e} > {REL}\n got  {got.tolist()}\n want {want.tolist()}"


@pytest.fixture(scope="module")
def oracle():
    return run_on_ranks(_body, 1, args=(1, 1, None), timeout=240)[0]


@pytest.mark.parametrize(
    "world_size,tp,pp,vpp",
    [(2, 1, 1, None), (2, 1, 2, 2), pytest.param(4, 2, 2, None, marks=pytest.mark.slow)],
    ids=["dp2", "pp2-vpp2", "tp2-pp2"],
)
def test_layout_matches_single_rank(oracle, world_size, tp, pp, vpp):
    results = run_on_ranks(_body, world_size, args=(tp, pp, vpp), timeout=300)
    for rank, res in enumerate(results):
        for role in ("actor", "critic"):
            _assert_close(f"rank {rank} {role} steps (loss, grad_norm, ...)", res[role], oracle[role])
        for key in ("logp", "entropy", "values"):
            diff = (res[key] - oracle[key]).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {key}: max abs diff {diff:.2e}"
    assert len(oracle["actor"]) == 4 and len(oracle["critic"]) == 2
    # The optimizer did something: the loss moved.
    assert oracle["actor"][0][0] != oracle["actor"][-1][0]
