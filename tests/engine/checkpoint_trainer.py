"""A small megatron training setup for the checkpoint and offload tests, and a script around it.

`build()` makes the tiny GPT of tests/distributed/tiny_gpt.py (same weights at any layout) wrapped
in megatron DDP, the distributed optimizer (Adam) and an OptimizerParamScheduler with warmup and
cosine decay (so the LR differs every step and a lost scheduler state shows in the losses).
`train_step()` runs one optimizer step on one global batch; `next_batch()` draws that batch from
torch's, Python's and numpy's global generators, so a resume that restored any of them wrongly
gives different data and different losses.

As a script it trains on `--world` gloo ranks (1: in the script's own process; more: spawned;
no torchrun), checkpointing with verl_mcore.engine.checkpoint, and appends {"step", "loss"} per
step to `--log` after that step's checkpoint is committed ({"resumed_from": step} on resume):

    python tests/engine/checkpoint_trainer.py --root R --log L --steps 6 [--world 2] [--resume]
        [--async-save] [--pause-in-save-at K]

--pause-in-save-at K: inside the save of step K, once every rank's files are written and before
the commit (rename), create the file L.paused and sleep, so a test can SIGKILL the run half-way
through a save.

Spawned processes (the ranks, and the checkpoint writer's spawn Manager) re-import this file:
hence the __main__ guard, and torch / numpy / megatron imported only inside functions, so that
the Manager's re-import costs no time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

SEED = 1234
GLOBAL_BATCH = 4
MICRO_BATCH = 1
TOTAL_STEPS = 8  # LR schedule length


def build(tp: int = 1, pp: int = 1, dropout: float = 0.0, seed: int = SEED, bf16: bool = False):
    """(chunks, optimizer, scheduler) of the tiny GPT at TP × PP (DP = the rest), same initial
    weights at every layout. (Re-)initialises megatron's parallel_state (the caller destroys it).
    bf16: bf16 parameters in a Float16Module, fp32 main parameters in the optimizer."""
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    from tests.distributed import tiny_gpt
    from verl_mcore.distributed import cpu_compat

    cpu_compat.install()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()  # a second model in the same test body
    parallel_state.initialize_model_parallel(1, 1)
    full = tiny_gpt.reference_state_dict(seed)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # the tracker attention dropout uses
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = tiny_gpt.make_config(tp=tp, pp=pp, hidden_dropout=dropout, attention_dropout=dropout,
                                  bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype)
    model = tiny_gpt.build_model(config)
    tiny_gpt.load_sharded(model, full)
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=True, params_dtype=dtype, bf16=bf16),
        chunks,
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
        lr_decay_steps=TOTAL_STEPS, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=TOTAL_STEPS, wd_incr_style="constant",
    )
    return chunks, optimizer, scheduler


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def next_batch() -> dict:
    """tokens/labels [GLOBAL_BATCH, SEQ] int64, drawn from the global torch, Python and numpy
    RNGs."""
    import numpy as np
    import torch

    from tests.distributed import tiny_gpt

    tokens = torch.randint(0, tiny_gpt.VOCAB, (GLOBAL_BATCH, tiny_gpt.SEQ + 1))
    order = list(range(GLOBAL_BATCH))
    random.shuffle(order)
    shift = int(np.random.randint(0, tiny_gpt.VOCAB))
    tokens = (tokens[order] + shift) % tiny_gpt.VOCAB
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def train_step(chunks, optimizer, scheduler, batch) -> float:
    """One optimizer step on the global batch; the global token-mean loss (same on all ranks)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.distributed import tiny_gpt

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    stored = get_forward_backward_func()(
        forward_step_func=tiny_gpt._forward_step,
        data_iterator=tiny_gpt._micro_batches(batch, dp_rank, dp_size, MICRO_BATCH),
        model=chunks,
        num_microbatches=GLOBAL_BATCH // (dp_size * MICRO_BATCH),
        seq_length=tiny_gpt.SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step failed"
    scheduler.step(increment=1)
    loss = torch.zeros(1, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage():
        loss += torch.stack([d["loss"] for d in stored]).double().mean()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss /= dp_size
    torch.distributed.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
    return loss.item()


# ---------------------------------------------------------------- the script


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from verl_mcore.engine import checkpoint

    seed_everything(SEED)
    chunks, optimizer, scheduler = build(dropout=0.1)
    ckpt = checkpoint.Checkpointer(args.root, keep_last=args.keep_last, async_save=args.async_save)
    step = 0
    if args.resume:
        loaded = ckpt.load(chunks, optimizer, scheduler)
        if loaded is not None:
            assert loaded.rng_restored and loaded.optimizer_restored
            step = loaded.extra_state["step"]
            assert loaded.extra_state["data_position"] == step * GLOBAL_BATCH
            _log(rank, args.log, {"resumed_from": step})
    if args.pause_in_save_at is not None:
        commit = ckpt._commit

        def pausing_commit(pending, meta):
            if pending.step == args.pause_in_save_at:
                torch.distributed.barrier()  # all ranks have written their files
                if rank == 0:
                    open(args.log + ".paused", "w").close()
                time.sleep(3600)  # until the test kills the run
            commit(pending, meta)

        ckpt._commit = pausing_commit
    while step < args.steps:
        loss = train_step(chunks, optimizer, scheduler, next_batch())
        step += 1
        extra = {"step": step, "data_position": step * GLOBAL_BATCH,
                 "kl_controller": {"value": 0.1 * step, "history": [loss]}}
        ckpt.save(step, chunks, optimizer, scheduler, extra)
        ckpt.maybe_finalize(blocking=True)
        _log(rank, args.log, {"step": step, "loss": loss})
    ckpt.close()
    torch.distributed.destroy_process_group()


def _log(rank: int, path: str, record: dict) -> None:
    if rank == 0:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")  # json floats round-trip exactly
            f.flush()
            os.fsync(f.fileno())


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--pause-in-save-at", type=int, default=None)
    args = parser.parse_args(argv)

    if args.world == 1:
        _rank_main(0, 1, _free_port(), args)  # in this process: one interpreter fewer to start
        return
    import multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args))
             for r in range(args.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        sys.exit(f"checkpoint_trainer: rank exit codes {codes}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
