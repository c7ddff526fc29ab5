"""Rank bodies for the megatron-vs-transformers tests (module level: spawn pickles them by name)."""
from __future__ import annotations

import torch


def setup_megatron(tp: int, pp: int, seed: int = 0) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from verl_mcore.distributed import cpu_compat

    cpu_compat.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)


def logits_body(rank: int, world_size: int, hf_dir: str, source: str, tp: int, pp: int,
                role: str, tokens: torch.Tensor, ckpt_dir: str | None = None,
                core_attention: str = "sdpa"):
    """Build `role` at TP x PP from `source` ("hf" dir or "ckpt" dist checkpoint); return the
    gathered outputs on the last stage's TP rank 0, None elsewhere."""
    from megatron.core import parallel_state

    from tools.convert_hf.verify import megatron_logits
    from verl_mcore.models.checkpoint import load_dist_checkpoint
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights

    setup_megatron(tp, pp)
    arch = read_hf_arch(hf_dir)
    model = build_gpt_model(arch, transformer_config(arch, tp=tp, pp=pp, dtype="fp32"), role=role,
                            core_attention=core_attention)
    if source == "hf":
        load_hf_weights(model, arch, hf_dir, role=role)
    else:
        load_dist_checkpoint(model, ckpt_dir, role=role)
    out = megatron_logits(model, tokens)
    if out is None or parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    return out
