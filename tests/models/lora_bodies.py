"""Rank bodies for the LoRA tests (module level: spawn pickles them by name)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.models.parity_bodies import setup_megatron


def lora_cfg(targets, r=4, alpha=8.0, init=False):
    return SimpleNamespace(enable=True, r=r, alpha=alpha, dropout=0.0, target_modules=targets,
                           init_lora_weights=init, lr=None, init_from=None)


def lora_logits_body(rank, world_size, hf_dir, tp, pp, targets, tokens, seed, sequence_parallel):
    """Logits of the model at TP x PP with random non-zero adapters (seeded), and with them off."""
    from megatron.core import parallel_state

    from verl_mcore.convert_hf.verify import megatron_logits
    from verl_mcore.models.load import build_and_load
    from verl_mcore.models.lora import adapters_disabled, attach_lora

    setup_megatron(tp, pp)
    extra = {"sequence_parallel": True} if sequence_parallel and tp > 1 else {}
    model, arch = build_and_load("actor", hf_path=hf_dir, dtype="fp32", tp=tp, pp=pp, **extra)
    adapters = attach_lora(model, lora_cfg(targets), arch, seed=seed)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    with_lora = megatron_logits(model, tokens)
    with adapters_disabled([model]):
        base = megatron_logits(model, tokens)
    last_tp0 = parallel_state.get_tensor_model_parallel_rank() == 0 and with_lora is not None
    return {"lora": with_lora if last_tp0 else None, "base": base if last_tp0 else None,
            "trainable": trainable, "n_adapters": len(adapters)}
