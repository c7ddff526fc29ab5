"""The GRPO step of bench/bench_grpo_step.py done by TRL's GRPOTrainer (transformers generate,
no vLLM), timed the same way, for a side-by-side table.

    PYTHONPATH=/tmp/trl_site python bench/bench_trl_grpo.py --json $OUT/trl_grpo.json   # GPU
    PYTHONPATH=/tmp/trl_site python bench/bench_trl_grpo.py --shape tiny                # CPU smoke

Needs trl 1.16 (and its dependencies datasets, dill, multiprocess, accelerate, pandas, xxhash);
install them beside the main environment: `pip install --no-deps --target /tmp/trl_site ...`.

Same work as ours (bench/grpo_common.py builds both): the same random Qwen2.5-1.5B-shaped model
directory (pass the same --workdir to reuse it; otherwise it is rebuilt identically) and
tokenizer, the same --prompts (64) prompts of exactly --prompt-len (512) tokens (plain text: no
chat template on either side), --n (8) generations each at temperature 1, top-p 1, no top-k, up
to --response-len (512) new tokens (random weights: nearly every one runs to the limit; the
measured mean is reported), the same reward function, KL to the reference model with
beta = 0.001 (TRL's k3 estimator; ours: actor.kl_loss_type=k3), token-level loss over the batch
(TRL's default "dapo" ~ our token-mean), Adam at lr 1e-6, grad clip 1, and ONE optimizer step
per generation of all prompts x n completions: per_device_train_batch_size (--micro-batch, 16)
x gradient_accumulation_steps (prompts x n / micro-batch = 32) = 512 completions, and TRL 1.16
derives steps_per_generation = gradient_accumulation_steps and generation_batch_size = 512
(checked below), so one `generate` call makes all 512 completions and feeds one optimizer step.

Differences that stay:
  - TRL recomputes activations (gradient_checkpointing=True, its usual setting); we do not.
  - TRL trains the bf16 weights directly (Adam state in bf16, model loaded with dtype=bfloat16);
    ours keeps fp32 master weights and Adam state in the distributed optimizer (more memory;
    kept on the GPU while generating when it fits, trainer.offload_between_phases=auto).
  - Neither computes old log-probs here (one generation per optimizer step: both use the
    detached current ones). TRL has no weight-sync check; ours does (see its table's "without"
    row).
  - TRL pads: prompts left-padded to the longest (all equal here), completions right-padded to
    the longest, and generate decodes every row until all are done; ours packs.

Timing: a TrainerCallback brackets each optimizer step (on_step_begin .. on_step_end, with
torch.cuda.synchronize()); methods of GRPOTrainer are wrapped to split it into gen
(`_generate_single_turn`: transformers generate), ref (reference log-probs), old_logp (if TRL
computes any), reward, the rest of TRL's scoring (advantages, padding, metrics) and train
(everything after scoring: 32 forward/backward micro-steps and the optimizer step). Seconds are
medians over steps after the first; peak memory is torch.cuda.max_memory_allocated within each
phase (max over steps).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import grpo_common as common  # noqa: E402

DEFAULTS = {
    "1.5b": dict(prompts=64, n=8, prompt_len=512, response_len=512, micro_batch=16, dtype="bfloat16"),
    "tiny": dict(prompts=4, n=4, prompt_len=16, response_len=8, micro_batch=4, dtype="float32"),
}
PHASE_ORDER = ["gen", "ref", "old_logp", "reward", "scoring_rest", "train"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(DEFAULTS), default="1.5b")
    p.add_argument("--prompts", type=int, help="prompts per optimizer step")
    p.add_argument("--n", type=int, help="generations per prompt (num_generations)")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt")
    p.add_argument("--response-len", type=int, help="max_completion_length")
    p.add_argument("--micro-batch", type=int, help="per_device_train_batch_size")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (max_steps)")
    p.add_argument("--workdir", help="model directory and TRL output (default: a temp dir, removed)")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    samples = args.prompts * args.n
    if samples % args.micro_batch:
        p.error(f"--prompts x --n = {samples} is not a multiple of --micro-batch {args.micro_batch}")
    return args


class PhaseClock:
    """Seconds and peak allocated memory of possibly nested phases (CUDA synchronised).

    Peaks need torch.cuda.reset_peak_memory_stats() at each phase start; before each reset, and
    at each phase end, the peak counter is folded into every open phase, so an outer phase keeps
    the peaks of the phases inside it.
    """

    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        self.open: dict[str, float] = {}  # name -> start time
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}

    def _sync_and_fold(self) -> None:
        import torch

        if not self.cuda:
            return
        torch.cuda.synchronize()
        now = torch.cuda.max_memory_allocated()
        for name in self.open:
            self.peak[name] = max(self.peak.get(name, 0), now)

    def start(self, name: str) -> None:
        import torch

        self._sync_and_fold()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self._sync_and_fold()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - self.open.pop(name)

    def take(self) -> dict:
        """This step's seconds and peak GiB per phase; resets for the next step."""
        out = {"seconds": self.seconds, "peak_gib": {k: v / 2**30 for k, v in self.peak.items()}}
        self.seconds, self.peak = {}, {}
        return out

    def timed(self, name: str, fn, *args, **kwargs):
        self.start(name)
        try:
            return fn(*args, **kwargs)
        finally:
            self.stop(name)


def build_trainer(args, model_dir: str, out_dir: str, clock: PhaseClock, records: list):
    """A GRPOTrainer whose phases report to `clock`, and a callback closing each step into
    `records` ({"seconds", "peak_gib", "prompt_tokens", "completion_tokens", "generations"})."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    samples = args.prompts * args.n
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=out_dir, max_steps=args.steps, learning_rate=1e-6, weight_decay=0.0,
        max_grad_norm=1.0, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=samples // args.micro_batch, num_generations=args.n,
        max_completion_length=args.response_len, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.001, num_iterations=1, loss_type="dapo",
        gradient_checkpointing=not args.no_gradient_checkpointing,
        bf16=args.dtype == "bfloat16", use_cpu=not cuda,
        model_init_kwargs={"dtype": args.dtype},
        report_to="none", save_strategy="no", push_to_hub=False, logging_steps=1,
        log_completions=False, dataloader_num_workers=0, seed=0,
    )
    # One generation of every completion feeds exactly one optimizer step (see the docstring).
    assert config.generation_batch_size == samples, config.generation_batch_size
    assert config.steps_per_generation == config.gradient_accumulation_steps

    def reward(completions, reward_model, **kwargs):
        return [common.digit_fraction(c, r["ground_truth"]) for c, r in zip(completions, reward_model)]

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with its phases timed; nothing else changes."""

        def _generate_and_score_completions(self, inputs):
            try:
                return clock.timed("scoring", super()._generate_and_score_completions, inputs)
            finally:
                clock.start("train")  # closed by the callback after the optimizer step

        def _generate_single_turn(self, prompt_ids, *a, **k):
            completion_ids, logprobs = clock.timed("gen", super()._generate_single_turn, prompt_ids, *a, **k)
            rec = records[-1]
            rec["generations"] += 1
            # One row per completion: the sampler already repeated each prompt n times.
            rec["prompt_tokens"] += sum(len(p) for p in prompt_ids)
            rec["completion_tokens"] += sum(len(c) for c in completion_ids)
            rec["completions"] += len(completion_ids)
            rec["prompt_lengths"].update(len(p) for p in prompt_ids)
            return completion_ids, logprobs

        def _get_per_token_logps_and_entropies(self, model, *a, **k):
            if torch.is_grad_enabled():  # the training forward: part of "train"
                return super()._get_per_token_logps_and_entropies(model, *a, **k)
            name = "ref" if model is self.ref_model else "old_logp"
            return clock.timed(name, super()._get_per_token_logps_and_entropies, model, *a, **k)

        def _calculate_rewards(self, *a, **k):
            return clock.timed("reward", super()._calculate_rewards, *a, **k)

    class StepClock(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            records.append({"generations": 0, "prompt_tokens": 0, "completion_tokens": 0,
                            "completions": 0, "prompt_lengths": set()})
            clock.start("step")

        def on_step_end(self, targs, state, control, **kw):
            if "train" in clock.open:
                clock.stop("train")
            clock.stop("step")
            records[-1].update(clock.take())

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    rows = common.prompt_rows(args.prompts, args.prompt_len)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "reward_model": r["reward_model"]} for r in rows])
    return TimedGRPOTrainer(model=model_dir, reward_funcs=reward, args=config, train_dataset=dataset,
                            processing_class=tokenizer, callbacks=[StepClock()])


def summarize(records: list[dict], world: int) -> dict:
    med = lambda values: common.median_after_first(values)  # noqa: E731
    tokens = med([r["prompt_tokens"] + r["completion_tokens"] for r in records])
    step_s = med([r["seconds"]["step"] for r in records])
    for r in records:  # the rest of TRL's scoring: advantages, padding, its metrics
        s = r["seconds"]
        s["scoring_rest"] = s["scoring"] - sum(s.get(k, 0.0) for k in ("gen", "ref", "old_logp", "reward"))
    names = [n for n in PHASE_ORDER if any(n in r["seconds"] for r in records)]
    phases = []
    for name in names:
        seconds = med([r["seconds"].get(name, 0.0) for r in records])
        peaks = [r["peak_gib"].get(name) for r in records if r["peak_gib"].get(name) is not None]
        phases.append({"phase": name, "seconds": seconds, "share": seconds / step_s,
                       "tokens_per_s_per_gpu": tokens / seconds / world if seconds > 0 else None,
                       "peak_memory_gib": max(peaks) if peaks else None})
    other = step_s - sum(p["seconds"] for p in phases)
    phases.append({"phase": "other", "seconds": other, "share": other / step_s,
                   "tokens_per_s_per_gpu": None, "peak_memory_gib": None})
    completions = records[-1]["completions"]
    step_peaks = [r["peak_gib"].get("step") for r in records if r["peak_gib"].get("step") is not None]
    step = {
        "seconds": step_s, "tokens": tokens, "tokens_per_s_per_gpu": tokens / step_s / world,
        "rollout_tokens_per_s": med([r["completion_tokens"] / r["seconds"]["gen"] for r in records]),
        "response_length_mean": med([r["completion_tokens"] / r["completions"] for r in records]),
        "prompt_length_mean": med([r["prompt_tokens"] / r["completions"] for r in records]),
        "completions_per_step": completions,
        "generations_per_step": [r["generations"] for r in records],
        "peak_memory_gib": max(step_peaks) if step_peaks else None,
        "steps_in_median": max(1, len(records) - 1),
        "all_step_seconds": [r["seconds"]["step"] for r in records],
    }
    return {"phases": phases, "step": step}


def print_tables(summary: dict, world: int) -> None:
    rows = [[p["phase"], p["seconds"], f"{100 * p['share']:.1f}%", p["tokens_per_s_per_gpu"],
             p["peak_memory_gib"]] for p in summary["phases"]]
    s = summary["step"]
    rows.append(["**step**", s["seconds"], "100%", s["tokens_per_s_per_gpu"], s["peak_memory_gib"]])
    print(common.markdown_table(["phase (TRL)", "seconds (median)", "share", "tokens/s per GPU",
                                 "peak GiB"], rows))
    print()
    print(common.markdown_table(["step (TRL)", "value"], [
        ["GPUs", world], ["tokens per step (prompt + response)", s["tokens"]],
        ["seconds per step (median after the first)", s["seconds"]],
        ["every step's seconds", ", ".join(f"{v:.2f}" for v in s["all_step_seconds"])],
        ["tokens/s per GPU", s["tokens_per_s_per_gpu"]],
        ["rollout tokens/s (completion tokens / gen seconds)", s["rollout_tokens_per_s"]],
        ["mean completion length", s["response_length_mean"]],
        ["completions per step", s["completions_per_step"]],
        ["peak memory GiB (max over steps)", s["peak_memory_gib"]],
    ]))


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch
    import trl

    if args.shape == "1.5b" and not torch.cuda.is_available():
        raise SystemExit("--shape 1.5b needs a CUDA GPU (use --shape tiny on CPU)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_trl_grpo_")
    os.makedirs(workdir, exist_ok=True)
    dtype_tag = "bf16" if args.dtype == "bfloat16" else "fp32"
    # The directory name bench_grpo_step.py uses, so one --workdir serves both.
    model_dir = common.make_model_dir(os.path.join(workdir, f"model_{args.shape}_{dtype_tag}"),
                                      args.shape, args.dtype)
    clock, records = PhaseClock(), []
    try:
        trainer = build_trainer(args, model_dir, os.path.join(workdir, "trl_out"), clock, records)
        trainer.train()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    lengths = set().union(*(r["prompt_lengths"] for r in records))
    if lengths != {args.prompt_len}:
        raise SystemExit(f"TRL tokenised the prompts to {sorted(lengths)} tokens, not {args.prompt_len}")
    if any(r["generations"] != 1 for r in records):
        raise SystemExit(f"expected one generation per optimizer step, got "
                         f"{[r['generations'] for r in records]}")
    world = trainer.accelerator.num_processes
    summary = summarize(records, world)
    for r in records:
        r.pop("prompt_lengths")
    result = {"bench": "bench_trl_grpo", "args": vars(args), "trl": trl.__version__,
              "torch": torch.__version__, "gpus": world,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "gradient_checkpointing": not args.no_gradient_checkpointing, **summary,
              "per_step": records}
    print()
    print_tables(summary, world)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(common.json_safe(result), f, indent=1)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
