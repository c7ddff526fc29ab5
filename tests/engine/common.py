"""Shared pieces of the engine tests: a tiny Qwen2-shaped model built by verl_mcore.models,
identical weights at every layout, random RL batches, and engine/role constructors.

Model: 4 layers, hidden 64, 4 query heads over 2 KV groups, ffn 128, vocab 128 (no padding at
TP=1 or 2), fp32 by default, SDPA core attention (packed THD sequences supported).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch

VOCAB = 128


def arch():
    from verl_mcore.models.hf_config import HFArch, RopeSpec

    return HFArch(
        model_type="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=VOCAB, norm_eps=1e-6, rope=RopeSpec(theta=10000.0),
        qkv_bias=True, qk_norm=False, tie_embeddings=False, max_position_embeddings=256,
    )


def provider(role: str):
    from verl_mcore.models.gpt import build_gpt_model

    def build(config, pre_process, post_process, vp_stage):
        return build_gpt_model(
            arch(), config, role=role, pre_process=pre_process, post_process=post_process,
            vp_stage=vp_stage, use_te=False, vocab_divisible_by=VOCAB // 2,
        )

    return build


def transformer_config(tp=1, pp=1, vpp=None, **overrides):
    from verl_mcore.models.hf_config import transformer_config as tc

    if vpp:
        overrides["virtual_pipeline_model_parallel_size"] = vpp
    return tc(arch(), tp=tp, pp=pp, dtype="fp32", init_method_std=0.02, **overrides)


def init_layout(tp=1, pp=1, vpp=None):
    """cpu_compat + megatron parallel_state at this layout; returns the ProcessGroupCollection.

    An already initialised identical layout is reused: megatron's destroy_model_parallel does not
    destroy most of its process groups, so every re-initialisation leaks gloo groups (threads) in
    the pooled ranks.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl_mcore.distributed import cpu_compat

    cpu_compat.install()
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size()) == (tp, pp, vpp)
        if same:
            return ProcessGroupCollection.use_mpu_process_groups()
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    return ProcessGroupCollection.use_mpu_process_groups()


def reference_weights(role: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (TP=1, PP=1) weights of the tiny model under `seed` (initialises that layout)."""
    init_layout()
    torch.manual_seed(seed)
    model = provider(role)(transformer_config(), True, True, None)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def make_engine(role: str, full, tp=1, pp=1, vpp=None, dtype="fp32", optim=None, recompute=False,
                lr_decay_steps=4, **config_overrides):
    from tests.distributed.tiny_gpt import load_sharded
    from verl_mcore.engine.engine import MegatronEngine

    pg = init_layout(tp, pp, vpp)
    return MegatronEngine(
        provider(role), transformer_config(tp, pp, vpp, **config_overrides), pg, dtype=dtype,
        optim=optim, recompute_activations=recompute, lr_decay_steps=lr_decay_steps,
        load_weights=partial(load_sharded, full=full),
    )


def make_batch(seed: int, num: int, max_prompt: int = 6, max_response: int = 10, width: int | None = None):
    """A random RL batch: prompt 2..max_prompt tokens, response 1..max_response tokens, some mask
    holes, random advantages/returns/values and old/ref log-probs near log(1/VOCAB)."""
    from verl_mcore.engine.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, max_prompt + 1, (num,), generator=g)
    resp = torch.randint(1, max_response + 1, (num,), generator=g)
    seq = prompt + resp
    s = int(seq.max())
    r = width or max_response
    ids = torch.randint(0, VOCAB, (num, s), generator=g)
    cols = torch.arange(r)[None, :]
    inside = cols < resp[:, None]
    mask = (inside & (torch.rand(num, r, generator=g) > 0.1)).float()
    base = torch.log(torch.tensor(1.0 / VOCAB))

    def noise(scale):
        return torch.randn(num, r, generator=g) * scale

    return TrainBatch(
        input_ids=ids, prompt_lens=prompt, seq_lens=seq, response_mask=mask,
        old_log_probs=base + noise(0.3), ref_log_probs=base + noise(0.3), advantages=noise(1.0),
        returns=noise(1.0), values=noise(1.0),
    )


def optim_config(**kw):
    from verl_mcore.config.schema import OptimConfig

    base = dict(lr=1e-3, weight_decay=0.01, clip_grad=1.0, lr_schedule="cosine", lr_warmup_steps=1, min_lr=1e-4)
    base.update(kw)
    return OptimConfig(**base)


def actor_config(**kw):
    from verl_mcore.config.schema import ActorConfig

    base = dict(dtype="fp32", ppo_epochs=2, max_tokens_per_microbatch=40, micro_batch_size_per_gpu=2,
                entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, optim=optim_config())
    base.update(kw)
    return ActorConfig(**base)


def replace(cfg, **kw):
    return dataclasses.replace(cfg, **kw)
