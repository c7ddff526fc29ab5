"""How far an FP8 generation copy's log-probs are from the trainer's, on a real model.

    python bench/fp8_logprob_gap.py                          # SmolLM2-135M-Instruct, fp32, CPU
    python bench/fp8_logprob_gap.py --dtype bf16 --device cuda --json $OUT/fp8_gap.json

One rank. The model (the real-model fixture, verl_mcore/real_model.py, or --model DIR) is loaded
in `--dtype` as the actor would hold it; the native engine samples chat prompts (temperature 1,
`--new-tokens`, with its log-probs) once with the linear weights in that dtype
(rollout.dtype=auto) and once from an e4m3 copy (rollout.dtype=fp8,
Fp8LinearWeights.copy_of); the model's own full-sequence forward recomputes the log-probs of
the sampled tokens (what the trainer's old-log-prob pass and the weight-sync check compute).
Prints, for each: max / mean / 99th percentile of |engine - trainer| over the sampled tokens
(the weight-sync check reads the max: rollout/logprob_diff_max), and the share of greedy tokens
FP8 and full precision agree on (up to each sequence's first difference). The FP8 tolerance of
the check (config/schema.FP8_LOGPROB_ALLOWANCE, rollout/sync_check.py) cites this run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "What is 12 times 7?",
    "Name three primary colors.", "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.", "What does a CPU do?",
    "Who wrote Romeo and Juliet?", "List two benefits of exercise.",
    "What is the boiling point of water in Celsius?", "Say hello in a friendly way.",
    "Why is the sky blue?", "Suggest a name for a pet cat.", "What is an API?",
    "How many legs does a spider have?",
]


def _init(device: str):
    import torch.distributed as dist

    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        cpu_compat.install("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    return build_groups(Config.load(None, []))


def _first_difference_share(a, b) -> float:
    same = total = 0
    for x, y in zip(a, b):
        same += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        total += len(x)
    return same / max(total, 1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF directory (default: the SmolLM2 fixture)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seeds", type=int, default=2, help="sampling seeds (each samples every prompt)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import transformers as T

    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights
    from verl_mcore.real_model import smollm2_dir
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.fp8_weights import Fp8LinearWeights
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.sync_check import model_logprobs_fn

    torch.manual_seed(0)
    groups = _init(args.device)
    hf_dir = args.model or smollm2_dir()
    arch = read_hf_arch(hf_dir)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build_gpt_model(arch, transformer_config(arch, dtype=args.dtype), role="actor",
                            pg_collection=groups.gen)
    load_hf_weights(model, arch, hf_dir, role="actor")
    model = model.to(args.device, dtype).eval()
    tok = T.AutoTokenizer.from_pretrained(hf_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                       add_generation_prompt=True)["input_ids"] for q in PROMPTS]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    trainer = model_logprobs_fn(model, arch.vocab_size)
    out = {"model": hf_dir, "dtype": args.dtype, "device": args.device, "prompts": len(prompts),
           "new_tokens": args.new_tokens, "seeds": args.seeds}
    greedy = {}
    engines = {"auto": NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=len(prompts)),
               "fp8": NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=len(prompts),
                                   fp8_weights=Fp8LinearWeights.copy_of(model))}
    for name, engine in engines.items():
        diffs = []
        for seed in range(args.seeds):
            sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=seed,
                                stop_token_ids=eos, logprobs=True)
            outs = engine.generate(prompts, sp)
            theirs = trainer([prompts[o.prompt_index] for o in outs], [o.token_ids for o in outs], 1.0)
            diffs += [(torch.as_tensor(o.logprobs, dtype=torch.float64) - t.double().cpu()).abs()
                      for o, t in zip(outs, theirs)]
        d = torch.cat(diffs)
        out[name] = {"tokens": d.numel(), "max": d.max().item(), "mean": d.mean().item(),
                     "p99": d.quantile(0.99).item(), "p999": d.quantile(0.999).item()}
        greedy[name] = [o.token_ids for o in engine.generate(
            prompts, SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, stop_token_ids=eos))]
        print(f"rollout.dtype={name}: |engine - trainer| log-prob over {d.numel()} sampled tokens: "
              f"max {out[name]['max']:.4f}, mean {out[name]['mean']:.5f}, p99 {out[name]['p99']:.4f}, "
              f"p99.9 {out[name]['p999']:.4f}")
        engine.sleep()
    out["greedy_agreement"] = _first_difference_share(greedy["fp8"], greedy["auto"])
    out["greedy_identical_sequences"] = sum(a == b for a, b in zip(greedy["fp8"], greedy["auto"]))
    print(f"greedy: FP8 agrees with {args.dtype} on {out['greedy_agreement']:.0%} of tokens (up to each "
          f"sequence's first difference); {out['greedy_identical_sequences']}/{len(prompts)} sequences identical")
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
