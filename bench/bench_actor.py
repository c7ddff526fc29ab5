"""Actor PPO update throughput: tokens/s and MFU of the megatron engine on one device.

    python bench/bench_actor.py --shape 1.5b --seq 4096            # one GPU, bf16, no TE needed
    python bench/bench_actor.py --shape tiny --seq 64 --samples 8  # CPU smoke run (gloo)
    python bench/bench_actor.py --shape 3b --max-tokens 12288 --json $OUT/actor_3b.json  # for bench/report.py

What runs: a Qwen2.5-1.5B-shaped model with random weights (28 layers, hidden 1536, 12 query
heads over 2 KV groups of 128, ffn 8960, vocab 151936, tied embeddings, QKV bias) built by
verl_mcore.models (TransformerEngine spec when TE is installed, otherwise megatron's local spec
with our SDPA / varlen core attention), bf16 parameters, fp32 master weights in the distributed
optimizer (Adam), the Actor role's update: PPO loss + entropy bonus + KL loss from vocab-parallel
log-probs, one optimizer step per iteration over `--samples` sequences.

Sequences: lengths uniform in [seq/4, seq] (prompt a quarter of each), packed THD into
micro-batches of at most `--max-tokens` tokens (default: --seq). After `--warmup` updates, each of
`--iters` updates is timed with CUDA events (CPU: perf_counter). tokens/s counts real tokens
(padding excluded); MFU = model FLOPs (verl_mcore/engine/flops.py: 6 N + causal attention per
token, no recompute) / time / dense bf16 peak of the device.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPES = {
    # Qwen2.5-1.5B (config.json of Qwen/Qwen2.5-1.5B)
    "1.5b": dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_heads=12, num_kv_heads=2,
                 head_dim=128, vocab_size=151936, tie_embeddings=True, theta=1e6),
    # Qwen2.5-3B (config.json of Qwen/Qwen2.5-3B)
    "3b": dict(num_layers=36, hidden_size=2048, ffn_hidden_size=11008, num_heads=16, num_kv_heads=2,
               head_dim=128, vocab_size=151936, tie_embeddings=True, theta=1e6),
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2,
                 head_dim=16, vocab_size=512, tie_embeddings=True, theta=1e6),
}


def _arch(shape: str, max_len: int):
    from verl_mcore.models.hf_config import HFArch, RopeSpec

    s = SHAPES[shape]
    return HFArch(
        model_type="qwen2", num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        ffn_hidden_size=s["ffn_hidden_size"], num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"],
        head_dim=s["head_dim"], vocab_size=s["vocab_size"], norm_eps=1e-6, rope=RopeSpec(theta=s["theta"]),
        qkv_bias=True, qk_norm=False, tie_embeddings=s["tie_embeddings"], max_position_embeddings=max(max_len, 32768),
    )


def _init_single_rank() -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))


def _batch(num: int, seq: int, vocab: int, seed: int):
    from verl_mcore.engine.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(2, seq // 4), seq + 1, (num,), generator=g)
    prompt = (lens // 4).clamp(min=1)
    resp = lens - prompt
    width = int(resp.max())
    ids = torch.randint(0, vocab, (num, int(lens.max())), generator=g)
    mask = (torch.arange(width)[None, :] < resp[:, None]).float()
    noise = lambda: torch.randn(num, width, generator=g) * 0.1  # noqa: E731
    return TrainBatch(
        input_ids=ids, prompt_lens=prompt, seq_lens=lens, response_mask=mask,
        old_log_probs=-12.0 + noise(), ref_log_probs=-12.0 + noise(), advantages=noise() * 10,
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    p.add_argument("--seq", type=int, default=4096, help="longest sequence (prompt + response)")
    p.add_argument("--samples", type=int, default=32, help="sequences per update (one optimizer step)")
    p.add_argument("--max-tokens", type=int, default=None, help="token budget per micro-batch (default --seq)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--recompute", action="store_true", help="full activation recompute")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="LoRA adapters of rank R (alpha 2R) on every linear, the base frozen; "
                        "0: full-parameter")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="PATH", default=None,
                   help="after the timed updates, profile one more and write where device time went")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the result here (bench/report.py reads it)")
    args = p.parse_args(argv)

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from bench.roofline import matmul_ceiling
    from verl_mcore.config.schema import ActorConfig, OptimConfig
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.engine import MegatronEngine
    from verl_mcore.engine.flops import peak_flops, sequence_flops
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config

    _init_single_rank()
    cpu_compat.install()  # no-op on GPU
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    pg = ProcessGroupCollection.use_mpu_process_groups()

    arch = _arch(args.shape, args.seq)
    config = transformer_config(arch, tp=1, pp=1, dtype=args.dtype)

    def provider(cfg, pre_process, post_process, vp_stage):
        return build_gpt_model(arch, cfg, role="actor", pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    actor_cfg = ActorConfig(
        dtype=args.dtype, max_tokens_per_microbatch=args.max_tokens or args.seq, ppo_epochs=1,
        entropy_coeff=0.001, use_kl_loss=True, recompute_activations=args.recompute,
        optim=OptimConfig(lr=1e-6, weight_decay=0.01, clip_grad=1.0),
    )
    load = None
    if args.lora:
        from verl_mcore.config.schema import LoRAConfig
        from verl_mcore.models.lora import attach_lora

        lora = LoRAConfig(enable=True, r=args.lora, alpha=2.0 * args.lora)

        def load(module):
            attach_lora(module, lora, arch, seed=args.seed)

    engine = MegatronEngine(provider, config, pg, dtype=args.dtype, optim=actor_cfg.optim,
                            recompute_activations=args.recompute, lr_decay_steps=args.warmup + args.iters,
                            load_weights=load)
    actor = Actor(engine, actor_cfg, mini_batch_size=args.samples)
    cuda = torch.cuda.is_available()
    # Fresh random sequences every update (same length distribution), median over updates.
    per_update = []  # (seconds, tokens, model flops)
    for it in range(args.warmup + args.iters):
        batch = _batch(args.samples, args.seq, arch.vocab_size, args.seed + it)
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        summary, _ = actor.update(batch)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds = time.perf_counter() - t0
        if it >= args.warmup:
            per_update.append((seconds, int(batch.seq_lens.sum()),
                               sequence_flops(engine.config, actor.vocab_size, batch.seq_lens.tolist())))
    if args.profile and cuda:
        from bench.profiling import kernel_profile

        batch = _batch(args.samples, args.seq, arch.vocab_size, args.seed + 10_000)
        with kernel_profile(f"actor update, {args.shape}, seq {args.seq}, {args.samples} samples, "
                            f"max_tokens {actor_cfg.max_tokens_per_microbatch}", args.profile):
            actor.update(batch)
    n_micro = len(engine.micro_batches(batch, max_tokens=actor_cfg.max_tokens_per_microbatch))
    rates = sorted(per_update, key=lambda u: u[2] / u[0])
    seconds, tokens, flops = rates[len(rates) // 2]  # the median update by achieved FLOP/s
    mean = seconds
    peak = peak_flops()
    ceiling = matmul_ceiling() if cuda else None
    result = {
        "shape": args.shape, "lora_r": args.lora, "seq": args.seq, "samples": args.samples, "tokens_per_update": tokens,
        "micro_batches": n_micro, "max_tokens": actor_cfg.max_tokens_per_microbatch, "dtype": args.dtype,
        "recompute": args.recompute, "seconds_per_update": mean, "min_seconds": min(u[0] for u in per_update),
        "tokens_per_s": tokens / mean, "model_tflops_per_update": flops / 1e12,
        "achieved_tflops": flops / mean / 1e12, "mfu": (flops / mean / peak) if peak else None,
        "matmul_ceiling_tflops": ceiling / 1e12 if ceiling else None,
        "mfu_vs_matmul_ceiling": (flops / mean / ceiling) if ceiling else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        # cudaMalloc failures the caching allocator recovered from by freeing its cache (each
        # one synchronizes the device): a sign the micro-batch budget is too close to the limit
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries") if cuda else None,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "grad_norm": summary["actor/grad_norm"], "loss": summary["actor/loss"],
        "transformer_engine": _have_te(),
    }
    print(json.dumps(result, indent=1))
    if args.json and dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def _have_te() -> bool:
    from verl_mcore.models.gpt import have_transformer_engine

    return have_transformer_engine()


if __name__ == "__main__":
    main()
