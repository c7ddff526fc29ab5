"""Roles and per-role settings on one rank: reference = actor log-probs, bf16 / fp16 (loss
scaling) updates track fp32, activation recompute changes nothing, the LR schedule follows
warmup + cosine, and the update's metrics are complete."""
from __future__ import annotations

import math

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed


def _body(rank, world_size):
    import torch

    from tests.engine import common as C
    from verl_mcore.engine.actor import Actor, Reference

    torch.manual_seed(0)
    batch = C.make_batch(seed=9, num=8)
    full = C.reference_weights("actor", seed=4)
    out = {}

    ref = Reference(C.make_engine("actor", full), temperature=0.9, micro_batch_size=3)
    out["ref_logp"] = ref.compute_ref_log_prob(batch)
    out["ref_has_optimizer"] = ref.engine.optimizer is not None
    out["ref_requires_grad"] = any(p.requires_grad for m in ref.engine.model for p in m.parameters())

    runs = {}
    for name, dtype, recompute in (("fp32", "fp32", False), ("recompute", "fp32", True),
                                   ("bf16", "bf16", False), ("fp16", "fp16", False)):
        cfg = C.actor_config(dtype=dtype, recompute_activations=recompute, max_tokens_per_microbatch=36)
        actor = Actor(C.make_engine("actor", full, dtype=dtype, optim=cfg.optim, recompute=recompute), cfg,
                      mini_batch_size=4, temperature=0.9)
        logp, _ = actor.compute_log_prob(batch)
        summary, steps = actor.update(batch)
        runs[name] = {"logp": logp, "summary": summary, "steps": steps,
                      "recompute": actor.engine.config.recompute_granularity,
                      "param_dtype": next(actor.engine.model[0].parameters()).dtype}
    out["runs"] = runs

    # One on-policy optimizer step (1 epoch, mini-batch = batch): old log-probs from a separate
    # forward pass, or none (the update's own, detached) give the same step.
    cfg = C.actor_config(ppo_epochs=1, optim=C.optim_config(lr_warmup_steps=0))
    on_policy = {}
    for name in ("separate", "own"):
        actor = Actor(C.make_engine("actor", full, optim=cfg.optim), cfg, mini_batch_size=8, temperature=0.9)
        b = C.make_batch(seed=9, num=8)
        b.old_log_probs = actor.compute_log_prob(b)[0] if name == "separate" else None
        before = [p.detach().clone() for p in actor.engine.model[0].parameters()]
        summary, _ = actor.update(b)
        on_policy[name] = {"summary": summary, "before": before,
                           "weights": [p.detach().clone() for p in actor.engine.model[0].parameters()]}
    out["on_policy"] = on_policy
    several_steps = Actor(C.make_engine("actor", full, optim=cfg.optim), cfg, mini_batch_size=4, temperature=0.9)
    b = C.make_batch(seed=9, num=8)
    b.old_log_probs = None
    try:
        several_steps.update(b)
        out["several_steps_error"] = None
    except ValueError as e:
        out["several_steps_error"] = str(e)
    return out


def test_roles_precision_recompute_schedule():
    import torch

    r = run_on_ranks(_body, 1, timeout=240)[0]
    runs = r["runs"]
    fp32 = runs["fp32"]
    # Reference (forward-only engine) and actor compute the same log-probs from the same weights.
    assert not r["ref_has_optimizer"] and not r["ref_requires_grad"]
    assert (r["ref_logp"] - fp32["logp"]).abs().max().item() <= 1e-6

    # Full recompute re-runs the forward in backward: same numbers.
    assert runs["recompute"]["recompute"] == "full" and fp32["recompute"] is None
    for a, b in zip(runs["recompute"]["steps"], fp32["steps"]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6, abs_tol=1e-7)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-6)

    # Half precision: bf16 / fp16 parameters, fp32 master weights in the optimizer; the first
    # step (same weights) agrees with fp32 to half-precision accuracy.
    assert runs["bf16"]["param_dtype"] == torch.bfloat16 and runs["fp16"]["param_dtype"] == torch.float16
    for name, tol in (("bf16", 0.05), ("fp16", 0.01)):
        assert (runs[name]["logp"] - fp32["logp"]).abs().max().item() <= tol * 5, name
        s0, f0 = runs[name]["steps"][0], fp32["steps"][0]
        assert abs(s0["loss"] - f0["loss"]) <= tol * max(1.0, abs(f0["loss"])), (name, s0["loss"], f0["loss"])
        assert math.isclose(s0["grad_norm"], f0["grad_norm"], rel_tol=tol * 2), (name, s0["grad_norm"], f0["grad_norm"])
    fp16_steps = runs["fp16"]["steps"]
    assert all(s["loss_scale"] > 1 for s in fp16_steps)
    assert sum(s["skipped"] for s in fp16_steps) == 0

    # LR: warmup 1 step from 0, then cosine from 1e-3 to 1e-4 over the remaining 3 of 4 steps.
    lrs = [s["lr"] for s in fp32["steps"]]
    assert len(lrs) == 4  # 8 samples / mini-batch 4 x 2 epochs
    expected = [0.0, 1e-3] + [1e-4 + 0.5 * (1 + math.cos(math.pi * k / 3)) * 9e-4 for k in (1, 2)]
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(lrs, expected)), lrs

    # The on-policy shortcut: same step, ratio 1 (no clipping, zero ppo_kl); several optimizer
    # steps without old log-probs are refused by name.
    sep, own = r["on_policy"]["separate"], r["on_policy"]["own"]
    for a, b in zip(sep["weights"], own["weights"]):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(own["before"], own["weights"]))  # it stepped
    assert own["summary"]["actor/loss"] == sep["summary"]["actor/loss"]
    assert own["summary"]["actor/ppo_kl"] == 0.0 and own["summary"]["actor/pg_clipfrac"] == 0.0
    assert "missing ['old_log_probs']" in r["several_steps_error"]

    summary = fp32["summary"]
    for key in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "grad_norm", "lr", "tokens_per_s"):
        assert f"actor/{key}" in summary and math.isfinite(summary[f"actor/{key}"]), key
    assert summary["actor/mfu"] is None or 0 < summary["actor/mfu"]
    assert 0 < summary["actor/entropy"] <= math.log(128) + 1e-4
