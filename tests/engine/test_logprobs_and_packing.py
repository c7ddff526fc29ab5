"""Through the engine with the tiny model, at TP=1 (1 rank) and TP=2 (2 ranks), fp32:

- response log-probs and entropies from the vocab-parallel logits (verl_mcore.ops via
  engine.logprobs) against a float64 full-vocabulary reference on the same logits, forward and
  backward (gradient of a random combination w.r.t. this rank's logit shard), <= 1e-6;
- Actor.compute_log_prob (packed micro-batches, the pipeline schedule, gather to batch order)
  against the same reference computed from one padded forward of the whole batch;
- one packed and one padded forward/backward of the same mini-batch: same loss, same metrics,
  same gradients in the DDP buffers.
"""
from __future__ import annotations

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

TEMPERATURE = 0.7


def _reference(logits_full, mb, temperature):
    """float64 log p(target), entropy [n, R] from full-vocabulary logits [b, s, V]."""
    import torch

    z = logits_full.reshape(-1, logits_full.shape[-1]).double() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(1, mb.targets.reshape(-1, 1)).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pick = lambda x: torch.where(mb.gather_valid, x[mb.gather_index], torch.zeros((), dtype=x.dtype))  # noqa: E731
    return pick(logp), pick(entropy)


def _gather_vocab(local, tp_group):
    import torch
    import torch.distributed as dist

    if dist.get_world_size(tp_group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def _body(rank, world_size, tp):
    import torch

    from tests.engine import common as C
    from verl_mcore.algo.aggregation import LossDenominators
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.logprobs import response_logprobs
    from verl_mcore.engine.packing import build_micro_batch

    torch.manual_seed(0)
    out = {}
    batch = C.make_batch(seed=5, num=8)
    full = C.reference_weights("actor", seed=2)
    cfg = C.actor_config(max_tokens_per_microbatch=48, entropy_coeff=0.05)
    engine = C.make_engine("actor", full, tp=tp, optim=cfg.optim)
    actor = Actor(engine, cfg, mini_batch_size=8, temperature=TEMPERATURE)
    tp_group = engine.pg.tp

    # 1. The op on real logits vs float64, forward and backward, one padded micro-batch of all rows.
    mb = build_micro_batch(batch, range(batch.num_samples), packed=False, pad_multiple=tp)
    with torch.no_grad():
        logits = engine.model[0](mb.input_ids, mb.position_ids, None)  # [b, s, V / tp]
    logits = logits.detach().requires_grad_(True)
    logp, entropy = response_logprobs(logits, mb, tp_group, TEMPERATURE, compute_entropy=True)
    g = torch.Generator().manual_seed(7)
    w_logp, w_ent = torch.randn(logp.shape, generator=g), torch.randn(logp.shape, generator=g)
    (w_logp * logp + w_ent * entropy).sum().backward()

    full_logits = _gather_vocab(logits.detach(), tp_group).double().requires_grad_(True)
    ref_logp, ref_ent = _reference(full_logits, mb, TEMPERATURE)
    (w_logp.double() * ref_logp + w_ent.double() * ref_ent).sum().backward()
    vocab_local = logits.shape[-1]
    tp_rank = torch.distributed.get_rank(tp_group)
    ref_grad = full_logits.grad[..., tp_rank * vocab_local:(tp_rank + 1) * vocab_local]
    out["logp_err"] = (logp.double() - ref_logp).abs().max().item()
    out["entropy_err"] = (entropy.double() - ref_ent).abs().max().item()
    out["grad_err"] = (logits.grad.double() - ref_grad).abs().max().item()
    out["grad_scale"] = ref_grad.abs().max().item()

    # 2. The engine's forward-only path (packed micro-batches, gather to batch order).
    eng_logp, eng_ent = actor.compute_log_prob(batch, compute_entropy=True)
    out["engine_logp_err"] = (eng_logp.double() - ref_logp.detach()).abs().max().item()
    out["engine_entropy_err"] = (eng_ent.double() - ref_ent.detach()).abs().max().item()

    # 3. Packed vs padded forward/backward of the same mini-batch.
    valid = batch.response_mask.bool() & batch.response_field_mask()
    denoms = LossDenominators.of(valid)
    results = {}
    for name, kwargs in (("packed", {"max_tokens": 48}), ("padded", {"micro_batch_size": 3})):
        mbs = engine.micro_batches(batch, **kwargs)
        engine.zero_grad()
        per_mb = engine.forward_backward(mbs, lambda o, m: actor._loss(denoms, o, m), forward_only=False)
        metrics = engine.reduce_metrics(per_mb)
        grads = torch.cat([p.main_grad.reshape(-1).clone() for p in engine.model[0].parameters()])
        results[name] = (metrics, grads, len(mbs))
    (mp, gp, np_), (md, gd, nd) = results["packed"], results["padded"]
    out["micro_batches"] = (np_, nd)
    out["metric_err"] = max(abs(mp[k] - md[k]) / max(abs(md[k]), 1e-6) for k in md)
    out["grad_rel_err"] = ((gp - gd).abs().max() / gd.abs().max()).item()
    out["grad_norm"] = gd.norm().item()
    return out


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 2)], ids=["tp1", "tp2"])
def test_logprobs_and_packed_vs_padded(world_size, tp):
    for rank, r in enumerate(run_on_ranks(_body, world_size, args=(tp,), timeout=240)):
        where = f"TP={tp} rank {rank}"
        assert r["logp_err"] <= 1e-6, f"{where}: log-prob vs float64 reference {r['logp_err']:.2e}"
        assert r["entropy_err"] <= 1e-6, f"{where}: entropy vs float64 reference {r['entropy_err']:.2e}"
        assert r["grad_err"] <= 1e-6, f"{where}: grad-logits vs float64 reference {r['grad_err']:.2e} (max |grad| {r['grad_scale']:.2e})"
        # Packed THD attention vs one padded batch: same math, different fp32 summation order.
        assert r["engine_logp_err"] <= 1e-5, f"{where}: engine log-probs {r['engine_logp_err']:.2e}"
        assert r["engine_entropy_err"] <= 1e-5, f"{where}: engine entropies {r['engine_entropy_err']:.2e}"
        assert r["micro_batches"][0] >= 2 and r["micro_batches"][1] == 3, r["micro_batches"]
        assert r["metric_err"] <= 1e-5, f"{where}: packed vs padded loss/metrics differ by {r['metric_err']:.2e}"
        assert r["grad_rel_err"] <= 1e-5, f"{where}: packed vs padded gradients differ by {r['grad_rel_err']:.2e}"
        assert r["grad_norm"] > 0
