"""Reward-model scoring throughput: samples/s of a reward_model source as the trainer scores it.

    python bench/bench_reward_model.py --workdir /tmp/brm                # 1.5B shape, one GPU
    python bench/bench_reward_model.py --workdir /tmp/brm --shape tiny --samples 16 --prompt 16 --response 16

What runs: a random Qwen2ForSequenceClassification (one label) of the bench shape
(bench/grpo_common.py SHAPES: Qwen2.5-1.5B's), written once to --workdir, built by
build.build_reward_models exactly as the trainer builds a `reward.sources` entry of type
reward_model (megatron-core, bf16, the actor's tokenizer so the ids are scored as they are),
scoring --samples sequences of --prompt + --response random tokens in packed micro-batches of
at most --max-tokens tokens (`RewardModelScorer.score`: forward only, the value at each
sequence's last token). Each of --iters calls after --warmup gets a fresh random batch and is
timed with CUDA events (CPU: perf_counter); the median is reported, with the forward FLOPs per
second against the dense bf16 matmul ceiling measured in the same run
(bench/roofline.matmul_ceiling; CPU: engine/flops.py's fp32 one).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--shape", default="1.5b", choices=["1.5b", "tiny"])
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    return p.parse_args(argv)


def _timed(fn):
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> dict:
    from bench.bench_actor import _init_single_rank
    from bench.roofline import matmul_ceiling
    from bench.grpo_common import make_model_dir
    from verl_mcore import build
    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups
    from verl_mcore.engine.batch import TrainBatch
    from verl_mcore.engine.flops import measured_matmul_ceiling, peak_flops, sequence_flops

    args = parse_args(argv)
    _init_single_rank()
    if not torch.cuda.is_available():
        cpu_compat.install()
    rm_dir = make_model_dir(os.path.join(args.workdir, f"rm_{args.shape}"), args.shape, "bfloat16",
                            seq_cls=True)
    cfg = Config.load(None, [
        f"model.path={rm_dir}", f"data.max_prompt_length={args.prompt}",
        f"data.max_response_length={args.response}",
        "reward.sources=[{name: rm, type: reward_model, path: " + rm_dir + ", dtype: bf16, "
        f"max_tokens_per_microbatch: {args.max_tokens}}}]"])
    groups = build_groups(cfg)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)  # as the trainer seeds (its weights' init)
    info = build.load_model_info(cfg)
    scorer = build.build_reward_models(cfg, groups, info)["rm"]
    assert not scorer.retokenize
    vocab = info.arch.vocab_size

    def batch(seed: int) -> TrainBatch:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (args.samples, args.prompt + args.response), generator=g)
        return TrainBatch.from_sequences(ids[:, :args.prompt].tolist(), ids[:, args.prompt:].tolist(), 0)

    seconds = []
    for i in range(args.warmup + args.iters):
        b = batch(i)  # fresh inputs every call
        scores, s = _timed(lambda: scorer.score(b, [], []))
        assert scores.shape == (args.samples,) and torch.isfinite(scores).all()
        if i >= args.warmup:
            seconds.append(s)
    median = statistics.median(seconds)
    seq = args.prompt + args.response
    flops = sequence_flops(scorer.engine.config, 1, [seq] * args.samples, training=False)
    ceiling = matmul_ceiling() if torch.cuda.is_available() else measured_matmul_ceiling()
    out = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "samples": args.samples, "tokens_per_sample": seq, "seconds_median": median,
        "seconds_all": seconds, "samples_per_s": args.samples / median,
        "tokens_per_s": args.samples * seq / median, "tflops": flops / median / 1e12,
        "matmul_ceiling_tflops": ceiling / 1e12, "share_of_ceiling": flops / median / ceiling,
        "share_of_datasheet_peak": (flops / median / peak_flops()) if peak_flops() else None,
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if torch.cuda.is_available() else None,
    }
    for k, v in out.items():
        print(f"{k}: {v}")
    return out


if __name__ == "__main__":
    main()
