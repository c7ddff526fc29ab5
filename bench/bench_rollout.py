"""Native rollout engine vs transformers' `generate` on one GPU, same weights, same settings.

    python bench/bench_rollout.py                 # Qwen2.5-1.5B-shaped random model, bf16
    python bench/bench_rollout.py --batch 32 --new-tokens 64 --no-graphs

Both generate `batch` x `new_tokens` tokens from the same random `prompt_len`-token prompts with
plain sampling (temperature 1, no top-p/top-k) and forced lengths (no stop token), from the same
weights (a random HF Qwen2 model, copied into a megatron GPTModel through models/weight_map).
Each is run once to warm up (CUDA graphs, kernels, allocator), then timed between
`torch.cuda.synchronize()` calls. Prints tokens/s for both and their ratio, plus one JSON line.

Needs one CUDA GPU and megatron-core (no TransformerEngine: the local spec with SDPA attention).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

QWEN25_1P5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=True)


def init_single_rank() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


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
                            role="actor").to(device).eval()
    maps = {pm.mcore: pm for pm in wm.param_maps(arch, "actor")}
    hf_state = hf.state_dict()
    with torch.no_grad():
        for name, param in named_canonical_parameters(model):
            pm = maps[name]
            param.copy_(wm.hf_to_mcore(pm, arch, [hf_state[n] for n in pm.hf],
                                       padded_vocab=model.vocab_size))
    return hf, model, arch


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=None, help="fewer layers (quick runs)")
    p.add_argument("--no-graphs", action="store_true", help="native engine without CUDA graphs")
    p.add_argument("--skip-hf", action="store_true", help="time only the native engine")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_rollout needs a CUDA GPU")

    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    init_single_rank()
    hf_kwargs = dict(QWEN25_1P5B)
    if args.layers:
        hf_kwargs["num_hidden_layers"] = args.layers
    hf, model, arch = build_models(hf_kwargs)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, arch.vocab_size, (args.batch, args.prompt_len), generator=gen)
    tokens = args.batch * args.new_tokens
    result = {"device": torch.cuda.get_device_name(), "batch": args.batch,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "layers": arch.num_layers, "cuda_graphs": not args.no_graphs}

    engine = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=args.batch,
                          gpu_memory_utilization=0.5, cuda_graphs=not args.no_graphs)
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    prompt_lists = prompts.tolist()
    # Same prompts first as a warm-up (captures the graphs of every attention-length bucket).
    _, cold = timed(lambda: engine.generate(prompt_lists, sp))
    outs, native_s = timed(lambda: engine.generate(prompt_lists, sp))
    assert all(len(o.token_ids) == args.new_tokens for o in outs)
    result.update(native_seconds=native_s, native_first_call_seconds=cold,
                  native_tokens_per_s=tokens / native_s, native_stats=engine.last_stats)
    print(f"native engine : {tokens / native_s:10.0f} tokens/s  ({native_s:.2f} s; first call "
          f"{cold:.2f} s incl. graph capture)")

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
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
