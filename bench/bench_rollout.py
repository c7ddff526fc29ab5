"""Native rollout engine vs transformers' `generate` on one GPU, same weights, same settings.

    python bench/bench_rollout.py                 # Qwen2.5-1.5B-shaped random model, bf16
    python bench/bench_rollout.py --batch 32 --new-tokens 64 --no-graphs
    python bench/bench_rollout.py --json $OUT/rollout.json          # for bench/report.py
    python bench/bench_rollout.py --batch 256 --prompt-len 512 --new-tokens 4096 \
        --stop-tokens 100 --max-num-seqs 128     # long responses ending at varied lengths
    python bench/bench_rollout.py --rollout-dtype fp8 --skip-hf   # an FP8 generation copy

Both generate `batch` x `new_tokens` tokens from the same random `prompt_len`-token prompts with
plain sampling (temperature 1, no top-p/top-k) and forced lengths (no stop token), from the same
weights (a random HF Qwen2 model, copied into a megatron GPTModel through models/weight_map).
Each is run once to warm up (CUDA graphs, kernels, allocator), then timed between
`torch.cuda.synchronize()` calls. Prints tokens/s for both and their ratio, the engine's share of
the hardware's bound for the setting (bench/roofline.py: weights + KV per decoding step at the
copy bandwidth, prefill at the matmul ceiling, both measured in this run), plus one JSON line
(also written to --json).

--rollout-dtype fp8 generates from an e4m3 copy of the linear weights (rollout/fp8_weights.py,
as rollout.dtype=fp8 in the training layout) and the bound counts its bytes (roofline.weight_bytes
with fp8: 1 byte a linear weight, 4 per output row).

Needs one CUDA GPU and megatron-core (no TransformerEngine: the local spec with SDPA attention).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

QWEN25_1P5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=True)


def init_single_rank():
    """One NCCL rank with verl_mcore's process groups (TP = PP = TP_g = 1); returns them."""
    import torch.distributed as dist

    from verl_mcore.config import Config
    from verl_mcore.distributed.groups import build_groups

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    return build_groups(Config.load(None, []))


def build_models(hf_kwargs: dict, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """(HF model, megatron model, arch) with identical weights (a random HF Qwen2 model)."""
    import transformers as T

    from verl_mcore.models import weight_map as wm
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config
    from verl_mcore.models.hf_weights import named_canonical_parameters

    hf_config = T.Qwen2Config(**hf_kwargs, dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    with torch.device(device):
        hf = T.Qwen2ForCausalLM(hf_config).to(dtype).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    arch = read_hf_arch(hf_config.to_dict())
    model = build_gpt_model(arch, transformer_config(arch, dtype=dtype, perform_initialization=False),
                            role="actor").to(device, dtype).eval()  # all bf16, as the trainer's
    # Float16Module-wrapped actor is (megatron builds the torch norms' weights in float32)
    maps = {pm.mcore: pm for pm in wm.param_maps(arch, "actor")}
    hf_state = hf.state_dict()
    with torch.no_grad():
        for name, param in named_canonical_parameters(model):
            pm = maps[name]
            param.copy_(wm.hf_to_mcore(pm, arch, [hf_state[n] for n in pm.hf],
                                       padded_vocab=model.vocab_size))
    return hf, model, arch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def compare_unfused(engine, model, arch, args, prompt_lists, sp, tokens) -> dict:
    """The same call without the fused kernels (same weights), and greedy agreement of the two."""
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    engine.sleep()
    plain = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=args.batch,
                         gpu_memory_utilization=0.5, cuda_graphs=not args.no_graphs, fused_decode=False,
                         fp8_weights=engine.fp8_weights)
    timed(lambda: plain.generate(prompt_lists, sp))
    _, secs = timed(lambda: plain.generate(prompt_lists, sp))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    a = [o.token_ids for o in plain.generate(prompt_lists[:32], greedy)]
    plain.sleep()
    b = [o.token_ids for o in engine.generate(prompt_lists[:32], greedy)]
    # position of the first differing token per sequence (bf16 near-ties flip eventually)
    first_diff = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
    print(f"unfused engine: {tokens / secs:10.0f} tokens/s  ({secs:.2f} s); greedy 32 tokens: "
          f"{sum(x == y for x, y in zip(a, b))}/32 sequences identical, mean first difference at "
          f"token {sum(first_diff) / len(first_diff):.1f}")
    return {"unfused_tokens_per_s": tokens / secs, "unfused_seconds": secs,
            "fused_vs_unfused_greedy_identical": sum(x == y for x, y in zip(a, b)) / len(a),
            "fused_vs_unfused_first_diff_mean": sum(first_diff) / len(first_diff)}


def time_repartition(model, arch, groups) -> dict:
    """The Repartitioner filling a separate generation-layout model from `model`. On one GPU every
    layout is TP = PP = 1, where the trainer skips this copy (the training model serves
    generation); this times the machinery and its buffer, with bytes moved against the minimum."""
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config
    from verl_mcore.rollout.repartition import Repartitioner

    gen = build_gpt_model(arch, transformer_config(arch, dtype=torch.bfloat16, perform_initialization=False),
                          role="actor", pg_collection=groups.gen).to("cuda", torch.bfloat16)
    rep = Repartitioner([model], gen, groups, gated_linear_unit=True)
    runs = [rep.run() for _ in range(4)]
    stats = sorted(runs[1:], key=lambda r: r.seconds)[1]  # median of three after a warm-up
    equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), gen.state_dict().values())
                if isinstance(a, torch.Tensor))
    out = {"seconds": stats.seconds, "bytes_received": stats.bytes_received,
           "min_bytes_received": stats.min_bytes_received, "bytes_sent": stats.bytes_sent,
           "weights_equal": equal}
    print(f"repartition (1 GPU, into a separate model): {stats.seconds * 1e3:.1f} ms, "
          f"{stats.bytes_received / 1e9:.2f} GB received (minimum {stats.min_bytes_received / 1e9:.2f}); "
          f"weights equal: {equal}")
    rep.buffer.release()
    del gen
    torch.cuda.empty_cache()
    return out


def stage_breakdown(engine, call) -> dict[str, float]:
    """Seconds per engine stage over one `call`, each stage synchronised (so the stages do not
    overlap as they do in a normal call, where the host queues a round of decoding steps ahead
    of the device). A decoding step (forward, sampling, stop checks) is one CUDA graph, so it is
    timed whole here (bench_decode_parts.py splits it); "host" is the rest: the loop, loading the
    decode state, Python bookkeeping between the stages."""
    labels = {"_admit": "admit (prefill + first sample)", "_step": "decode steps",
              "_grow": "grow (blocks, preemption)", "_collect": "collect (host sync)"}
    seconds = dict.fromkeys(labels.values(), 0.0)
    for attr, label in labels.items():
        fn = getattr(engine, attr)

        def wrapped(*a, _fn=fn, _label=label, **kw):
            sync()
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                sync()
                seconds[_label] += time.perf_counter() - t
        setattr(engine, attr, wrapped)
    try:
        _, total = timed(call)
    finally:
        for attr in labels:
            delattr(engine, attr)  # back to the class methods
    seconds["host"] = total - sum(seconds.values())
    seconds["total"] = total
    print("breakdown (synchronised): " + ", ".join(f"{k} {v:.3f}s" for k, v in seconds.items()))
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=None, help="fewer layers (quick runs)")
    p.add_argument("--no-graphs", action="store_true", help="native engine without CUDA graphs")
    p.add_argument("--skip-hf", action="store_true", help="time only the native engine")
    p.add_argument("--profile", metavar="PATH", default=None,
                   help="profile one more native generate call: where device time went")
    p.add_argument("--breakdown", action="store_true",
                   help="one more native call with each engine stage synchronised and timed")
    p.add_argument("--hf-greedy-tokens", type=int, default=0,
                   help="also time transformers greedy generate for this many new tokens")
    p.add_argument("--compare-unfused", action="store_true",
                   help="also time the engine without its fused decode kernels, and compare tokens")
    p.add_argument("--repartition", action="store_true",
                   help="time the Repartitioner copying the model into a separate generation model")
    p.add_argument("--stop-tokens", type=int, default=0,
                   help="K random token ids end a response (about K / vocabulary a step on the "
                        "random model: lengths vary as real ones do; 0: every response runs to "
                        "--new-tokens)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's slots (default: --batch, every sequence at once)")
    p.add_argument("--n", type=int, default=1,
                   help="samples per prompt (--batch / n distinct prompts; their samples share the "
                        "prompt's KV blocks)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="the KV cache's share of free GPU memory")
    p.add_argument("--steps-per-sync", type=int, default=None,
                   help="decoding steps between host syncs (default: the engine's)")
    p.add_argument("--once", action="store_true",
                   help="one generate call, no warm-up (for the memory report: its time includes "
                        "CUDA graph capture)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the result here (bench/report.py reads it)")
    p.add_argument("--rollout-dtype", choices=["auto", "fp8"], default="auto",
                   help="the generation copy's linear weights (rollout.dtype): the model's bf16, or e4m3")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_rollout needs a CUDA GPU")

    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    groups = init_single_rank()
    hf_kwargs = dict(QWEN25_1P5B)
    if args.layers:
        hf_kwargs["num_hidden_layers"] = args.layers
    hf, model, arch = build_models(hf_kwargs)
    gen = torch.Generator().manual_seed(1)
    if args.batch % args.n:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --n {args.n}")
    prompts = torch.randint(0, arch.vocab_size, (args.batch // args.n, args.prompt_len), generator=gen)
    tokens = args.batch * args.new_tokens
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "layers": arch.num_layers, "cuda_graphs": not args.no_graphs, "n": args.n,
              "gpu_memory_utilization": args.gpu_memory_utilization, "rollout_dtype": args.rollout_dtype}
    fp8_weights = None
    if args.rollout_dtype == "fp8":
        from verl_mcore.ops import fp8 as fp8_ops
        from verl_mcore.rollout.fp8_weights import Fp8LinearWeights

        fp8_weights = Fp8LinearWeights.copy_of(model)
        gemm = fp8_ops.scaled_mm_supported(torch.device("cuda"))
        quant = fp8_ops.quantize_kernel_supported(torch.device("cuda"))
        result.update(fp8_gemm=gemm or "torch._scaled_mm", fp8_quantize=quant or "triton",
                      fp8_weight_bytes=fp8_weights.nbytes)
        print(f"FP8 linears: {fp8_weights.nbytes / 1e9:.2f} GB; GEMM: {gemm or 'torch._scaled_mm'}; "
              f"activation quantization: {quant or 'the Triton kernel'}")

    # The hardware's bound for this setting, from this run's copy bandwidth and matmul ceiling.
    from bench.roofline import copy_bandwidth, generation_bound, matmul_ceiling

    bw, ceiling = copy_bandwidth(), matmul_ceiling()
    distinct = [args.prompt_len] * (args.batch // args.n)  # prefilled once for their n samples
    fp8 = fp8_weights is not None  # the bound reads the bytes of the copy the engine reads
    bound = generation_bound(arch, [args.prompt_len] * args.batch, args.new_tokens, bw, ceiling,
                             prefilled=distinct, fp8=fp8)
    result.update(bound_weight_bytes=bound.weight_bytes, copy_bytes_per_s=bw, matmul_flops_per_s=ceiling, bound_seconds=bound.seconds,
                  bound_decode_seconds=bound.decode_seconds,
                  bound_prefill_seconds=bound.prefill_seconds,
                  bound_tokens_per_s=tokens / bound.seconds)
    print(f"bound: {tokens / bound.seconds:,.0f} tokens/s (decode {bound.decode_seconds:.3f} s of "
          f"weights + KV at {bw / 1e12:.2f} TB/s copy bandwidth; prefill {bound.prefill_seconds:.3f} s "
          f"at {ceiling / 1e12:.0f} TFLOP/s matmul ceiling)")

    extra = {} if args.steps_per_sync is None else {"steps_per_sync": args.steps_per_sync}
    engine = NativeEngine(model, vocab_size=arch.vocab_size,
                          max_num_seqs=args.max_num_seqs or args.batch,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          cuda_graphs=not args.no_graphs, fp8_weights=fp8_weights, **extra)
    result["fused_decode"] = engine.fused
    print(f"fused decode: {engine.fused} ({engine.fused_decode_reason or 'supported'})")
    result["attention"] = engine.attention
    print(f"decode attention: {engine.attention or 'reference'} ({engine.attention_reason or 'paged'}), "
          f"block size {engine.block_size or 'per call'}")
    stops = torch.randperm(arch.vocab_size, generator=gen)[:args.stop_tokens].tolist()
    sp = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0,
                        stop_token_ids=stops)
    prompt_lists = prompts.tolist()
    # Same prompts first as a warm-up (captures the graphs of every attention-length bucket).
    cold = None if args.once else timed(lambda: engine.generate(prompt_lists, sp))[1]
    outs, native_s = timed(lambda: engine.generate(prompt_lists, sp))
    if args.once:
        cold = native_s
    lengths = [len(o.token_ids) for o in outs]
    if stops:  # the bound of the lengths the engine produced (the same seeds: the same samples)
        tokens = sum(lengths)
        bound = generation_bound(arch, [args.prompt_len] * args.batch, lengths, bw, ceiling,
                                 prefilled=distinct, fp8=fp8)
        result.update(bound_seconds=bound.seconds, bound_decode_seconds=bound.decode_seconds,
                      bound_prefill_seconds=bound.prefill_seconds,
                      bound_tokens_per_s=tokens / bound.seconds, stop_tokens=len(stops),
                      response_length_mean=tokens / len(lengths),
                      response_length_min=min(lengths), response_length_max=max(lengths))
        print(f"responses: {len(stops)} stop ids, length mean {tokens / len(lengths):.0f} "
              f"(min {min(lengths)}, max {max(lengths)}); bound of these lengths "
              f"{tokens / bound.seconds:,.0f} tokens/s")
    else:
        assert all(n == args.new_tokens for n in lengths)
    occupancy = engine.last_stats.get("rollout/slot_occupancy")
    # what ran, not what was asked: a failed capture falls back to eager decoding steps
    result["cuda_graphs"] = bool(engine.last_stats.get("rollout/cuda_graphs", 0.0))
    if not args.no_graphs and not result["cuda_graphs"]:
        print("WARNING: CUDA graph capture failed; the timed call decoded eagerly")
    # Memory: the sequences the KV budget held at once, against the contiguous cache this engine
    # had before (slots x the longest sequence, rounded up to 256 tokens, in the same budget).
    kv = engine.last_stats
    budget_tokens = kv["rollout/kv_blocks"] * kv["rollout/kv_block_tokens"]
    contiguous_slots = int(budget_tokens // (-(-(args.prompt_len + args.new_tokens) // 256) * 256))
    result.update(kv_budget_tokens=budget_tokens, peak_live_sequences=kv["rollout/peak_live_sequences"],
                  contiguous_cache_slots=min(contiguous_slots, args.max_num_seqs or args.batch))
    print(f"KV cache: {budget_tokens:,.0f} tokens in {kv['rollout/kv_blocks']:.0f} blocks; "
          f"{kv['rollout/peak_live_sequences']:.0f} sequences live at most (a contiguous cache of "
          f"the same size holds {contiguous_slots}); {kv['rollout/preemptions']:.0f} preemptions, "
          f"{kv['rollout/kv_shared_prefix_blocks']:.0f} prompt blocks shared, "
          f"{kv['rollout/host_syncs']:.0f} host syncs")
    result.update(native_seconds=native_s, native_first_call_seconds=cold,
                  native_tokens_per_s=tokens / native_s, native_stats=engine.last_stats,
                  share_of_bound=bound.seconds / native_s, slot_occupancy=occupancy)
    print(f"native engine : {tokens / native_s:10.0f} tokens/s  ({native_s:.2f} s; first call "
          f"{cold:.2f} s incl. graph capture); {bound.seconds / native_s:.0%} of the bound; "
          f"slot occupancy {occupancy:.0%}")

    for wanted, part in ((args.compare_unfused, lambda: result.update(
            compare_unfused(engine, model, arch, args, prompt_lists, sp, tokens))),
            (args.repartition, lambda: result.update(repartition=time_repartition(model, arch, groups)))):
        if wanted:
            try:  # an optional measurement must not cost the main ones
                part()
            except Exception:  # noqa: BLE001
                import traceback

                traceback.print_exc()
    if args.breakdown:
        result["native_breakdown"] = stage_breakdown(engine, lambda: engine.generate(prompt_lists, sp))
    if args.profile:
        from bench.profiling import kernel_profile

        with kernel_profile(f"native generate, batch {args.batch}, prompt {args.prompt_len}, "
                            f"{args.new_tokens} new", args.profile):
            engine.generate(prompt_lists, sp)

    # Same weights: the first (greedy) token of each prompt should mostly agree (bf16 rounding
    # differs between the two implementations, so not always).
    first = engine.generate(prompt_lists[:16], SamplingParams(temperature=0.0, max_new_tokens=1))
    with torch.no_grad():
        hf_first = hf(prompts[:16].cuda()).logits[:, -1, : arch.vocab_size].argmax(-1).tolist()
    agree = sum(o.token_ids[0] == t for o, t in zip(first, hf_first)) / len(hf_first)
    result["first_token_agreement"] = agree
    print(f"greedy first-token agreement with transformers: {agree:.0%}")

    if not args.skip_hf:
        engine.sleep()
        ids = prompts.cuda()
        mask = torch.ones_like(ids)

        def hf_generate(n):
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                   temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=n,
                                   min_new_tokens=n)

        timed(lambda: hf_generate(8))  # warm-up
        out, hf_s = timed(lambda: hf_generate(args.new_tokens))
        assert out.shape[1] == args.prompt_len + args.new_tokens
        result.update(hf_seconds=hf_s, hf_tokens_per_s=tokens / hf_s,
                      speedup=(tokens / native_s) / (tokens / hf_s))
        print(f"transformers  : {tokens / hf_s:10.0f} tokens/s  ({hf_s:.2f} s)")
        print(f"speedup       : {result['speedup']:.1f}x")
        if args.hf_greedy_tokens:
            n = args.hf_greedy_tokens
            with torch.no_grad():
                _, greedy_s = timed(lambda: hf.generate(input_ids=ids, attention_mask=mask,
                                                        do_sample=False, max_new_tokens=n,
                                                        min_new_tokens=n))
            result["hf_greedy_tokens_per_s"] = args.batch * n / greedy_s
            print(f"transformers greedy, {n} new tokens: {args.batch * n / greedy_s:10.0f} tokens/s")
    print(json.dumps(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
