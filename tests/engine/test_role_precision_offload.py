"""Per-role precision and the reference's host offload, on one rank:

- a bf16 critic keeps fp32 master weights and Adam state in the optimizer, its value head
  computes in fp32 (values are fp32, not bf16-rounded), and its update runs;
- reference.offload_params: the reference's weights live in host memory between passes, come
  back for the reference log-probs (the same numbers as without offload, pass after pass) and
  leave again.
"""
from __future__ import annotations

import math

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed


def _body(rank, world_size):
    import torch

    from tests.engine import common as C
    from verl_mcore.config.schema import CriticConfig
    from verl_mcore.engine import optim_step
    from verl_mcore.engine.actor import Reference
    from verl_mcore.engine.critic import Critic

    torch.manual_seed(0)
    batch = C.make_batch(seed=3, num=6)
    out = {}

    critic_full = C.reference_weights("critic", seed=5)
    cfg = CriticConfig(dtype="bf16", micro_batch_size_per_gpu=3, optim=C.optim_config(lr_warmup_steps=0))
    critic = Critic(C.make_engine("critic", critic_full, dtype="bf16", optim=cfg.optim), cfg,
                    mini_batch_size=6, ppo_epochs=1)
    model_dtypes = {p.dtype for m in critic.engine.model for p in m.parameters()}
    main_dtypes = {p.dtype for opt in optim_step.sub_optimizers(critic.engine.optimizer)
                   for group in opt.optimizer.param_groups for p in group["params"]}
    values = critic.compute_values(batch)
    # The head's own output for a bf16 hidden state: fp32, with more than bf16's 8 mantissa bits.
    from verl_mcore.build import unwrap

    head = unwrap(critic.engine.model[0]).output_layer
    hidden = torch.randn(5, 2, head.weight.shape[1], dtype=torch.bfloat16)
    head_out, _ = head(hidden)
    exact = hidden.double() @ head.weight.double().t()
    summary, _ = critic.update(batch)
    out["critic"] = {
        "model_dtypes": model_dtypes, "main_dtypes": main_dtypes, "values_dtype": values.dtype,
        "head_out_dtype": head_out.dtype, "head_err": (head_out.double() - exact).abs().max().item(),
        "head_scale": exact.abs().max().item(), "vf_loss": summary["critic/vf_loss"],
        "values_finite": bool(torch.isfinite(values).all()),
    }

    actor_full = C.reference_weights("actor", seed=4)
    plain = Reference(C.make_engine("actor", actor_full), micro_batch_size=4)
    offloaded = Reference(C.make_engine("actor", actor_full), micro_batch_size=4, offload_params=True)
    params = [p for m in offloaded.engine.model for p in m.parameters()]
    out["ref"] = {
        "away_after_build": all(p.untyped_storage().nbytes() == 0 for p in params),
        "plain": plain.compute_ref_log_prob(batch),
        "first": offloaded.compute_ref_log_prob(batch),
        "away_after_pass": all(p.untyped_storage().nbytes() == 0 for p in params),
        "second": offloaded.compute_ref_log_prob(batch),
    }
    # frozen=True: later offloads do not copy the weights out again (they never change), so a
    # write made while they are on the device is dropped at the next offload.
    offloaded.offloader.onload()
    with torch.no_grad():
        params[0].add_(1.0)
    offloaded.offloader.offload()
    out["ref"]["after_a_dropped_write"] = offloaded.compute_ref_log_prob(batch)
    return out


def test_bf16_critic_fp32_master_and_head_and_reference_offload():
    import torch

    r = run_on_ranks(_body, 1, timeout=240)[0]
    c = r["critic"]
    assert c["model_dtypes"] == {torch.bfloat16}  # compute dtype
    assert c["main_dtypes"] == {torch.float32}  # master weights (and so Adam state) in fp32
    assert c["values_dtype"] == torch.float32 and c["values_finite"]
    assert c["head_out_dtype"] == torch.float32
    # fp32 accumulation of bf16 inputs: far below bf16's relative rounding of 2**-8.
    assert c["head_err"] <= 1e-5 * max(1.0, c["head_scale"]), c
    assert math.isfinite(c["vf_loss"])

    ref = r["ref"]
    assert ref["away_after_build"] and ref["away_after_pass"]
    assert torch.equal(ref["first"], ref["plain"]) and torch.equal(ref["second"], ref["plain"])
    assert torch.equal(ref["after_a_dropped_write"], ref["plain"])
