"""A one-step critic update that computes the rollout-time values in its own forward passes
(engine/critic.py) against the two-pass path it replaces (forward-only values pass, GAE returns,
then the update): the same values, the same update (loss, grad norm, clip fraction) and the same
weights after it, on 1 rank and at PP=2 x VPP=2 (values computed on the last stage, gathered to
every rank). fp32, identical initial weights."""
from __future__ import annotations

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

GAMMA, LAM = 0.99, 0.9


def _body(rank, world_size, pp, vpp):
    import torch

    from tests.engine import common as C
    from verl_mcore import ops
    from verl_mcore.config.schema import CriticConfig
    from verl_mcore.engine.critic import Critic

    torch.manual_seed(0)
    full = C.reference_weights("critic", seed=3)
    # Token rewards with a few non-zero entries besides the last token's score, as KL shaping gives.
    base = C.make_batch(seed=7, num=8)
    rewards = torch.randn(base.response_mask.shape, generator=torch.Generator().manual_seed(1))
    rewards = rewards * base.response_mask

    def returns_of(r, v, m):
        return ops.gae(r, v, m, GAMMA, LAM)[1]

    def fresh():
        cfg = CriticConfig(max_tokens_per_microbatch=32,
                           optim=C.optim_config(lr=1e-2, lr_schedule="constant", lr_warmup_steps=0))
        engine = C.make_engine("critic", full, 1, pp, vpp, optim=cfg.optim)
        critic = Critic(engine, cfg, mini_batch_size=8, ppo_epochs=1)
        batch = base.select(range(8))
        batch.values = batch.returns = batch.advantages = None
        batch.token_rewards = rewards.clone()
        return critic, batch

    two_pass, batch_a = fresh()
    batch_a.values = two_pass.compute_values(batch_a)
    batch_a.returns = returns_of(batch_a.token_rewards, batch_a.values, batch_a.response_mask)
    _, steps_a = two_pass.update(batch_a, returns_of)
    after_a = two_pass.compute_values(batch_a)

    one_pass, batch_b = fresh()
    assert one_pass.is_one_step(8)
    _, steps_b = one_pass.update(batch_b, returns_of)
    after_b = one_pass.compute_values(batch_b)

    # Refused: no values and several optimizer steps, or no token rewards.
    errors = []
    several = Critic(one_pass.engine, one_pass.cfg, mini_batch_size=4, ppo_epochs=1)
    for critic, drop in ((several, False), (one_pass, True)):
        b = base.select(range(8))
        b.values = b.returns = None
        b.token_rewards = None if drop else rewards.clone()
        try:
            critic.update(b, returns_of)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    key = ("loss", "grad_norm", "vf_clipfrac", "vf_loss")
    return {
        "values": (batch_a.values, batch_b.values), "after": (after_a, after_b),
        "steps": ([[s[k] for k in key] for s in steps_a], [[s[k] for k in key] for s in steps_b]),
        "errors": errors,
    }


@pytest.mark.parametrize("world_size,pp,vpp", [(1, 1, None), (2, 2, 2)], ids=["1rank", "pp2-vpp2"])
def test_one_step_update_computes_the_values_it_replaces(world_size, pp, vpp):
    for rank, r in enumerate(run_on_ranks(_body, world_size, args=(pp, vpp), timeout=300)):
        two, one = r["values"]
        assert two.abs().max() > 0, "the values pass computed nothing"
        assert (one - two).abs().max().item() <= 1e-6, f"rank {rank}: V_old differs"
        (sa,), (sb,) = r["steps"]
        for name, x, y in zip(("loss", "grad_norm", "vf_clipfrac", "vf_loss"), sa, sb):
            assert abs(x - y) <= 1e-6 * max(1.0, abs(x)), f"rank {rank} {name}: {x} vs {y}"
        after_a, after_b = r["after"]
        assert (after_a - two).abs().max() > 1e-4, "the update did not move the critic"
        assert (after_a - after_b).abs().max().item() <= 1e-5, f"rank {rank}: weights after differ"
        several, missing = r["errors"]
        assert several and "one optimizer step" in several and "compute_values" in several
        assert missing and "token_rewards" in missing
