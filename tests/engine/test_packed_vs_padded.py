"""Packed (token budget, the default) and padded (micro_batch_size_per_gpu) micro-batches give the
same PPO updates on the same batch: per optimizer step the loss and the grad norm, and after the
update every weight, for the actor and the critic, at 1 rank, TP=2, PP=2 and (slow) TP=2 x PP=2
on gloo ranks. fp32; each path trains its own engine from the same initial weights, so only the
split into micro-batches differs, and with it the fp32 summation order: hence the tolerances
below, each a few times the largest difference seen."""
from __future__ import annotations

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

SAMPLES = 16  # mini-batches of 8 x ppo_epochs 2 -> 4 actor optimizer steps
REL = 1e-4  # losses and grad norms, relative (as tests/engine/test_layouts.py)
# max |w_packed - w_padded| over max |w_padded - w_initial| of each tensor: Adam divides by the
# root of the second moment, so the order-of-summation noise of near-zero gradients (the QKV
# biases, which start at zero) reaches the updates: seen up to 2.4e-4 of the update (1 rank, TP=2,
# PP=2; the other tensors ~1e-6).
WEIGHT_REL = 1e-3


def _body(rank, world_size, tp, pp, packed):
    import torch

    from tests.engine import common as C
    from verl_mcore.config.schema import CriticConfig
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.critic import Critic

    torch.manual_seed(0)
    batch = C.make_batch(seed=1, num=SAMPLES)
    micro = dict(max_tokens_per_microbatch=40, micro_batch_size_per_gpu=None) if packed else \
        dict(max_tokens_per_microbatch=None, micro_batch_size_per_gpu=2)
    out = {}
    for role, seed in (("actor", 0), ("critic", 3)):
        full = C.reference_weights(role, seed=seed)
        if role == "actor":
            cfg = C.actor_config(**micro)
            engine = C.make_engine("actor", full, tp, pp, optim=cfg.optim)
            before = _weights(engine)
            model = Actor(engine, cfg, mini_batch_size=8)
            _, steps = model.update(batch)
            out["actor"] = [(s["loss"], s["grad_norm"]) for s in steps]
        else:
            cfg = CriticConfig(**micro, optim=C.optim_config(lr=1e-2))
            engine = C.make_engine("critic", full, tp, pp, optim=cfg.optim)
            before = _weights(engine)
            model = Critic(engine, cfg, mini_batch_size=8, ppo_epochs=2)
            _, steps = model.update(batch)
            out["critic"] = [(s["loss"], s["grad_norm"]) for s in steps]
        out[f"{role}_path"] = model.mb_kwargs
        out[f"{role}_weights"] = _weights(engine)
        out[f"{role}_moved"] = {k: v - before[k] for k, v in out[f"{role}_weights"].items()}
    return out


def _weights(engine):
    """This rank's parameters (its TP / PP shard), by name."""
    return {name: p.detach().clone() for chunk in engine.model for name, p in chunk.named_parameters()}


@pytest.mark.parametrize("world_size,tp,pp", [
    (1, 1, 1), (2, 2, 1), (2, 1, 2), pytest.param(4, 2, 2, marks=pytest.mark.slow)],
    ids=["1rank", "tp2", "pp2", "tp2-pp2"])
def test_packed_and_padded_updates_agree(world_size, tp, pp):
    import torch

    packed = run_on_ranks(_body, world_size, args=(tp, pp, True), timeout=300)
    padded = run_on_ranks(_body, world_size, args=(tp, pp, False), timeout=300)
    for rank, (a, b) in enumerate(zip(packed, padded)):
        where = f"TP={tp} PP={pp} rank {rank}"
        for role, n_steps in (("actor", 4), ("critic", 4)):
            assert "max_tokens" in a[f"{role}_path"] and "micro_batch_size" in b[f"{role}_path"]
            got, want = torch.tensor(a[role], dtype=torch.float64), torch.tensor(b[role], dtype=torch.float64)
            assert got.shape == (n_steps, 2), (where, role, got.shape)
            err = ((got - want).abs() / want.abs().clamp(min=1e-3)).max().item()
            assert err <= REL, f"{where} {role} (loss, grad_norm) per step: rel err {err:.2e}\n{got}\n{want}"
            wa, wb = a[f"{role}_weights"], b[f"{role}_weights"]
            assert wa.keys() == wb.keys()
            for name in wa:
                diff = (wa[name] - wb[name]).abs().max().item()
                moved = b[f"{role}_moved"][name].abs().max().item()
                assert moved > 0, f"{where} {role} {name}: the update left it unchanged"
                assert diff <= WEIGHT_REL * moved, \
                    f"{where} {role} {name}: packed and padded weights differ by {diff:.2e}, " \
                    f"{diff / moved:.1e} of the update ({moved:.2e})"
        # The update moved the weights (the comparison is not of two untouched copies).
        assert packed[0]["actor"][0][0] != packed[0]["actor"][-1][0]
