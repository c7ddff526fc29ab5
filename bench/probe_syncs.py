"""Where one actor PPO update makes the CPU wait for the GPU (host syncs), on one GPU.

    python bench/probe_syncs.py --shape 3b --seq 4096 --samples 32

Builds the actor exactly as bench/bench_actor.py does (its model shapes and random batches), runs
one update to warm up, then one more under `torch.cuda.set_sync_debug_mode("warn")`, and prints
every Python line that synchronised, how often, and whether it was inside the engine's
forward_backward (where a sync stalls the queue of micro-batches; the target there is none) or
around it (once per optimizer step: grad norm, metrics, timing).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import bench_actor  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench_actor.SHAPES), default="3b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_syncs: needs a CUDA device")

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl_mcore.config.schema import ActorConfig, OptimConfig
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.engine import MegatronEngine
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config

    bench_actor._init_single_rank()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    arch = bench_actor._arch(args.shape, args.seq)
    config = transformer_config(arch, tp=1, pp=1, dtype="bf16")
    cfg = ActorConfig(dtype="bf16", max_tokens_per_microbatch=args.max_tokens or args.seq,
                      ppo_epochs=1, entropy_coeff=0.001, use_kl_loss=True,
                      optim=OptimConfig(lr=1e-6, weight_decay=0.01, clip_grad=1.0))

    def provider(c, pre_process, post_process, vp_stage):
        return build_gpt_model(arch, c, role="actor", pre_process=pre_process,
                               post_process=post_process, vp_stage=vp_stage)

    engine = MegatronEngine(provider, config, pg, dtype="bf16", optim=cfg.optim, lr_decay_steps=4)
    actor = Actor(engine, cfg, mini_batch_size=args.samples)
    actor.update(bench_actor._batch(args.samples, args.seq, arch.vocab_size, 0))  # warm-up

    inside = [False]
    forward_backward = engine.forward_backward

    def watched(*a, **k):
        inside[0] = True
        try:
            return forward_backward(*a, **k)
        finally:
            inside[0] = False

    engine.forward_backward = watched
    counts: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            where = "inside forward_backward" if inside[0] else "outside"
            counts[(where, f"{os.path.relpath(filename)}:{lineno}")] += 1

    batch = bench_actor._batch(args.samples, args.seq, arch.vocab_size, 1)
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            actor.update(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n_micro = len(engine.micro_batches(batch, max_tokens=cfg.max_tokens_per_microbatch))
    print(f"one update, {n_micro} micro-batches: host syncs by place")
    for (where, place), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1])):
        print(f"{n:6d}  {where:24s} {place}")
    inside_total = sum(n for (where, _), n in counts.items() if where.startswith("inside"))
    print(f"total {sum(counts.values())}, inside forward_backward {inside_total}")
    parallel_state.destroy_model_parallel()
    return {"micro_batches": n_micro, "inside": inside_total, "total": sum(counts.values())}


if __name__ == "__main__":
    main()
