"""Rank bodies for the mixture-of-experts tests (module level: spawn pickles them by name)."""
from __future__ import annotations

import torch


def setup_megatron(tp: int, pp: int, ep: int, etp: int | None = None, seed: int = 0) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from verl_mcore.distributed import cpu_compat

    cpu_compat.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(seed)


def logits_body(rank: int, world_size: int, hf_dir: str, tp: int, pp: int, ep: int,
                etp: int | None, tokens: torch.Tensor, ckpt_dir: str | None = None):
    """Outputs of the model built at TP x PP x EP, expert TP `etp` (None: TP), DP = world /
    (TP x PP), from the HF directory (or the dist checkpoint `ckpt_dir`), gathered on the last
    stage's TP rank 0 of every data-parallel rank (None elsewhere); the same tokens on every
    rank."""
    from megatron.core import parallel_state

    from tools.convert_hf.verify import megatron_logits
    from verl_mcore.models.load import build_and_load

    setup_megatron(tp, pp, ep, etp)
    model, _ = build_and_load("actor", hf_path=hf_dir, checkpoint=ckpt_dir, dtype="fp32", tp=tp,
                              pp=pp, expert_model_parallel_size=ep,
                              expert_tensor_parallel_size=etp or tp)
    out = megatron_logits(model, tokens)
    return {"out": out if parallel_state.get_tensor_model_parallel_rank() == 0 else None}
