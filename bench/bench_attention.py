"""Core attention in the local layer spec: megatron's DotProductAttention vs our SDPA module.

    python bench/bench_attention.py                   # one GPU, bf16 (no TransformerEngine needed)
    python bench/bench_attention.py --shape tiny      # CPU smoke run

What runs: a Qwen2.5-1.5B-shaped GPTModel with random weights (28 layers, hidden 1536, 12 query
heads over 2 KV groups of 128, ffn 8960, vocab 151936, tied embeddings, QKV bias), bf16
parameters, built by verl_mcore.models with core_attention = "local" (megatron's
DotProductAttention: the [b, heads, s, s] scores are materialised) or "sdpa" (our module:
F.scaled_dot_product_attention, causal, GQA without repeating K/V). Each iteration is one
forward + backward of the LM loss (megatron's vocab-parallel cross entropy) over a batch of
`--batch` x `--seq` tokens; "sdpa-packed" runs the same tokens as one THD row with cu_seqlens
(torch varlen flash attention on GPU).

Timing: `--warmup` iterations, then `--iters` timed with CUDA events; the median is reported.
TFLOP/s counts 6 * N * tokens (N = all matmul parameters, the tied output layer once) plus causal
attention 6 * s^2 * head_dim * heads * layers * batch (fwd 2 matmuls over half the square, bwd 2x).
Peak memory: torch.cuda.max_memory_allocated over the timed iterations, model included.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPES = {
    "1.5b": dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_heads=12,
                 num_kv_heads=2, head_dim=128, vocab_size=151936),
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2,
                 head_dim=16, vocab_size=512),
}


def _arch(shape: str, seq: int):
    from verl_mcore.models.hf_config import HFArch, RopeSpec

    s = SHAPES[shape]
    return HFArch(model_type="qwen2", norm_eps=1e-6, rope=RopeSpec(theta=1e6), qkv_bias=True,
                  qk_norm=False, tie_embeddings=True, max_position_embeddings=max(seq, 32768), **s)


def _init() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        backend, device = "nccl", torch.device("cuda", 0)
    else:
        from verl_mcore.distributed import cpu_compat

        cpu_compat.install()
        backend, device = "gloo", torch.device("cpu")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    return device


def _flops(arch, batch: int, seq: int) -> float:
    h, f, L = arch.hidden_size, arch.ffn_hidden_size, arch.num_layers
    qkv = h * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    per_layer = qkv + arch.num_heads * arch.head_dim * h + 3 * h * f
    n = L * per_layer + arch.vocab_size * h  # + the (tied) output layer's matmul
    attention = 6 * seq * seq * arch.head_dim * arch.num_heads * L * batch
    return 6 * n * batch * seq + attention


def _run(variant: str, arch, device, batch: int, seq: int, warmup: int, iters: int) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    core = "local" if variant == "local" else "sdpa"
    model = build_gpt_model(arch, transformer_config(arch, dtype=dtype), core_attention=core,
                            use_te=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (batch, seq + 1), generator=g).to(device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    packed = None
    if variant == "sdpa-packed":
        # The same tokens as one THD row: batch sequences of seq tokens each.
        inputs, labels = inputs.reshape(1, -1), labels.reshape(1, -1)
        positions = positions.reshape(1, -1)
        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=seq, max_seqlen_kv=seq)

    def step():
        loss = model(inputs, positions, None, labels=labels, packed_seq_params=packed)
        loss.float().mean().backward()
        return loss

    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        peak = torch.cuda.max_memory_allocated() / 1e9
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        peak = float("nan")
    sec = statistics.median(times)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"variant": variant, "sec": sec, "tflops": _flops(arch, batch, seq) / sec / 1e12,
            "tokens_per_s": batch * seq / sec, "peak_gb": peak, "times": times}


def _check_outputs(arch, device, seq: int) -> dict:
    """Relative max difference of logits: sdpa vs local, and packed vs padded (bf16 on GPU)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(1)
    model = build_gpt_model(arch, transformer_config(arch, dtype=dtype), use_te=False)
    local = build_gpt_model(arch, transformer_config(arch, dtype=dtype), core_attention="local",
                            use_te=False)
    local.load_state_dict(model.state_dict())
    b = 2
    tokens = torch.randint(0, arch.vocab_size, (b, seq), device=device)
    pos = torch.arange(seq, device=device).unsqueeze(0).expand(b, seq)
    cu = torch.tensor([0, seq, 2 * seq], dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=seq, max_seqlen_kv=seq)
    with torch.no_grad():
        ours = model(tokens, pos, None).float()
        ref = local(tokens, pos, None).float()
        packed = model(tokens.reshape(1, -1), pos.reshape(1, -1), None,
                       packed_seq_params=params).float().reshape(b, seq, -1)
    scale = ref.abs().max().item()
    return {"sdpa_vs_local": (ours - ref).abs().max().item() / scale,
            "packed_vs_padded": (packed - ours).abs().max().item() / scale}


def _flash_accepts_gqa(device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 12, 256, 128, device=device, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 256, 128, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True,
                                                             enable_gqa=True)
        return "yes"
    except RuntimeError as e:
        return f"no ({str(e).splitlines()[0][:80]})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--variants", default="sdpa,sdpa-packed,local")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    device = _init()
    arch = _arch(args.shape, args.seq)
    info = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "shape": args.shape, "batch": args.batch,
            "seq": args.seq, "flash_sdpa_accepts_gqa": _flash_accepts_gqa(device),
            "check": _check_outputs(arch, device, min(args.seq, 512))}
    print(json.dumps(info), flush=True)
    rows = []
    for variant in args.variants.split(","):
        try:
            rows.append(_run(variant, arch, device, args.batch, args.seq, args.warmup, args.iters))
        except torch.OutOfMemoryError as e:
            rows.append({"variant": variant, "error": f"OOM: {str(e).splitlines()[0][:100]}"})
            torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "times"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)
    print(f"\n{'variant':<12} {'s/iter':>8} {'TFLOP/s':>8} {'tokens/s':>10} {'peak GB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} {r['error']}")
        else:
            print(f"{r['variant']:<12} {r['sec']:8.3f} {r['tflops']:8.1f} {r['tokens_per_s']:10.0f} "
                  f"{r['peak_gb']:8.1f}")


if __name__ == "__main__":
    main()
