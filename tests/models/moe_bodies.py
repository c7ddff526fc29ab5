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


def sharded_keys_body(rank: int, world_size: int, hf_dir: str):
    """{checkpoint key: (global shape, [(offsets of each chunk)])} megatron's own
    sharded_state_dict gives the model at TP = PP = EP = 1 (tensors; `_extra_state` objects
    as their unique keys with shape None)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    from verl_mcore.models.load import build_and_load

    setup_megatron(1, 1, 1)
    model, _ = build_and_load("actor", hf_path=hf_dir, dtype="fp32")
    out: dict = {}
    for value in model.sharded_state_dict().values():
        if isinstance(value, ShardedTensorFactory):
            value = value.build()  # the SwiGLU factory: gate and up chunks
        for sh in nested_values(value) if isinstance(value, (dict, list)) else [value]:
            if isinstance(sh, ShardedObject):
                out[sh.unique_key] = (None, [])
            else:
                entry = out.setdefault(sh.key, (tuple(sh.global_shape), []))
                entry[1].append(tuple(sh.global_offset))
    return out


def save_body(rank: int, world_size: int, hf_dir: str, tp: int, ep: int, ckpt_dir: str):
    """Build at TP x EP from the HF directory and save with megatron's own
    dist_checkpointing.save, as the trainer's checkpoints are written."""
    import os

    from megatron.core import dist_checkpointing

    from verl_mcore.models.load import build_and_load

    setup_megatron(tp, 1, ep)
    model, _ = build_and_load("actor", hf_path=hf_dir, dtype="fp32", tp=tp,
                              expert_model_parallel_size=ep)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
