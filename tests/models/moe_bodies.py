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


def _micro_batches(batch: dict, dp_rank: int, dp_size: int, micro_batch: int):
    per_rank = batch["tokens"].shape[0] // dp_size
    lo = dp_rank * per_rank
    for start in range(lo, lo + per_rank, micro_batch):
        yield {k: v[start:start + micro_batch] for k, v in batch.items()}


def _forward_step(data_iterator, model):
    mb = next(data_iterator)
    b, s = mb["tokens"].shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    per_token = model(mb["tokens"], position_ids, None, labels=mb["labels"])  # [b, s]

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()  # mean over this micro-batch's b * s tokens
        return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return per_token, loss_func


def train_body(rank: int, world_size: int, hf_dir: str, tp: int, pp: int, ep: int,
               etp: int | None, batches: list, micro_batch: int, aux_loss_coeff: float,
               probe: torch.Tensor):
    """One optimizer step per batch at TP x PP x EP (DP = world / (TP x PP)) with megatron's DDP,
    distributed optimizer (Adam, clip 1.0) and pipeline schedule, from the HF weights, with the
    load-balancing loss at `aux_loss_coeff`. Returns, the same on every rank: per step the mean
    LM loss over the global batch, the grad norm and the load-balancing loss of each layer
    (megatron's tracker reduced over ranks, per micro-batch); then the logits of
    `probe` after the last step (on the last stage's TP rank 0 of DP rank 0, else None)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe import moe_utils

    from tools.convert_hf.verify import megatron_logits
    from verl_mcore.models.load import build_and_load

    setup_megatron(tp, pp, ep, etp)
    model, _ = build_and_load("actor", hf_path=hf_dir, dtype="fp32", tp=tp, pp=pp,
                              expert_model_parallel_size=ep,
                              expert_tensor_parallel_size=etp or tp,
                              moe_aux_loss_coeff=aux_loss_coeff)
    config = model.config
    ddp = DistributedDataParallel(
        config=config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                 overlap_grad_reduce=False,
                                                 use_distributed_optimizer=True))
    config.finalize_model_grads_func = finalize_model_grads  # DP / expert-DP grad reductions
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=True, params_dtype=torch.float32), [ddp])
    forward_backward = get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    seq = batches[0]["tokens"].shape[1]
    out: dict = {"loss": [], "grad_norm": [], "aux_loss": []}
    for batch in batches:
        n_micro = batch["tokens"].shape[0] // (dp_size * micro_batch)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        moe_utils.clear_aux_losses_tracker()
        stored = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=_micro_batches(batch, dp_rank, dp_size, micro_batch), model=[ddp],
            num_microbatches=n_micro, seq_length=seq, micro_batch_size=micro_batch,
            forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok, "optimizer step reported failure"
        loss = torch.zeros(1, dtype=torch.float64)
        if parallel_state.is_pipeline_last_stage():
            loss += torch.stack([d["loss"] for d in stored]).double().mean()
            torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss /= dp_size
        torch.distributed.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
        out["loss"].append(loss.item())
        out["grad_norm"].append(float(grad_norm))
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if "load_balancing_loss" in tracker:
            moe_utils.reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
            # The tracker sums this rank's micro-batches; per micro-batch it is the same
            # number whatever the layout (megatron's track_moe_metrics divides likewise).
            values = tracker["load_balancing_loss"]["values"] / n_micro
            out["aux_loss"].append(values.tolist())
    logits = megatron_logits(model, probe)
    keep = parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    out["logits"] = logits if keep else None
    moe_utils.clear_aux_losses_tracker()
    return out
