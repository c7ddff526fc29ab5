"""RL on a real model, ours against TRL: greedy validation accuracy against training seconds.

    MODEL=$(python -m tools.real_model --gguf /tmp/smol.gguf)     # the HF directory
    PYTHONPATH=/tmp/trl_site:$PYTHONPATH python bench/bench_real_model.py --model $MODEL --out $OUT
    PYTHONPATH=/tmp/trl_site:$PYTHONPATH python bench/bench_real_model.py --model $MODEL \
        --device cpu --steps 2 --prompts 2 --n 4 --trl-micro-batch 4 --val-rows 8 --val-every 1
                                                                  # CPU smoke run (~4 minutes)

One invocation trains SmolLM2-135M-Instruct (FINDINGS, "The real-model fixture") three times on
the arithmetic recipe (tools/make_arith_data.py, examples/arith_reward.py), each run in a process
of its own, one after the other on the one GPU:
  grpo   ours, configs/grpo_smollm2_arith.yaml (python -m verl_mcore.train)
  ppo    ours, configs/ppo_smollm2_arith.yaml (GAE with a bf16 critic)
  trl    TRL's GRPOTrainer (transformers generate, no vLLM), this file with --trl-worker

The same work in all three: the same model directory, data files (written here by
tools.make_arith_data into --workdir) and reward function (examples/arith_reward.py's
arith_score, 1 for the right answer in the strict format), --prompts (32) prompts x --n (8)
samples a step at temperature 1, top-p 1, no top-k, up to --response-len (20) new tokens, one
Adam(W) step a batch at --lr (1e-5) constant, no weight decay, grad clip 1, no KL term (TRL's
default beta 0: no reference model; ours: actor.use_kl_loss=false), PPO clip 0.2, token-level
loss over the batch (TRL's loss_type "dapo" ~ our token-mean), GRPO advantages scaled by the
group's std (TRL's scale_rewards "group"). Compute is bf16 with fp32 master weights and Adam
state on both sides (TRL: the model loaded in fp32 with bf16=True, which autocasts; ours:
actor.dtype=bf16 with megatron's fp32 main params). On CPU everything is fp32. Left different:
TRL pads every batch (prompts left, completions right) where ours packs; ours checks the
engine's weights against the trainer's after each update (rollout.logprob_check), TRL has no
such check. Gradient checkpointing is off on both.

Validation: at step 0 and every --val-every steps (and after the last), greedy decoding of every
validation prompt (--val-rows, 64) up to --response-len tokens, scored by the same reward; the
accuracy is the share scored 1. Ours is the trainer's own validation (trainer.val_before_train,
trainer.val_every, val/arith/score/mean@1); TRL's is transformers `generate(do_sample=False)` in a
TrainerCallback, on the same chat-templated prompts.

Clock: training seconds only, summed over steps; model loading, validation and the final
checkpoint are left out of both. Ours: the trainer's timing_s/step (metrics.jsonl; it ends before
validation starts). TRL: on_step_begin .. on_step_end of each optimizer step (generation,
scoring, forward/backward and the optimizer step), with CUDA synchronised at both ends; the
evaluation runs after on_step_end has stopped the clock. Each run's wall seconds (process start
to exit, loading included) are recorded too.

Output in --out, rewritten after each run: real_model_curves.json (every curve, the arguments,
the device, the time for each of ours to reach TRL's final accuracy, how many step-0 greedy
responses ours and TRL's share), real_model_curve.png (accuracy against training seconds: ours
GRPO, ours PPO, TRL GRPO) and each run's log (<run>.log). Data, run directories and checkpoints
stay in --workdir. A run that fails is reported with the tail of its log
(--workdir/<run>.log) and the others still run; the exit code is then 1.

Needs trl 1.16 and, where they are missing, datasets, dill, multiprocess (and xxhash, accelerate,
pandas) on PYTHONPATH for the trl run only (bench/bench_trl_grpo.py's docstring: installed
beside the main environment with `pip install --no-deps --target /tmp/trl_site ...`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = ("grpo", "ppo", "trl")
CONFIGS = {"grpo": "configs/grpo_smollm2_arith.yaml", "ppo": "configs/ppo_smollm2_arith.yaml"}
REWARD_FILE = os.path.join(ROOT, "examples", "arith_reward.py")
REWARD_FN = "arith_score"
LABELS = {"grpo": "ours, GRPO", "ppo": "ours, PPO (GAE, critic)", "trl": "TRL GRPOTrainer"}
# Ours logs validation as val/<data_source>/score/mean@1 (verl_mcore/val_metrics.py); the data
# maker's data_source is "arith".
VAL_KEY = "val/arith/score/mean@1"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the SmolLM2-135M-Instruct HF directory")
    p.add_argument("--out", default=None, help="JSON and PNG go here (default: --workdir)")
    p.add_argument("--workdir", default="runs/bench_real_model",
                   help="data, run directories and logs (each run's directory is replaced)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {RUNS}")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when torch sees a GPU")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each run")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (group size)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--response-len", type=int, default=20, help="max new tokens, train and val")
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--val-rows", type=int, default=64, help="validation prompts (tools.make_arith_data)")
    p.add_argument("--data-seed", type=int, default=0, help="tools.make_arith_data --seed")
    p.add_argument("--trl-micro-batch", type=int, default=64,
                   help="TRL per_device_train_batch_size; gradient_accumulation_steps = prompts x n "
                        "/ this, so one generation feeds one optimizer step")
    # One GPU does all three runs in about 5 minutes; a hung run must not take the others' time.
    p.add_argument("--timeout-s", type=float, default=300, help="per run, loading included")
    p.add_argument("--our-override", action="append", default=[], metavar="a.b=c",
                   help="a config override for both of our runs (repeatable)")
    p.add_argument("--trl-worker", metavar="JSON", help=argparse.SUPPRESS)  # internal: the trl run
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown or not args.runs:
        p.error(f"--runs {','.join(args.runs)}: {unknown or 'none'} not among {RUNS}")
    for name in ("steps", "prompts", "n", "response_len", "val_every", "val_rows", "trl_micro_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps % args.val_every:
        # Ours validates only at multiples of trainer.val_every: TRL's last point must be one too.
        p.error(f"--steps {args.steps} is not a multiple of --val-every {args.val_every}")
    if args.prompts * args.n % args.trl_micro_batch:
        p.error(f"--prompts x --n = {args.prompts * args.n} is not a multiple of "
                f"--trl-micro-batch {args.trl_micro_batch}")
    args.out = args.out or args.workdir
    return args


# ---------------------------------------------------------------------------------------------
# Curves: pure bookkeeping (tests/bench/test_bench_real_model.py)

def our_curve(rows: list[dict], key: str = VAL_KEY) -> list[dict]:
    """[{step, train_seconds, accuracy}] from our metrics.jsonl rows: train_seconds is the sum of
    timing_s/step over the steps up to and including the row's (0 for the step-0 validation).
    Every step's timing must be there: a missing one would shift every later point."""
    points, seconds, last = [], 0.0, 0
    for row in sorted(rows, key=lambda r: r["step"]):
        step = row["step"]
        if step > 0:
            if step != last + 1 or "timing_s/step" not in row:
                raise ValueError(f"metrics.jsonl: step {step} follows step {last} or has no "
                                 f"timing_s/step; the training clock needs every step")
            seconds += row["timing_s/step"]
            last = step
        if key in row:
            points.append({"step": step, "train_seconds": seconds, "accuracy": row[key]})
    return points


class TrainClock:
    """Training seconds of a run whose evaluations happen between steps: `step_begin` and
    `step_end` bracket each optimizer step; `eval_point` records an accuracy at the clock's
    current reading, which evaluation time never advances."""

    def __init__(self, now=time.perf_counter):
        self.now = now
        self.seconds = 0.0
        self.step_seconds: list[float] = []
        self.points: list[dict] = []
        self._started: Optional[float] = None

    def step_begin(self) -> None:
        if self._started is not None:
            raise RuntimeError("TrainClock.step_begin: the previous step never ended")
        self._started = self.now()

    def step_end(self) -> None:
        if self._started is None:
            raise RuntimeError("TrainClock.step_end: no step began")
        took = self.now() - self._started
        self._started = None
        self.seconds += took
        self.step_seconds.append(took)

    def eval_point(self, step: int, accuracy: float, eval_seconds: float) -> dict:
        point = {"step": step, "train_seconds": self.seconds, "accuracy": accuracy,
                 "eval_seconds": eval_seconds}
        self.points.append(point)
        return point


def time_to_reach(curve: list[dict], target: float) -> Optional[dict]:
    """The first point of `curve` (in training seconds) whose accuracy is at least `target`;
    None when it never gets there."""
    for point in sorted(curve, key=lambda p: p["train_seconds"]):
        if point["accuracy"] >= target:
            return point
    return None


def summarize(curves: dict[str, list[dict]]) -> dict:
    """Start, final and best accuracy of each curve, and when each of ours first reached TRL's
    final accuracy (training seconds and step)."""
    out: dict = {"runs": {}}
    for name, curve in curves.items():
        if curve:
            out["runs"][name] = {
                "start_accuracy": curve[0]["accuracy"], "final_accuracy": curve[-1]["accuracy"],
                "best_accuracy": max(p["accuracy"] for p in curve),
                "train_seconds": curve[-1]["train_seconds"], "steps": curve[-1]["step"]}
    trl = curves.get("trl")
    if trl:
        target = trl[-1]["accuracy"]
        out["trl_final_accuracy"] = target
        out["trl_train_seconds"] = trl[-1]["train_seconds"]
        for name in ("grpo", "ppo"):
            if curves.get(name):
                hit = time_to_reach(curves[name], target)
                out[f"{name}_reaches_trl_final"] = (
                    None if hit is None else {"train_seconds": hit["train_seconds"], "step": hit["step"],
                                              "accuracy": hit["accuracy"]})
    return out


# ---------------------------------------------------------------------------------------------
# Data and reward

def make_data(args) -> dict[str, str]:
    from tools import make_arith_data

    data = make_arith_data.splits(args.data_seed, args.val_rows)
    return make_arith_data.write(os.path.join(args.workdir, "data"), data)


def load_reward():
    """examples/arith_reward.py's scorer, imported from its file (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("arith_reward", REWARD_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, REWARD_FN)


def read_rows(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# ---------------------------------------------------------------------------------------------
# Ours: python -m verl_mcore.train in a process of its own

def our_overrides(args, run: str, paths: dict[str, str], run_dir: str) -> list[str]:
    fp32 = args.device == "cpu"  # bf16 on CPU is slow and not what the CPU path is tested with
    out = [
        f"model.path={args.model}",
        f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]",
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"rollout.n={args.n}", f"data.max_response_length={args.response_len}",
        f"actor.optim.lr={args.lr}", "actor.optim.weight_decay=0.0", "actor.use_kl_loss=false",
        f"trainer.total_steps={args.steps}", f"trainer.val_every={args.val_every}",
        "trainer.val_before_train=true", f"trainer.run_dir={run_dir}",
        f"trainer.device={args.device}", "trainer.logger=[console,jsonl]",
        # Every greedy response of each validation, to compare with TRL's at step 0.
        f"trainer.log_val_generations={args.val_rows}",
        # The checkpoint written after the last step is outside the clock; without the optimizer
        # state it is the weights only.
        "checkpoint.save_optimizer=false", "checkpoint.resume=never",
    ]
    if fp32:
        out += ["actor.dtype=fp32", "critic.dtype=fp32", "reference.dtype=fp32"]
    return out + list(args.our_override)


def run_ours(args, run: str, paths: dict[str, str]) -> dict:
    from verl_mcore.tracking import read_metrics

    run_dir = os.path.abspath(os.path.join(args.workdir, run))
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends; start clean
    cmd = [sys.executable, "-m", "verl_mcore.train", "--config", CONFIGS[run],
           *our_overrides(args, run, paths, run_dir)]
    wall = _run_logged(cmd, os.path.join(args.workdir, f"{run}.log"), args.timeout_s)
    rows = read_metrics(run_dir)
    curve = our_curve(rows)
    if len(curve) < 2:
        raise RuntimeError(f"{run}: {run_dir}/metrics.jsonl has {len(curve)} validation points "
                           f"({VAL_KEY}); expected step 0 and every {args.val_every} steps")
    step_seconds = [r["timing_s/step"] for r in rows if r["step"] > 0]
    return {"curve": curve, "step_seconds": step_seconds, "wall_seconds": wall,
            "val_generations_step0": _our_val_generations(run_dir, 0), "command": cmd}


def _our_val_generations(run_dir: str, step: int) -> list[dict]:
    path = os.path.join(run_dir, "val_generations", f"step_{step}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_logged(cmd: list[str], log_path: str, timeout_s: float) -> float:
    """Run `cmd` from the repository root with its output in `log_path`; its wall seconds.
    A failure raises with the log's tail."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(cmd[:5])} ...: killed after --timeout-s {timeout_s:.0f} s"
                               f"{_tail(log_path)}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} ... exited {proc.returncode}{_tail(log_path)}")
    return time.perf_counter() - t0


def _tail(path: str, lines: int = 25) -> str:
    with open(path, errors="replace") as f:
        return f"; the end of {path}:\n" + "".join(f.readlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# TRL: this file with --trl-worker, in a process of its own

def run_trl(args, paths: dict[str, str]) -> dict:
    out = os.path.abspath(os.path.join(args.workdir, "trl_result.json"))
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, os.path.abspath(__file__), *_forwarded(args), "--trl-worker", out]
    wall = _run_logged(cmd, os.path.join(args.workdir, "trl.log"), args.timeout_s)
    with open(out) as f:
        result = json.load(f)
    result["wall_seconds"] = wall
    return result


def _forwarded(args) -> list[str]:
    flags = ["--model", args.model, "--workdir", args.workdir, "--device", args.device,
             "--steps", args.steps, "--prompts", args.prompts, "--n", args.n, "--lr", args.lr,
             "--response-len", args.response_len, "--val-every", args.val_every,
             "--val-rows", args.val_rows, "--data-seed", args.data_seed,
             "--trl-micro-batch", args.trl_micro_batch]
    return [str(f) for f in flags]


def trl_worker(args) -> None:
    """Train with TRL's GRPOTrainer and write its curve to args.trl_worker (JSON)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, GenerationConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = args.device == "cuda"
    paths = {s: os.path.join(args.workdir, "data", f"{s}.parquet") for s in ("train", "val")}
    score = load_reward()
    samples = args.prompts * args.n
    config = GRPOConfig(
        output_dir=os.path.join(args.workdir, "trl_out"), max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, per_device_train_batch_size=args.trl_micro_batch,
        gradient_accumulation_steps=samples // args.trl_micro_batch, num_generations=args.n,
        max_completion_length=args.response_len, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo", scale_rewards="group",
        gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda,
        # fp32 weights and Adam state, bf16 autocast: the precision of our mixed-precision actor.
        model_init_kwargs={"dtype": torch.float32},
        report_to="none", save_strategy="no", push_to_hub=False, logging_steps=1,
        log_completions=False, dataloader_num_workers=0, seed=0,
    )
    # One generation of every completion feeds exactly one optimizer step, as ours.
    if config.generation_batch_size != samples or config.steps_per_generation != config.gradient_accumulation_steps:
        raise SystemExit(f"TRL {trl.__version__} made generation_batch_size "
                         f"{config.generation_batch_size} / steps_per_generation "
                         f"{config.steps_per_generation}; expected {samples} / "
                         f"{config.gradient_accumulation_steps}")

    def reward(completions, data_source, reward_model, extra_info, **kwargs):
        # Conversational prompts: each completion is [{"role": "assistant", "content": text}].
        return [score(src, c[0]["content"], rm["ground_truth"], info)["score"]
                for c, src, rm, info in zip(completions, data_source, reward_model, extra_info)]

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    val_rows = read_rows(paths["val"])
    # The chat template exactly as TRL applies it to training prompts (_tokenize_prompts).
    val_ids = tokenizer.apply_chat_template([r["prompt"] for r in val_rows], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    clock = TrainClock()
    trainer_ref: dict = {}
    generations: dict[int, list[dict]] = {}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def evaluate(step: int) -> None:
        trainer = trainer_ref["trainer"]
        model = trainer.accelerator.unwrap_model(trainer.model)
        sync()
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        width = max(len(ids) for ids in val_ids)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(ids)) + ids for ids in val_ids])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in val_ids])
        gen = GenerationConfig(max_new_tokens=args.response_len, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=trainer.eos_token_ids, temperature=None, top_p=None,
                               top_k=None)
        device = trainer.accelerator.device
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                 generation_config=gen)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        scores = [score(r["data_source"], t, r["reward_model"]["ground_truth"], r["extra_info"])["score"]
                  for r, t in zip(val_rows, texts)]
        if was_training:
            model.train()
        sync()
        point = clock.eval_point(step, sum(scores) / len(scores), time.perf_counter() - t0)
        generations[step] = [{"question": r["prompt"][-1]["content"], "response": t, "score": s}
                             for r, t, s in zip(val_rows, texts, scores)]
        print(f"[trl] step {step}: greedy accuracy {point['accuracy']:.3f} at "
              f"{point['train_seconds']:.1f} training s (eval {point['eval_seconds']:.1f} s)", flush=True)

    class GreedyValidation(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            evaluate(0)

        def on_step_begin(self, targs, state, control, **kw):
            sync()
            clock.step_begin()

        def on_step_end(self, targs, state, control, **kw):
            sync()
            clock.step_end()
            step = state.global_step
            if step % args.val_every == 0:
                evaluate(step)

    dataset = Dataset.from_list(read_rows(paths["train"]))
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[GreedyValidation()])
    trainer_ref["trainer"] = trainer
    trainer.train()
    if len(clock.step_seconds) != args.steps:
        raise SystemExit(f"TRL ran {len(clock.step_seconds)} optimizer steps, not --steps {args.steps}")
    result = {"curve": clock.points, "step_seconds": clock.step_seconds, "trl": trl.__version__,
              "transformers": transformers.__version__, "torch": torch.__version__,
              "val_generations_step0": generations.get(0, [])}
    with open(args.trl_worker, "w") as f:
        json.dump(result, f, indent=1)


# ---------------------------------------------------------------------------------------------
# Report

def step0_agreement(ours: list[dict], trl: list[dict]) -> Optional[dict]:
    """How many step-0 greedy responses are the same text in our run and TRL's, matched by
    question (our rows hold the templated prompt, which contains the question)."""
    if not ours or not trl:
        return None
    same = matched = 0
    for t in trl:
        mine = [o for o in ours if t["question"] in o["prompt"]]
        if len(mine) == 1:
            matched += 1
            same += mine[0]["response"].strip() == t["response"].strip()
    return {"matched": matched, "identical": same, "of": len(trl)}


def plot(curves: dict[str, list[dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, curve in curves.items():
        ax.plot([p["train_seconds"] for p in curve], [p["accuracy"] for p in curve], marker="o",
                label=LABELS[name])
    ax.set_xlabel("training seconds (validation and loading excluded)")
    ax.set_ylabel("greedy validation accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.workdir = os.path.abspath(args.workdir)
    args.model = os.path.abspath(args.model)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model}: no config.json there (make it with "
                         f"`python -m tools.real_model --gguf FILE`)")
    args.out = os.path.abspath(args.out)
    os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    paths = make_data(args)
    results, failures = {}, {}
    for run in args.runs:
        print(f"== {run}: {LABELS[run]}", flush=True)
        try:
            results[run] = run_trl(args, paths) if run == "trl" else run_ours(args, run, paths)
        except RuntimeError as e:
            failures[run] = str(e)
            print(f"{run} FAILED: {e}", file=sys.stderr, flush=True)
        else:
            for p in results[run]["curve"]:
                print(f"   step {p['step']:3d}  {p['train_seconds']:7.1f} s  accuracy {p['accuracy']:.3f}")
        log = os.path.join(args.workdir, f"{run}.log")
        if args.out != args.workdir and os.path.exists(log):
            shutil.copy(log, args.out)  # beside the JSON: the workdir's checkpoints stay behind
        # After every run, so a device session cut short still returns the runs it finished.
        summary = write_report(args, device, results, failures)
    print(json.dumps(summary, indent=1))
    return 1 if failures else 0


def write_report(args, device: str, results: dict, failures: dict) -> dict:
    """real_model_curves.json and real_model_curve.png in --out; returns the summary."""
    curves = {run: r["curve"] for run, r in results.items()}
    summary = summarize(curves)
    summary["step0_greedy_agreement"] = {
        run: step0_agreement(results[run]["val_generations_step0"], results["trl"]["val_generations_step0"])
        for run in ("grpo", "ppo") if run in results and "trl" in results}
    report = {"bench": "bench_real_model", "device": device, "args": vars(args),
              "summary": summary, "failures": failures,
              "runs": {run: {k: v for k, v in r.items() if k != "val_generations_step0"}
                       for run, r in results.items()}}
    json_path = os.path.join(args.out, "real_model_curves.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {json_path}", flush=True)
    if curves:
        png = os.path.join(args.out, "real_model_curve.png")
        plot(curves, png, f"SmolLM2-135M-Instruct, arithmetic, {args.prompts} prompts x {args.n}, "
                          f"lr {args.lr:g}, {device}")
        print(f"wrote {png}", flush=True)
    return summary

if __name__ == "__main__":
    sys.exit(main())
