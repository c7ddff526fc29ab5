"""The native engine on one GPU (CUDA graphs, fused kernels, paged flash attention), run by
test_native_gpu.py in a process of its own (it initialises a 1-rank NCCL group): prints one JSON
line of what the test checks."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True)


def teacher_forced(hf, prompt: list[int], response: list[int]) -> tuple[list[float], list[float]]:
    """transformers' log-prob of each response token and its margin to the best token there."""
    ids = torch.tensor([prompt + response], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1: -1].float(), -1)
    chosen = logp.gather(-1, torch.tensor(response, device="cuda").unsqueeze(-1)).squeeze(-1)
    return chosen.tolist(), (logp.max(-1).values - chosen).tolist()


def main() -> None:
    from bench.bench_rollout import build_models, init_single_rank
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT", "29533")
    init_single_rank()
    hf, model, arch = build_models(TINY)
    g = torch.Generator().manual_seed(0)
    # Lengths around the 256-token block: prompts end inside, at and past a block boundary.
    lengths = [5, 255, 256, 257, 300, 40, 511, 17]
    prompts = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist() for n in lengths]
    res = {}

    def check(outs, tag, prompts=prompts):
        diffs, margins = [], []
        for o in outs:
            ref, margin = teacher_forced(hf, prompts[o.prompt_index], o.token_ids)
            if o.logprobs is not None:
                diffs += [abs(a - b) for a, b in zip(o.logprobs, ref)]
            margins += margin
        res[tag] = {"logprob_diff_max": max(diffs) if diffs else None,
                    "greedy_margin_max": max(margins), "tokens": [o.token_ids for o in outs],
                    "stats": {k: v for k, v in engine.last_stats.items() if k != "rollout/seconds"}}

    engine = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=6, steps_per_sync=5)
    res["fused"], res["attention"] = engine.fused, engine.attention
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, logprobs=True)
    check(engine.generate(prompts, greedy), "greedy")
    res["block_size"] = engine.block_size
    sampled = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=40, seed=5, logprobs=True,
                             stop_token_ids=list(range(50)))
    check(engine.generate(prompts, sampled), "sampled")
    check(engine.generate(prompts, sampled), "sampled_again")
    # the tail compacted into fewer slots (4, 2, 1: a graph each) as the last sequences finish
    compact = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=6, steps_per_sync=5,
                           min_compact_slots=1)
    engine, base = compact, engine
    check(compact.generate(prompts, sampled), "sampled_compact")
    engine = base
    del compact
    # A pool of 6 blocks besides the scratch block, and prompts that cross a 256-token block
    # boundary after their first round of steps (admission charges only that round): the growing
    # sequences run out of blocks, the latest admitted are preempted and recomputed.
    tight = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=6, steps_per_sync=5)
    tight._blocks_that_fit = lambda: 7
    engine, base = tight, engine
    crossing = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist() for n in (230, 250, 300, 240, 246)]
    check(tight.generate(crossing, greedy), "greedy_tight", crossing)
    eager = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=6, cuda_graphs=False,
                         fused_decode=False)
    engine = eager
    check(eager.generate(prompts, sampled), "sampled_eager")
    del base
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
