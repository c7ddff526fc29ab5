"""Gradient-accumulation fusion (models/grad_accum.py standing in for apex) changes no numbers:
one PPO optimizer step with the fusion on equals the step with it off, for the gradients the
optimizer sees (every main_grad), the loss, the grad norm and the updated weights (fp32, several
packed micro-batches, tied embeddings: the output layer's gradient goes through the fused GEMM
while the embedding's goes through autograd into the same main_grad), at TP=1 and at TP=2 x PP=2
(the tied copies on the first and last stage, reduced by finalize_model_grads)."""
from __future__ import annotations

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

REL = 1e-6


def _provider():
    import dataclasses

    from tests.engine import common as C
    from verl_mcore.models.gpt import build_gpt_model

    arch = dataclasses.replace(C.arch(), tie_embeddings=True)

    def build(config, pre_process, post_process, vp_stage):
        return build_gpt_model(arch, config, role="actor", pre_process=pre_process,
                               post_process=post_process, vp_stage=vp_stage, use_te=False,
                               vocab_divisible_by=C.VOCAB // 2)

    return build


def _body(rank, world_size, tp, pp):
    import torch
    from megatron.core.tensor_parallel import layers

    from tests.engine import common as C
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.engine import MegatronEngine
    from verl_mcore.models import grad_accum as shim

    pg = C.init_layout(tp, pp)
    batch = C.make_batch(seed=5, num=8)
    # No warmup: the one step moves the weights (a warmup step would run at LR 0).
    cfg = C.actor_config(ppo_epochs=1, max_tokens_per_microbatch=40,
                         optim=C.optim_config(lr_warmup_steps=0))
    initial: dict = {}
    out = {}
    for fusion in (False, True):
        torch.manual_seed(0)

        def load(module, fusion=fusion):
            # The second engine starts from exactly the first one's weights.
            for name, p in module.named_parameters():
                if fusion:
                    p.data.copy_(initial[name])
                else:
                    initial[name] = p.detach().clone()

        engine = MegatronEngine(_provider(), C.transformer_config(tp, pp), pg, dtype="fp32",
                                optim=cfg.optim, lr_decay_steps=4, load_weights=load,
                                grad_accum_fusion=fusion)
        actor = Actor(engine, cfg, mini_batch_size=8)
        module = engine.model[0].module
        grads, fused_calls = {}, []
        step = engine.optimizer_step

        def optimizer_step():
            for name, p in module.named_parameters():
                grads[name] = p.main_grad.detach().clone()
            return step()

        engine.optimizer_step = optimizer_step
        original = shim.wgrad_gemm_accum_fp32
        shim.wgrad_gemm_accum_fp32 = lambda *a: fused_calls.append(1) or original(*a)
        try:
            summary, _ = actor.update(batch)
        finally:
            shim.wgrad_gemm_accum_fp32 = original
        out[fusion] = {
            "loss": summary["actor/loss"], "grad_norm": summary["actor/grad_norm"],
            "grads": grads, "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "fused_calls": len(fused_calls), "config": engine.config.gradient_accumulation_fusion,
            "installed": getattr(layers, "fused_weight_gradient_mlp_cuda", None) is shim,
            "micro_batches": len(engine.micro_batches(batch, max_tokens=40)),
            "moved": max(float((p - initial[n]).abs().max()) for n, p in module.named_parameters()),
        }
    return out


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("world_size,tp,pp", [(1, 1, 1), (4, 2, 2)], ids=["tp1", "tp2-pp2"])
def test_fused_step_equals_unfused(world_size, tp, pp):
    results = run_on_ranks(_body, world_size, args=(tp, pp), timeout=300)
    for rank, res in enumerate(results):
        off, on = res[False], res[True]
        assert on["config"] and not off["config"] and on["installed"]
        assert on["fused_calls"] > 0 and off["fused_calls"] == 0, "the fused path ran"
        assert on["micro_batches"] > 1, "accumulation over several micro-batches"
        assert on["moved"] > 1e-4, "the optimizer step changed the weights"
        assert abs(on["loss"] - off["loss"]) <= REL * abs(off["loss"])
        assert abs(on["grad_norm"] - off["grad_norm"]) <= REL * off["grad_norm"]
        assert on["grads"].keys() == off["grads"].keys()
        for name in off["grads"]:
            assert off["grads"][name].abs().max() > 0, f"rank {rank} {name}: no gradient"
            assert _rel(on["grads"][name], off["grads"][name]) <= REL, f"rank {rank} grad {name}"
            assert _rel(on["params"][name], off["params"][name]) <= REL, f"rank {rank} {name}"
