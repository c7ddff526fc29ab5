"""LoRA training at every layout (issue 21): one optimizer step's adapter update at DP=2, TP=2
and TP=2 × PP=2 equals the 1-rank run; the frozen base is bit-identical after the update; the
reference (the actor's model with its adapters off) gives the base model's log-probs exactly.

fp32, the engine tests' tiny model (tests/engine/common.py), adapters on every linear with both
A and B random (init_lora_weights=False) so that both get a gradient in the first step."""
from __future__ import annotations

import pytest
import torch

from tests.models.lora_bodies import assemble_adapters
from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

BATCH = 8  # samples: one mini-batch, one epoch -> one optimizer step
REL = 1e-4


def _body(rank, world_size, tp, pp):
    from functools import partial

    from tests.distributed.tiny_gpt import load_sharded
    from tests.engine import common as C
    from tests.models.lora_bodies import adapter_shards, lora_cfg
    from verl_mcore.engine.actor import Actor, Reference
    from verl_mcore.engine.engine import MegatronEngine
    from verl_mcore.models import lora as L

    torch.manual_seed(0)
    batch = C.make_batch(seed=1, num=BATCH)
    full = C.reference_weights("actor")
    # Adam's first step is lr·g/(|g| + eps), about lr·sign(g): with a tiny eps an element whose
    # gradient is ~0 moves by up to lr on a rounding difference of 1e-8. An eps well above the
    # layouts' rounding keeps the update a smooth function of the gradient (the loss and grad
    # norm are compared as well).
    cfg = C.actor_config(ppo_epochs=1, optim=C.optim_config(lr=1e-2, lr_warmup_steps=0,
                                                              lr_schedule="constant", adam_eps=1e-3))

    def load(module):
        load_sharded(module, full=full)
        L.attach_lora(module, lora_cfg("all-linear", r=4, alpha=8.0, init=False), C.arch(), seed=5)

    pg = C.init_layout(tp, pp)
    engine = MegatronEngine(C.provider("actor"), C.transformer_config(tp, pp), pg, dtype="fp32",
                            optim=cfg.optim, lr_decay_steps=1, load_weights=load)
    actor = Actor(engine, cfg, mini_batch_size=BATCH)
    base_engine = C.make_engine("actor", full, tp, pp)  # no adapters, forward only

    def frozen():
        return {n: p.detach().clone() for m in engine.model for n, p in m.named_parameters()
                if not p.requires_grad}

    def adapters():
        return adapter_shards(engine.model)

    mb = dict(max_tokens_per_microbatch=40)
    ref_logp = Reference(engine, adapters_off=True, **mb).compute_ref_log_prob(batch)
    base_logp = Reference(base_engine, **mb).compute_ref_log_prob(batch)
    lora_logp, _ = actor.compute_log_prob(batch)
    base_before, before = frozen(), adapters()
    _, steps = actor.update(batch)
    base_after, after = frozen(), adapters()
    return {
        "ref_vs_base": (ref_logp - base_logp).abs().max().item(),
        "lora_vs_base": (lora_logp - base_logp).abs().max().item(),
        "base_unchanged": base_before.keys() == base_after.keys()
        and all(torch.equal(base_before[n], base_after[n]) for n in base_before),
        "n_frozen": len(base_before),
        "steps": [(s["loss"], s["grad_norm"]) for s in steps],
        "delta": [(k, r, d, a - b) for (k, r, d, a), (_, _, _, b) in zip(after, before)],
        "dp_rank": pg.dp.rank(),
    }


def _assemble(results) -> dict[str, torch.Tensor]:
    """{peft key: full adapter update} from the ranks' shards (DP rank 0's)."""
    return assemble_adapters(results, "delta")


@pytest.fixture(scope="module")
def oracle():
    res = run_on_ranks(_body, 1, args=(1, 1), timeout=240)
    return res[0], _assemble(res)


def test_single_rank_reference_is_the_base_and_the_base_stays(oracle):
    res, deltas = oracle
    assert res["ref_vs_base"] == 0.0  # adapters off: the same forward, bit for bit
    assert res["lora_vs_base"] > 1e-3  # random adapters change the policy
    assert res["base_unchanged"] and res["n_frozen"] > 0
    assert len(res["steps"]) == 1
    # every adapter tensor moved (A and B both had a gradient)
    assert all(d.abs().max() > 0 for d in deltas.values()), [k for k, d in deltas.items()
                                                            if d.abs().max() == 0]


@pytest.mark.parametrize("world_size,tp,pp", [(2, 1, 1), (2, 2, 1),
                                              pytest.param(4, 2, 2, marks=pytest.mark.slow)],
                         ids=["dp2", "tp2", "tp2-pp2"])
def test_adapter_update_matches_single_rank(oracle, world_size, tp, pp):
    want_res, want = oracle
    results = run_on_ranks(_body, world_size, args=(tp, pp), timeout=300)
    got = _assemble(results)
    assert got.keys() == want.keys()
    for key in want:
        err = ((got[key] - want[key]).abs().max() / want[key].abs().max()).item()
        assert err <= REL, f"{key}: relative error {err:.2e}"
    for res in results:
        assert res["ref_vs_base"] == 0.0 and res["base_unchanged"]
        (loss, gn), = res["steps"]
        (want_loss, want_gn), = want_res["steps"]
        assert abs(loss - want_loss) <= REL * abs(want_loss) + 1e-6
        assert abs(gn - want_gn) <= REL * want_gn
