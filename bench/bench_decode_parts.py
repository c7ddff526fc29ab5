"""Each part of the native engine's decode step against its own bytes, on one GPU.

    python bench/bench_decode_parts.py [--batch 128] [--context 512]

Builds the Qwen2.5-1.5B-shaped model of bench/bench_rollout.py, fills an engine's paged cache to
`context` tokens per sequence, and times (CUDA graph of 20 calls, median of 5 replays, after a
warm-up) one layer's parts -- the four GEMMs, RMSNorm, rotary + cache write, attention over the
cache (the engine's mode, and csrc/paged_attention.cu where the extension has it), the gated
activation --, the LM head, the sampler with its stop checks, and the whole step; then the
kernels one eager step launches (torch.profiler: count and device time by name, and their sum
against the replayed step: the gaps between launches).
Each part's share = (bytes it must read and write) / (time x the copy bandwidth measured in this
run); the whole step against the weights + KV bytes one step must read (bench/roofline.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def graph_time_ms(fn, calls: int = 20, reps: int = 5) -> float:
    """Median device time of one `fn()` (bench_kernels.graph_time_ms: CUDA graph replays)."""
    from bench.bench_kernels import graph_time_ms as timed

    return timed(fn, [()], reps, calls_per_graph=calls)


def step_kernels(step, step_ms: float, top: int = 25, device: str = "cuda") -> dict:
    """The kernels one eager `step()` launches (torch.profiler; one profiled step after a warm-up),
    grouped by name: count and device time per step, and their sum against the graph-replayed step
    time (the rest: gaps between kernels). device "cpu" groups CPU ops instead (a smoke test)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        sync()
    kernels: dict[str, list] = {}
    for ev in prof.events():
        us = ev.device_time_total if cuda else ev.self_cpu_time_total
        if ev.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU) and us > 0:
            entry = kernels.setdefault(ev.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += us
    launched = sum(c for c, _ in kernels.values())
    busy_us = sum(t for _, t in kernels.values())
    print(f"  kernels of one eager step: {launched} launches, {busy_us:.0f} us of kernel time against "
          f"{step_ms * 1e3:.0f} us for the graph replay (gaps: {step_ms * 1e3 - busy_us:.0f} us)")
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {us:8.1f} us  {count:4d}x  {name}")
    return {"launches": launched, "kernel_us": busy_us, "graph_step_us": step_ms * 1e3,
            "by_name": {name: {"count": c, "us": t} for name, (c, t) in kernels.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from bench.bench_rollout import QWEN25_1P5B, build_models, init_single_rank
    from bench.roofline import copy_bandwidth, kv_bytes_per_token, weight_bytes
    from verl_mcore.ops import decode as ops
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine, _rmsnorm_params

    init_single_rank()
    _, model, arch = build_models(QWEN25_1P5B)
    bw = copy_bandwidth()
    b, ctx = args.batch, args.context
    engine = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=b)
    # Fill the cache: prompts of ctx - 1 tokens and one new token leave every slot at `ctx`.
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, arch.vocab_size, (b, ctx - 1), generator=g).tolist()
    sp = SamplingParams(temperature=1.0, max_new_tokens=2, seed=0)
    engine.generate(prompts, sp)
    net = engine.net
    layer = net.layers[0]
    e = 2  # bf16 bytes
    h, ffn, r = arch.hidden_size, arch.ffn_hidden_size, net.heads // net.groups
    qkv_out = (net.heads + 2 * net.groups) * net.head_dim
    x = torch.randn(1, b, h, device="cuda", dtype=net.dtype)
    attn_in = torch.randn(1, b, net.heads * net.head_dim, device="cuda", dtype=net.dtype)
    fc1_out = torch.randn(1, b, 2 * ffn, device="cuda", dtype=net.dtype)
    act = torch.randn(1, b, ffn, device="cuda", dtype=net.dtype)
    qkv = torch.randn(b, qkv_out, device="cuda", dtype=net.dtype)
    q = torch.randn(b, net.heads, net.head_dim, device="cuda", dtype=net.dtype)
    # One sequence's blocks for every slot (the reads are what count), ctx keys each.
    blocks = -(-ctx // engine.block_size)
    table = torch.arange(1, 1 + b * blocks, device="cuda", dtype=torch.int32).view(b, blocks) % (
        engine.pool.num_blocks - 1) + 1
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    pos = torch.full((b,), ctx - 1, device="cuda", dtype=torch.long)
    rows = ops.cache_rows(table, pos, engine.block_size)
    kc, vc = net.cache_rows(0)
    norm_w, eps = _rmsnorm_params(layer.input_layernorm)
    resid = torch.randn(b, 1, h, device="cuda", dtype=net.dtype)
    delta = torch.zeros_like(resid)
    logits_h = torch.randn(1, b, h, device="cuda", dtype=net.dtype)
    mlp = layer.mlp

    kv_bytes = 2 * b * ctx * net.groups * net.head_dim * e
    parts = {
        "linear_qkv": (lambda: layer.self_attention.linear_qkv(x), e * (h * qkv_out + b * (h + qkv_out))),
        "linear_proj": (lambda: layer.self_attention.linear_proj(attn_in), e * (h * h + 2 * b * h)),
        "mlp fc1": (lambda: mlp.linear_fc1(x), e * (h * 2 * ffn + b * (h + 2 * ffn))),
        "mlp fc2": (lambda: mlp.linear_fc2(act), e * (ffn * h + b * (ffn + h))),
        "rmsnorm (+ residual)": (lambda: ops.rmsnorm(resid, delta, norm_w, eps), e * 4 * b * h),
        "rotary + cache write": (lambda: ops.rope_cache(qkv, net._cos, net._sin, pos, rows, kc, vc, net.groups,
                                                        r, net.head_dim), e * 2 * b * qkv_out),
        "attention over the cache": (lambda: ops.paged_attention(q, net.cache[0, 0], net.cache[0, 1], table, lens,
                                                                 net.scale, flash=engine.attention), kv_bytes),
        "gated activation (torch)": (lambda: ops.swiglu_reference(fc1_out), e * 3 * b * ffn),
        "gated activation (swiglu kernel)": (lambda: ops.swiglu(fc1_out), e * 3 * b * ffn),
        "megatron mlp (fc1, act, fc2)": (lambda: mlp(x), e * (3 * h * ffn + b * (h + 3 * ffn + h))),
        # what the engine runs (a plain SwiGLU MLP: fc1, the csrc swiglu kernel, fc2)
        "engine mlp (fc1, swiglu, fc2)": (lambda: net._mlp(mlp, x), e * (3 * h * ffn + b * (h + 3 * ffn + h))),
        "lm head": (lambda: net.logits(logits_h), e * (model.vocab_size * (h + b) + b * h)),
    }
    if ops.kernel_available(q):
        # csrc/paged_attention.cu over the same cache and table: each sequence's K and V rows once, q, out.
        kernel_bytes = 2 * int(lens.sum()) * net.groups * net.head_dim * e + 2 * q.numel() * e
        parts["paged attention (csrc kernel)"] = (
            lambda: ops.paged_attention(q, net.cache[0, 0], net.cache[0, 1], table, lens, net.scale, flash="kernel"),
            kernel_bytes)
    from verl_mcore.ops import triton_paged

    if triton_paged.available() is None:  # the same reads with the products on tensor cores
        parts["paged attention (triton)"] = (
            lambda: ops.paged_attention(q, net.cache[0, 0], net.cache[0, 1], table, lens, net.scale, flash="triton"),
            2 * int(lens.sum()) * net.groups * net.head_dim * e + 2 * q.numel() * e)
    out = {"device": torch.cuda.get_device_name(), "batch": b, "context": ctx, "copy_bytes_per_s": bw,
           "attention": engine.attention, "fused": engine.fused, "parts": {}}
    print(f"{out['device']}: copy {bw / 1e12:.2f} TB/s; batch {b}, context {ctx}; per call:")
    with torch.no_grad():
        for name, (fn, nbytes) in parts.items():
            ms = graph_time_ms(fn)
            share = nbytes / (ms / 1e3) / bw
            out["parts"][name] = {"ms": ms, "bytes": nbytes, "share": share}
            print(f"  {name:32s} {ms * 1e3:8.1f} us  {nbytes / 1e6:8.2f} MB  {share:5.0%} of copy bandwidth")
        # The whole step (forward, sampling, checks), as the engine replays it.
        slots = engine.max_num_seqs
        ds = next(iter(engine._graphs.values()))
        ds.alive.fill_(True)  # every slot decoding (the state after the fill call is all finished)
        ds.limit.fill_(1 << 40)
        ds.table.zero_()
        ds.table[:, :blocks] = table  # every slot attends to ctx keys

        def step():
            ds.col.zero_()  # the round's column: stays inside the collection buffer
            ds.pos.fill_(ctx - 1)
            engine._graph_body(ds)

        step_ms = graph_time_ms(step, calls=5)
        bound_bytes = weight_bytes(arch) + kv_bytes_per_token(arch) * b * ctx
        out["step"] = {"ms": step_ms, "bound_bytes": bound_bytes, "share": bound_bytes / (step_ms / 1e3) / bw,
                       "slots": slots}
        print(f"  {'whole decode step':32s} {step_ms * 1e3:8.1f} us  {bound_bytes / 1e6:8.2f} MB  "
              f"{out['step']['share']:5.0%} of the bound (weights + KV at copy bandwidth)")
        # The step split in two: the forward to the logits, and the rest (uniforms, sampler, log-probs,
        # stop and length checks) over a fixed logits tensor; each against its own share of the bytes.
        logits = engine._decode_forward(ds)
        forward_ms = graph_time_ms(lambda: engine._decode_forward(ds), calls=5)

        def sample():
            ds.col.zero_()
            engine._sample_step(ds, logits)

        sample_ms = graph_time_ms(sample, calls=5)
        logit_bytes = logits.numel() * logits.element_size()
        for name, ms, nbytes in (("step: forward to logits", forward_ms, bound_bytes),
                                 ("step: sampling and checks", sample_ms, logit_bytes)):
            out["parts"][name] = {"ms": ms, "bytes": nbytes, "share": nbytes / (ms / 1e3) / bw}
            print(f"  {name:32s} {ms * 1e3:8.1f} us  {nbytes / 1e6:8.2f} MB  "
                  f"{out['parts'][name]['share']:5.0%} of copy bandwidth")
        out["kernels"] = step_kernels(lambda: (ds.col.zero_(), ds.pos.fill_(ctx - 1), engine._graph_body(ds)),
                                      step_ms)
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
