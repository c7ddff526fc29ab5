"""Does the native engine give the same tokens and log-probs when the same seeded call is made
twice? On one GPU, per attention mode (torch's flash kernel, the csrc and Triton paged kernels),
with and without CUDA graphs, prefix groups (cascade) and the Triton kernel's own split count; each
line also compares the first call with the flash mode's tokens (equal only up to bf16 rounding).

    python3 bench/probe_repeat.py     (found the failed graph capture of calls with stop ids,
                                       bench/RESULTS.md 2026-12-06 07:49)
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402


def main():
    from bench.bench_rollout import build_models, init_single_rank
    from tests.rollout.native_gpu_body import TINY
    from verl_mcore.ops import triton_paged
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    os.environ["MASTER_PORT"] = "29555"
    init_single_rank()
    hf, model, arch = build_models(TINY)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist()
               for n in [5, 255, 256, 257, 300, 40, 511, 17]]
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, logprobs=True)
    sampled = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=40, seed=5, logprobs=True,
                             stop_token_ids=list(range(50)))
    plain = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=5, logprobs=True)
    split_rule = triton_paged.splits_for
    ref_tokens = {}

    def compare(a, b):
        first, lpd = None, 0.0
        for i, (x, y) in enumerate(zip(a, b)):
            n = next((j for j, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q), None)
            same = n if n is not None else min(len(x.token_ids), len(y.token_ids))
            lpd = max([lpd] + [abs(p - q) for p, q in zip(x.logprobs[:same], y.logprobs[:same])])
            if (n is not None or len(x.token_ids) != len(y.token_ids)) and first is None:
                first = (i, n)
        return first, lpd

    for label, env, graphs, cascade, splits in [
            ("sequence", "0", True, True, None), ("kernel", "1", True, True, None),
            ("triton", "triton", True, True, None), ("triton-nocascade", "triton", True, False, None),
            ("triton-eager", "triton", False, True, None), ("triton-splits1", "triton", True, True, 1),
            ("triton-eager-nocascade", "triton", False, False, None)]:
        os.environ["VERL_MCORE_PAGED_KERNEL"] = env
        triton_paged.splits_for = split_rule if splits is None else (lambda *a, s=splits: s)
        eng = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=6, steps_per_sync=5,
                           cuda_graphs=graphs)
        if not cascade:
            eng.cascade_members = 0
        line = [label, eng.attention]
        for tag, sp in (("greedy", greedy), ("top_p", sampled), ("plain", plain)):
            a = eng.generate(prompts, sp)
            b = eng.generate(prompts, sp)
            first, lpd = compare(a, b)
            ref = ref_tokens.setdefault(tag, a)
            vs_ref, lpr = compare(a, ref)
            line.append(f"{tag}: repeat first-diff {first} lp {lpd:.2e}; vs sequence {vs_ref} lp {lpr:.2e}; "
                        f"groups {eng.last_stats.get('rollout/prefix_group_rounds')}")
        print(" | ".join(map(str, line)), flush=True)
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
