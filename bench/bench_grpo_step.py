"""One full GRPO step of our trainer, phase by phase: `Trainer(cfg).fit()` in this process.

    python bench/bench_grpo_step.py --json $OUT/grpo_step.json     # GPU: 1.5B shape, 64 x 8, 512/512
    python bench/bench_grpo_step.py --shape tiny                    # CPU smoke run (seconds)
    torchrun --nproc-per-node 8 bench/bench_grpo_step.py ...        # several GPUs (DP), same flags

The work (bench/bench_trl_grpo.py does the same with TRL's GRPOTrainer; bench/grpo_common.py
builds what both share):
  model      a random-weight HF Qwen2 of Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12 heads
             over 2 KV heads, ffn 8960, vocab 151936, tied embeddings, rope theta 1e6), saved as
             bf16 safetensors with its tokenizer in --workdir, loaded by our HF loader.
  prompts    --prompts per step (64), each exactly --prompt-len (512) tokens, --n (8) samples
             each, sampled at temperature 1 up to --response-len (512) new tokens. Random
             weights spread probability over all 151,936 ids, so EOS (one id) is drawn about
             once per 150k tokens: nearly every response runs to the limit; the measured mean
             response length is reported.
  reward     the fraction of a response's digits that are a 7 (custom reward fn, in-process).
  update     GRPO advantages, PPO clipped loss + KL loss against the reference model
             (k3, coefficient 0.001, TRL's `beta`), token-mean, one optimizer step per RL step
             (actor.ppo_mini_batch_size = --prompts), Adam lr 1e-6, no weight decay, grad clip 1.
  layout     bf16 actor and reference, distributed optimizer, TP = PP = 1, packed micro-batches
             of at most --max-tokens tokens (actor.max_tokens_per_microbatch: training, old and
             reference log-probs alike), no activation recompute; the native rollout engine
             decoding every sample at once (rollout.max_num_seqs = prompts x n); optimizer state
             and grads stay on the GPU when the planner finds they fit
             (trainer.offload_between_phases=auto; pass =true to time the host round trips).

Phases (the trainer's `timing_s/<phase>` and `memory_gb/<phase>` metrics): sync (weights to the
engine + the weight-sync check, which decodes rollout.logprob_check.num_sequences=4 sequences of
at most rollout.logprob_check.max_new_tokens tokens), gen, reward, old_logp (only with
actor.recompute_old_log_probs=always: this one-step on-policy update takes the old log-probs
from its own forward pass), ref, adv, actor; "other" is the rest of the step
(offload / onload of the optimizer state, the all-gather of samples, batch building). Seconds are
the median over steps after the first (the first captures CUDA graphs and warms the allocator);
tokens/s per GPU = (prompt + response tokens of the step) / seconds / GPUs; peak memory is
torch.cuda.max_memory_allocated within the phase (max over steps).

Differences from the TRL run: neither computes old log-probs when one generation feeds one
optimizer step (both reuse the detached current ones); TRL has no sync phase, so the table also
gives the step without sync (and old_logp, when forced). TRL recomputes activations (gradient
checkpointing) in its update; we do not (the memory fits).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import grpo_common as common  # noqa: E402

# Per-shape defaults: the GPU setting, and a tiny one that runs on a 2-core CPU in seconds.
DEFAULTS = {
    "1.5b": dict(prompts=64, n=8, prompt_len=512, response_len=512, max_tokens=16384,
                 dtype="bf16", device="cuda"),
    "3b": dict(prompts=64, n=8, prompt_len=512, response_len=512, max_tokens=16384,
               dtype="bf16", device="cuda"),
    "tiny": dict(prompts=4, n=4, prompt_len=16, response_len=8, max_tokens=256,
                 dtype="fp32", device="cpu"),
}
PHASE_ORDER = ["sync", "gen", "reward", "old_logp", "ref", "values", "adv", "critic", "actor"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(DEFAULTS), default="1.5b")
    p.add_argument("--prompts", type=int, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, help="samples per prompt (rollout.n)")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt")
    p.add_argument("--response-len", type=int, help="data.max_response_length")
    p.add_argument("--max-tokens", type=int,
                   help="actor.max_tokens_per_microbatch (update, old and ref log-probs); 0: "
                        "leave it unset, the trainer's default (the planner's budget)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="rollout.gpu_memory_utilization: KV cache cap, share of free memory")
    p.add_argument("--stop-tokens", type=int, default=0,
                   help="random token ids that also end a response (generation_config.json's "
                        "eos_token_id beside EOS): lengths vary as in reasoning runs, a long "
                        "tail up to --response-len (random weights otherwise run every response "
                        "to the limit)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workdir", help="model, data and run directory (default: a temp dir, removed)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("overrides", nargs="*", metavar="a.b=c", help="extra config overrides")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def config_overrides(args, model_dir: str, data_file: str, run_dir: str) -> list[str]:
    samples = args.prompts * args.n
    return [
        f"model.path={model_dir}",
        f"data.train_files=[{data_file}]", f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
        "rollout.engine=native", f"rollout.n={args.n}", "rollout.temperature=1.0",
        f"rollout.max_num_seqs={samples}",
        f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"reward.custom_fn.path={os.path.join(ROOT, 'bench', 'grpo_common.py')}",
        "reward.custom_fn.name=score", "reward.num_workers=0",
        "algorithm.adv_estimator=grpo",
        f"actor.dtype={args.dtype}", f"reference.dtype={args.dtype}",
        f"actor.ppo_mini_batch_size={args.prompts}", "actor.ppo_epochs=1",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.001", "actor.kl_loss_type=k3",
        "actor.optim.lr=1e-6", "actor.optim.weight_decay=0.0",
        "parallel.use_distributed_optimizer=true",
        f"trainer.device={args.device}", f"trainer.total_steps={args.steps}",
        f"trainer.run_dir={run_dir}", "trainer.val_every=0", "trainer.logger=[console,jsonl]",
        "checkpoint.resume=never",
    ] + ([f"actor.max_tokens_per_microbatch={args.max_tokens}",  # 0: the planner's budget
          f"critic.max_tokens_per_microbatch={args.max_tokens}"]  # PPO (adv_estimator=gae) only
         if args.max_tokens else []) + list(args.overrides)


def prepare(args, workdir: str, rank: int) -> tuple[str, str]:
    """Model directory and prompt file (rank 0 writes them; the others wait at a barrier)."""
    import torch.distributed as dist

    model_dir = os.path.join(workdir, f"model_{args.shape}_{args.dtype}")
    data_file = os.path.join(workdir, f"prompts_{args.prompts}x{args.prompt_len}.parquet")
    if rank == 0:
        common.make_model_dir(model_dir, args.shape, "bfloat16" if args.dtype == "bf16" else "float32")
        common.write_parquet(data_file, common.prompt_rows(args.prompts, args.prompt_len))
        _write_stop_ids(model_dir, args.stop_tokens)
    dist.barrier()
    return model_dir, data_file


def _write_stop_ids(model_dir: str, count: int) -> None:
    """generation_config.json with `count` random stop ids beside EOS (the trainer stops at
    every eos_token_id listed there: build.ModelInfo.eos_token_ids), the same ids for a seed;
    written every run, so a reused --workdir never keeps another run's ids."""
    import torch

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    eos = config["eos_token_id"]
    stops = torch.randperm(config["vocab_size"], generator=torch.Generator().manual_seed(0))
    ids = [eos] + [t for t in stops[:count + 1].tolist() if t != eos][:count]
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids if count else eos}, f)


def run(args, workdir: str) -> tuple[list[dict], dict]:
    """Train --steps steps; returns the per-step metric rows (on every rank) and the planner's
    per-phase estimate for the run's config (`planner_estimate`)."""
    import torch.distributed as dist

    from verl_mcore.config import Config, ModelShape, validate
    from verl_mcore.distributed.launch import detect_launch, init_distributed, setup_logging
    from verl_mcore.tracking import read_metrics
    from verl_mcore.trainer import Trainer

    launch = detect_launch()
    setup_logging(launch.rank)  # the trainer's per-step stage lines
    init_distributed(launch, args.device)
    model_dir, data_file = prepare(args, workdir, launch.rank)
    run_dir = os.path.join(workdir, "run")
    if launch.rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends; start clean
    dist.barrier()
    cfg = Config.load(None, config_overrides(args, model_dir, data_file, run_dir))
    validate(cfg, launch.world_size, ModelShape.from_hf_dir(model_dir))
    trainer = Trainer(cfg, launch=launch)
    # The trainer's config: micro-batch budgets as it resolved them (--max-tokens 0).
    estimate = planner_estimate(trainer.cfg, model_dir, launch.world_size, launch.local_world_size)
    _check_prompt_lengths(trainer, args.prompt_len)
    # fit() saves a checkpoint after the last step (27 GB with the optimizer state at 1.5B);
    # after the metrics are logged, so skipping it changes no number here.
    trainer.save_checkpoint = lambda step: None
    code = trainer.fit()
    if code != 0:
        raise SystemExit(f"the trainer exited with {code}")
    dist.barrier()
    return read_metrics(run_dir), estimate


# The trainer's phases whose peak the planner's phases estimate (verl_mcore/planning/memory.py).
PLANNER_PHASE = {"gen": "generate", "old_logp": "score", "ref": "score", "values": "values",
                 "actor": "actor_update", "critic": "critic_update"}


def planner_estimate(cfg, model_dir: str, world: int, gpus_per_node: int) -> dict:
    """{"offload": bool, "why": str, "gib": {planner phase: GiB}} as the trainer's own choice
    (build.resolve_offload) sees this GPU; {} on CPU. GiB leave out the planner's `runtime`
    (CUDA context, NCCL buffers), which torch's allocator does not count, so they compare with
    the measured max_memory_allocated."""
    import torch

    from verl_mcore.planning.memory import Knobs, plan_with_offload_choice, resolve_dims

    if not torch.cuda.is_available():
        return {}
    gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    offload, why, memory = plan_with_offload_choice(
        cfg, resolve_dims(model_dir), world, Knobs(gpus_per_node=gpus_per_node, gpu_memory_gib=gib))
    return {"offload": offload, "why": why,
            "gib": {name: (ph["total"] - ph["components"].get("runtime", 0)) / 2**30
                    for name, ph in memory.items() if name != "host"}}


def _check_prompt_lengths(trainer, prompt_len: int) -> None:
    """Every prompt is exactly prompt_len tokens after the data pipeline (equal work with TRL)."""
    data = trainer.train_data
    lengths = {len(data.prompt_ids(i)) for i in range(len(data))}
    if lengths != {prompt_len}:
        raise SystemExit(f"prompt lengths after the data pipeline are {sorted(lengths)}, "
                         f"not {prompt_len}: the tokenizer or chat template changed")


def summarize(rows: list[dict], world: int, estimate: Optional[dict] = None) -> dict:
    """Per-phase medians (steps after the first) and the whole step, from the metric rows;
    with the planner's `estimate`, its GiB beside each phase's measured peak."""
    med = lambda key: common.median_after_first([r.get(key) for r in rows])  # noqa: E731
    peak = lambda key: max((r[key] for r in rows if r.get(key) is not None), default=None)  # noqa: E731
    tokens = [(r["prompt_length/mean"] + r["response_length/mean"]) * r["samples"] for r in rows]
    step_tokens = common.median_after_first(tokens)
    names = [k[len("timing_s/"):] for k in rows[0] if k.startswith("timing_s/") and k != "timing_s/step"]
    names.sort(key=lambda n: PHASE_ORDER.index(n) if n in PHASE_ORDER else len(PHASE_ORDER))
    step_s = med("timing_s/step")
    phases = []
    for name in names:
        seconds = med(f"timing_s/{name}")
        planned = (estimate or {}).get("gib", {}).get(PLANNER_PHASE.get(name))
        phases.append({"phase": name, "seconds": seconds, "share": seconds / step_s,
                       "tokens_per_s_per_gpu": step_tokens / seconds / world if seconds > 0 else None,
                       "peak_memory_gib": peak(f"memory_gb/{name}"), "planner_gib": planned,
                       "alloc_retries": peak(f"memory/alloc_retries/{name}")})
    other = step_s - sum(p["seconds"] for p in phases)
    phases.append({"phase": "other", "seconds": other, "share": other / step_s,
                   "tokens_per_s_per_gpu": None, "peak_memory_gib": None, "planner_gib": None,
                   "alloc_retries": None})
    response_tokens = med("response_length/mean") * rows[-1]["samples"]
    without = sum(p["seconds"] for p in phases if p["phase"] in ("sync", "old_logp"))
    step = {
        "seconds": step_s, "tokens": step_tokens,
        "tokens_per_s_per_gpu": step_tokens / step_s / world,
        "seconds_without_sync_and_old_logp": step_s - without,
        "tokens_per_s_per_gpu_without_sync_and_old_logp": step_tokens / (step_s - without) / world,
        "mfu_actor": med("perf/mfu/actor") if "perf/mfu/actor" in rows[0] else None,
        "actor_tokens_per_s": med("actor/tokens_per_s") if "actor/tokens_per_s" in rows[0] else None,
        "rollout_tokens_per_s": response_tokens / med("timing_s/gen"),
        "response_length_mean": med("response_length/mean"),
        "response_length_clip_ratio": med("response_length/clip_ratio"),
        "prompt_length_mean": med("prompt_length/mean"),
        "peak_memory_gib": peak("perf/max_memory_allocated_gb"),
        # The engine's share of stepped slots that decoded a live sequence, and (partial
        # rollouts: rollout.partial) how old the trained tokens were and what was interrupted.
        "slot_occupancy": med("rollout/slot_occupancy") if "rollout/slot_occupancy" in rows[0] else None,
        "trained_response_tokens": response_tokens,
        "gen_seconds": med("timing_s/gen"),
        # What partial rollouts change: generation time per trained token (not per sampled one)
        "gen_seconds_per_1k_trained_tokens": 1000 * med("timing_s/gen") / response_tokens,
        **{key.replace("/", "_"): med(key) for key in (
            "rollout/token_age/mean", "rollout/token_age/max", "rollout/partial/aborted",
            "rollout/partial/continued", "rollout/partial/resampled") if key in rows[-1]},
        "steps_in_median": max(1, len(rows) - 1),
    }
    return {"phases": phases, "step": step}


def print_tables(summary: dict, world: int) -> None:
    rows = [[p["phase"], p["seconds"], f"{100 * p['share']:.1f}%", p["tokens_per_s_per_gpu"],
             p["peak_memory_gib"], p.get("planner_gib"), p.get("alloc_retries")]
            for p in summary["phases"]]
    s = summary["step"]
    rows.append(["**step**", s["seconds"], "100%", s["tokens_per_s_per_gpu"], s["peak_memory_gib"],
                 None, None])
    print(common.markdown_table(
        ["phase", "seconds (median)", "share", "tokens/s per GPU", "peak GiB",
         "planner GiB (no runtime)", "allocator retries (max/step)"], rows))
    print()
    print(common.markdown_table(["step", "value"], [
        ["GPUs", world], ["tokens per step (prompt + response)", s["tokens"]],
        ["seconds per step (median after the first)", s["seconds"]],
        ["tokens/s per GPU", s["tokens_per_s_per_gpu"]],
        ["seconds without sync and old_logp (TRL does neither)", s["seconds_without_sync_and_old_logp"]],
        ["tokens/s per GPU without sync and old_logp", s["tokens_per_s_per_gpu_without_sync_and_old_logp"]],
        ["actor MFU (perf/mfu/actor)", s["mfu_actor"]],
        ["rollout tokens/s (response tokens / gen seconds)", s["rollout_tokens_per_s"]],
        ["mean response length", s["response_length_mean"]],
        ["share of responses at the length limit", s["response_length_clip_ratio"]],
        ["peak memory GiB (process, perf/max_memory_allocated_gb)", s["peak_memory_gib"]],
        ["generation seconds (timing_s/gen)", s["gen_seconds"]],
        ["trained response tokens per step", s["trained_response_tokens"]],
        ["generation seconds per 1,000 trained response tokens", s["gen_seconds_per_1k_trained_tokens"]],
        ["slot occupancy (rollout/slot_occupancy)", s["slot_occupancy"]],
        *[[k, s[k]] for k in ("rollout_token_age_mean", "rollout_token_age_max",
                              "rollout_partial_aborted", "rollout_partial_continued",
                              "rollout_partial_resampled") if k in s],
    ]))


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--shape 1.5b needs a CUDA GPU (use --shape tiny on CPU)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_grpo_step_")
    os.makedirs(workdir, exist_ok=True)
    try:
        rows, estimate = run(args, workdir)
    finally:
        if not args.workdir and (not dist.is_initialized() or dist.get_rank() == 0):
            shutil.rmtree(workdir, ignore_errors=True)
    world = dist.get_world_size()
    for r in rows:
        r["samples"] = args.prompts * args.n
    summary = summarize(rows, world, estimate)
    result = {
        "bench": "bench_grpo_step", "args": {k: v for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "gpus": world, "torch": torch.__version__, "ops": _ops_status(), "planner": estimate,
        **summary,
        "per_step": [{k: v for k, v in r.items()
                      if k.split("/")[0] in ("timing_s", "memory_gb", "memory", "perf", "response_length",
                                             "prompt_length", "actor", "critic", "step", "rollout")}
                     for r in rows],
    }
    if dist.get_rank() == 0:
        print(f"\nops: {result['ops']}")
        if estimate:
            print(f"offload between phases: {'on' if estimate['offload'] else 'off'} ({estimate['why']})")
        print()
        print_tables(summary, world)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(common.json_safe(result), f, indent=1)
            print(f"\nwrote {args.json}")
    dist.destroy_process_group()
    return result


def _ops_status() -> str:
    """Which log-prob / GAE ops ran: the CUDA extension or the (much slower) torch reference."""
    from verl_mcore.ops import extension_status

    return extension_status()


if __name__ == "__main__":
    main()
