"""Weight-gradient accumulation on one GPU: models/grad_accum.py (fused, fp32 accumulate in the
GEMM) against megatron's unfused path (bf16 weight gradient, then `main_grad += grad`).

    python bench/probe_wgrad.py                 # 3B Qwen2.5 shapes, 4096 tokens per micro-batch
    python bench/probe_wgrad.py --tokens 8192

For every linear of the model (QKV, attention output, MLP fc1 / fc2, LM head) it checks the fused
result against a float64 reference, times the fused call and the unfused pair (CUDA events,
median of --repeats), and prints the time one micro-batch's backward spends on weight-gradient
accumulation either way. Which fused candidate this torch build takes is printed first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# (name, out_features, in_features, count per model) of Qwen2.5-3B: hidden 2048, 16 query heads
# and 2 KV groups of 128, ffn 11008, vocab 151936 (LM head tied to the embedding), 36 layers.
LINEARS_3B = [
    ("qkv", 2048 + 2 * 2 * 128, 2048, 36),
    ("proj", 2048, 2048, 36),
    ("fc1", 2 * 11008, 2048, 36),
    ("fc2", 2048, 11008, 36),
    ("lm_head", 151936, 2048, 1),
]


def _time(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` CUDA-event-timed calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (GEMM K)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_wgrad: needs a CUDA device")
    from verl_mcore.models import grad_accum

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device("cuda")
    fused = grad_accum.probe(device, dtype)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: fused candidate = "
          f"{fused.__name__ if fused else None} (None: the shim falls back to mm + add_)")
    rows = []
    total_fused = total_unfused = 0.0
    for name, out, inp, count in LINEARS_3B:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(args.tokens, inp, device=device, generator=g).to(dtype)
        go = torch.randn(args.tokens, out, device=device, generator=g).to(dtype)
        main_grad = torch.randn(out, inp, device=device, generator=g)
        # Accuracy against float64, on a copy (timing below accumulates over and over).
        acc = main_grad.clone()
        grad_accum.wgrad_gemm_accum_fp32(x, go, acc)
        want = main_grad.double().addmm_(go.double().t(), x.double())
        unfused = main_grad.clone().add_(torch.mm(go.t(), x))
        err_fused = float((acc.double() - want).abs().max() / want.abs().max())
        err_unfused = float((unfused.double() - want).abs().max() / want.abs().max())
        del want, unfused
        t_fused = _time(lambda: grad_accum.wgrad_gemm_accum_fp32(x, go, main_grad), args.repeats)
        t_unfused = _time(lambda: main_grad.add_(torch.mm(go.t(), x)), args.repeats)
        t_mm = _time(lambda: torch.mm(go.t(), x), args.repeats)
        flops = 2.0 * args.tokens * out * inp
        rows.append({
            "linear": name, "shape": [out, inp], "count": count,
            "fused_ms": t_fused * 1e3, "unfused_ms": t_unfused * 1e3, "mm_bf16_ms": t_mm * 1e3,
            "fused_tflops": flops / t_fused / 1e12, "mm_tflops": flops / t_mm / 1e12,
            "rel_err_fused": err_fused, "rel_err_unfused": err_unfused,
        })
        total_fused += count * t_fused
        total_unfused += count * t_unfused
        print(f"{name:8s} [{out:6d}, {inp:5d}] x{count:2d}: fused {t_fused * 1e3:7.3f} ms, "
              f"mm + add_ {t_unfused * 1e3:7.3f} ms (mm alone {t_mm * 1e3:7.3f}); rel err vs "
              f"float64 fused {err_fused:.1e}, unfused {err_unfused:.1e}")
        del x, go, main_grad, acc
        torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
        "dtype": args.dtype, "fused_candidate": fused.__name__ if fused else None,
        "per_micro_batch_fused_ms": total_fused * 1e3,
        "per_micro_batch_unfused_ms": total_unfused * 1e3, "linears": rows,
    }
    print(f"one micro-batch's weight-gradient GEMMs + accumulation: fused {total_fused * 1e3:.1f} ms,"
          f" unfused {total_unfused * 1e3:.1f} ms")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
