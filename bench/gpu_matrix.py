"""The GPU matrix: the trainer for a few steps in every configuration a user can choose.

Each case is one `python -m verl_mcore.train` process on the tiny quickstart model (~3 steps):
every advantage estimator, KL in the reward (fixed / adaptive controller, every penalty kind) and
in the loss (every kind), every policy loss and loss aggregation, packed and padded
micro-batches, offload on / off / auto, critic warm-up, validation, checkpoint save then resume,
and every config in configs/ shrunk to one GPU. It runs before resolving any issue that changes
trainer, engine, algo, reward, rollout or models code (DESIGN.md, test tiers): CPU tests cannot
see device bugs.

On the device machine (one H200; carry `.whl` holding the cp312 megatron-core wheel):

    bash bench/gpu_matrix.sh [--cases PATTERN] [--jobs N]    # results under $OUT

bench/gpu_matrix.sh installs the wheels, builds the CUDA extension, makes the tiny model and runs
this driver with a time budget that fits the 10-minute device call. $OUT gets gpu_matrix.md (a
dated entry to append to bench/RESULTS.md), gpu_matrix.json and gpu_matrix_logs.tar.gz (every
case's log.txt, metrics.jsonl and config.yaml; no checkpoints). The device copy has no .git:
pass COMMIT=$(git rev-parse --short HEAD) for the entry.

Here, on CPU, a few cases as a smoke test:

    PYTHONPATH=$PWD python bench/gpu_matrix.py --device cpu --cases adv-grpo,resume-grpo --jobs 1
    python bench/gpu_matrix.py --list

A case passes when its processes exit 0, RUN_DIR/metrics.jsonl has one row per step (plus step 0
with trainer.val_before_train), every metric in it is finite, the metrics the case is about are
there, and a resumed run says "resumed from step N" and continues the rows.

Adding a case: append a Case to CASES. A new option value in verl_mcore/config/schema.py (a
Literal) that no case runs fails tests/bench/test_gpu_matrix.py, which lists it: give it a case,
or an entry in EXEMPT saying why the matrix need not run it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import fnmatch
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grpo_common import markdown_table  # noqa: E402
from bench.report import git_commit  # noqa: E402

QUICKSTART = "configs/quickstart.yaml"

# Every case: the tiny model, the quickstart's data and reward (absolute paths: the cases run
# from any directory), one GPU, small batches, no validation or intermediate saves unless the
# case asks. The trainer always saves at the last step, so every case also saves once.
COMMON = (
    "model.path={model}", "trainer.run_dir={run_dir}", "trainer.device={device}",
    "trainer.total_steps={steps}",
    "data.train_files=[{root}/examples/data/quickstart_train.parquet]",
    "data.val_files=[{root}/examples/data/quickstart_val.parquet]",
    "reward.custom_fn.path={root}/examples/quickstart_reward.py",
    "reward.custom_fn.name=repeat_digit_score",
    "data.max_prompt_length=16", "data.max_response_length=8",
    "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
    "rollout.tensor_parallel_size=1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
    # Micro-batches as users run them: the planner's token budget (the quickstart sets a padded
    # size; the micro-* cases set each path explicitly).
    "actor.micro_batch_size_per_gpu=null", "critic.micro_batch_size_per_gpu=null",
    "trainer.val_every=0", "checkpoint.save_every=0", "rollout.logprob_check.num_sequences=2",
)

GAE = "algorithm.adv_estimator=gae"
KL_KINDS = ("k1", "abs", "k2", "k3", "low_var_kl")


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...] = ()  # on top of COMMON; {root} {model} {run_dir} are filled in
    config: str = QUICKSTART
    # Run a second time to steps + 1 in the same run directory: it must resume from the first
    # run's last checkpoint and continue the metrics rows.
    resume: bool = False
    expect: tuple[str, ...] = ()  # metric names (fnmatch patterns) some row must have
    absent: tuple[str, ...] = ()  # metric names (fnmatch patterns) no row may have
    # Processes of the run; more than one start under torchrun (on one GPU: gloo ranks with
    # trainer.device=cpu).
    ranks: int = 1

    @property
    def summary(self) -> str:
        parts = [] if self.config == QUICKSTART else [f"--config {self.config} (one GPU)"]
        if self.ranks > 1:
            parts.append(f"{self.ranks} ranks (torchrun)")
        parts += list(self.overrides)
        if self.resume:
            parts.append("then resume to steps+1")
        return " ".join(parts) or "quickstart defaults"


def _cases() -> list[Case]:
    cases = [Case(f"adv-{a}", (f"algorithm.adv_estimator={a}",),
                  expect=("critic/vf_loss",) if a == "gae" else ())
             for a in ("gae", "grpo", "rloo", "reinforce_plus_plus",
                       "reinforce_plus_plus_baseline", "remax")]
    kl_reward = ("algorithm.use_kl_in_reward=true",)
    cases += [Case(f"kl-reward-fixed-{k}", kl_reward + (f"algorithm.kl_penalty={k}",),
                   expect=("critic/kl", "critic/kl_coef")) for k in KL_KINDS]
    # PPO's usual pairing: the adaptive controller with a critic.
    cases.append(Case("kl-reward-adaptive-gae", kl_reward + (
        GAE, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01",
        "algorithm.kl_ctrl.horizon=100"), expect=("critic/kl", "critic/kl_coef")))
    cases += [Case(f"kl-loss-{k}", ("actor.use_kl_loss=true", f"actor.kl_loss_type={k}"),
                   expect=("actor/kl_loss",)) for k in KL_KINDS + tuple(k + "+" for k in KL_KINDS)]
    cases += [Case(f"policy-loss-{p}", (f"actor.policy_loss={p}",))
              for p in ("ppo", "gspo", "reinforce", "gpg")]
    cases += [Case(f"loss-agg-{m}", (f"actor.loss_agg_mode={m}",))
              for m in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                        "seq-mean-token-sum-norm")]
    cases += [
        # A mini-batch is 2 prompts x 8 samples of <= 24 tokens: a 64-token budget packs several
        # micro-batches, and micro_batch_size_per_gpu=4 pads four.
        Case("micro-packed-actor", ("actor.max_tokens_per_microbatch=64",)),
        Case("micro-packed-critic", (GAE, "actor.max_tokens_per_microbatch=64",
                                     "critic.max_tokens_per_microbatch=64")),
        Case("micro-padded", (GAE, "actor.micro_batch_size_per_gpu=4",
                              "critic.micro_batch_size_per_gpu=4")),
    ]
    cases += [Case(f"offload-{v}", (GAE, f"trainer.offload_between_phases={v}"),
                   expect=("perf/offloaded_gb",) if v == "true" else ())
              for v in ("true", "false", "auto")]
    cases += [
        Case("critic-warmup", (GAE, "critic.warmup_steps=2"), expect=("critic/vf_loss",)),
        Case("validation", ("trainer.val_every=2", "trainer.val_before_train=true"),
             expect=("val/*",)),
        # Text metrics need rouge-score / sacrebleu, which the device image lacks: exact match,
        # a pass threshold and the generations file.
        Case("validation-metrics", ("trainer.val_every=2", "trainer.val_metrics=[exact_match]",
                                    "trainer.val_pass_threshold=0.5", "trainer.log_val_generations=4"),
             expect=("val/*/exact_match", "val/*/pass@*")),
        Case("resume-grpo", resume=True),
        Case("resume-gae-async-save", (GAE, "checkpoint.async_save=true"), resume=True),
        Case("resume-non-distributed-optimizer", ("parallel.use_distributed_optimizer=false",),
             resume=True),
        Case("dtype-bf16", (GAE, "actor.dtype=bf16", "reference.dtype=bf16", "critic.dtype=bf16",
                            "actor.use_kl_loss=true")),
        Case("dtype-fp16", (GAE, "actor.dtype=fp16", "reference.dtype=fp16", "critic.dtype=fp16",
                            "actor.use_kl_loss=true")),
        Case("lr-cosine", (GAE, "actor.optim.lr_schedule=cosine", "critic.optim.lr_schedule=cosine",
                           "actor.optim.lr_warmup_steps=1", "critic.optim.lr_warmup_steps=1")),
        Case("lr-linear", (GAE, "actor.optim.lr_schedule=linear", "critic.optim.lr_schedule=linear")),
        Case("old-logp-always", ("actor.recompute_old_log_probs=always",),
             expect=("actor/old_entropy",)),
        Case("ppo-epochs-2", (GAE, "actor.ppo_epochs=2"), expect=("timing_s/values",)),
        # A one-step critic update (the whole batch one mini-batch) computes the values in its
        # own forward passes; =always runs the values pass before it anyway.
        Case("critic-one-step", (GAE, "actor.ppo_mini_batch_size=4"),
             expect=("critic/vf_loss", "critic/values/mean"), absent=("timing_s/values",)),
        Case("values-always", (GAE, "actor.ppo_mini_batch_size=4", "critic.recompute_values=always"),
             expect=("timing_s/values",)),
        Case("nonfinite-skip", ("trainer.on_nonfinite=skip",), expect=("train/skipped_updates",)),
        Case("recompute-activations", (GAE, "actor.recompute_activations=true",
                                       "critic.recompute_activations=true")),
        Case("keep-weights-buffer", ("rollout.keep_weights_buffer=true",)),
        # The engine's log-probs travel with the batch; each token's policy loss weighed by the
        # truncated ratio against them (colocated: one GPU).
        Case("rollout-tis-cap", ("rollout.tis_cap=2.0",),
             expect=("rollout/tis_weight_mean", "rollout/tis_clip_fraction",
                     "rollout/engine_vs_trainer_logp_diff")),
        # The off-policy corrections (algo/off_policy.py): IcePop's form (tokens outside
        # [1/2, 2] out of the loss, the kept ones weighed by their ratio) with the sequence mask,
        # then AReaL's decoupled objective; bf16 against the engine, the ratios are real.
        Case("rollout-icepop", ("rollout.tis_cap=2.0", "rollout.correction.token_mask=2.0",
                                "rollout.correction.seq_mask=1.05"),
             expect=("rollout/token_mask_fraction", "rollout/seq_mask_fraction",
                     "rollout/masked_token_fraction", "rollout/ratio_max",
                     "rollout/tis_weight_mean")),
        # The FP8 generation copy (rollout.dtype=fp8): bf16 activations so that the GEMMs take
        # torch._scaled_mm (fp32 ones run the dequantizing reference); the training model
        # serves generation here (one GPU), its e4m3 copy requantized every step. Then with the
        # masked correction (IcePop's form) weighing the FP8 engine against the trainer.
        Case("rollout-fp8", ("rollout.dtype=fp8", "actor.dtype=bf16", "reference.dtype=bf16",
                             "rollout.tis_cap=2.0"),
             expect=("rollout/engine_vs_trainer_logp_diff", "rollout/logprob_diff_max",
                     "rollout/tis_weight_mean")),
        Case("rollout-fp8-token-mask", ("rollout.dtype=fp8", "actor.dtype=bf16",
                                        "reference.dtype=bf16", "rollout.tis_cap=2.0",
                                        "rollout.correction.token_mask=2.0"),
             expect=("rollout/engine_vs_trainer_logp_diff", "rollout/token_mask_fraction",
                     "rollout/masked_token_fraction")),
        Case("rollout-decoupled", ("rollout.correction.decoupled=true",
                                   "rollout.correction.decoupled_cap=2.0"),
             expect=("rollout/decoupled_weight_mean", "rollout/decoupled_capped_fraction",
                     "rollout/ratio_mean"), absent=("rollout/masked_token_fraction",)),
        # The same masks acting on a known share of the tokens: the engine's log-probs skewed by
        # +-0.3 or 0.6 per token id (tests/e2e/skewed_logprobs.py, a rollout.generate_fn).
        Case("rollout-masks-skewed", ("rollout.correction.token_mask=1.5",
                                      "rollout.correction.seq_mask=1.1",
                                      "rollout.generate_fn.path="
                                      "{root}/tests/e2e/skewed_logprobs.py",
                                      "rollout.generate_fn.name=skewed"),
             expect=("rollout/token_mask_fraction", "rollout/seq_mask_fraction",
                     "rollout/masked_token_fraction")),
        # DAPO's overlong handling (algo/overlong.py): the soft penalty on the training scores
        # (data.max_response_length=8: past 4 tokens), truncated samples out of the actor's loss.
        Case("overlong-dapo", ("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                               "actor.mask_truncated_samples=true"),
             expect=("reward/overlong/penalty_mean", "reward/overlong/fraction",
                     "actor/masked_truncated_fraction")),
        # DAPO's dynamic sampling (rollouts.py, rollout/group_filter.py): groups whose samples
        # all score the same are dropped and the step samples more prompts in their place.
        Case("dynamic-sampling", ("algorithm.filter_groups.enable=true",
                                  "algorithm.filter_groups.metric=score",
                                  "algorithm.filter_groups.max_num_gen_batches=8",
                                  "algorithm.filter_groups.on_max_gen_batches=train"),
             expect=("rollout/filter/gen_batches", "rollout/filter/kept_groups",
                     "rollout/filter/trained_groups")),
        # Partial rollouts (partial_rollouts.py, rollout/partial.py): responses of up to 40
        # tokens (several of the engine's 16-step rounds) on 8 slots, 6 groups in flight for 4:
        # samples are aborted at a step's end and continued with the next weights (their KV
        # recomputed), every token's version carried; resumed from the groups in flight.
        Case("partial-rollout", ("rollout.partial.enable=true", "rollout.partial.over_sampling=0.5",
                                 "data.max_response_length=40", "rollout.max_num_seqs=8",
                                 "rollout.tis_cap=2.0"), resume=True,
             expect=("rollout/partial/aborted", "rollout/partial/continued",
                     "rollout/partial/resampled", "rollout/partial/in_flight",
                     "rollout/token_age/mean", "rollout/token_age/max", "rollout/slot_occupancy",
                     "rollout/tis_weight_mean")),
        # A custom generate function (rollout.generate_fn): the example's second pass, masked out
        # of the loss.
        Case("generate-fn", ("data.max_response_length=16",
                             "rollout.generate_fn.path={root}/examples/self_check_generate.py",
                             "rollout.generate_fn.name=answer_then_check",
                             "rollout.generate_fn.kwargs={check_tokens: 3}"),
             expect=("actor/pg_loss",)),
        # An agent loop (rollout.agent_loop) over the engine's serving session: the toy loop's 3
        # turns with fixed observation tokens between them (masked out of the loss) and asyncio
        # waits while the other trajectories decode.
        Case("agent-loop", ("data.max_response_length=20",
                            "rollout.agent_loop.path={root}/tests/agent/toy_loop.py",
                            "rollout.agent_loop.name=ToyLoop",
                            "rollout.agent_loop.kwargs={turns: 3, per_turn: 4, sleep_s: 0.01}",
                            "trainer.val_every=3"),
             expect=("agent/turns_mean", "agent/masked_share", "agent/tool_wait_seconds_mean",
                     "rollout/slot_occupancy", "actor/pg_loss", "val/*")),
        # The built-in agent loops (agent/builtin.py): the calculator called in the sandbox on
        # every turn (a test parser makes each turn a call; plain-text prompts: the tiny model's
        # 16-token prompts leave no room for a tools description), observations as user turns;
        # a two-step environment whose reward trains beside the rule's.
        Case("agent-tools", ("data.max_response_length=32", "data.apply_chat_template=false",
                             "rollout.agent_loop.name=tools",
                             "rollout.agent_loop.tools=[{path: {root}/examples/agent/calculator.py, "
                             "name: calculator}]",
                             "rollout.agent_loop.parser={path: {root}/tests/agent/always_call.py, "
                             "name: always}",
                             "rollout.agent_loop.max_turns=3",
                             "rollout.agent_loop.kwargs={max_tokens_per_turn: 4}",
                             "rollout.agent_loop.observation_role=user",
                             "rollout.agent_loop.sandbox.num_workers=2"),
             expect=("agent/tool/calculator/calls", "rollout/turns/mean",
                     "rollout/masked_token_share")),
        Case("agent-environment", ("data.max_response_length=32", "data.apply_chat_template=false",
                                   "rollout.agent_loop.name=environment",
                                   "rollout.agent_loop.environment={path: {root}/tests/agent/"
                                   "counting_env.py, name: Counting}",
                                   "rollout.agent_loop.kwargs={max_tokens_per_turn: 4}",
                                   "rollout.agent_loop.sandbox.num_workers=2",
                                   "reward.sources=[{name: rule, type: rule}, "
                                   "{name: env, type: environment, weight: 0.5}]"),
             expect=("reward/env/mean", "agent/env/steps", "rollout/masked_token_share")),
        # The reference's weights in host memory between its passes.
        Case("reference-offload", ("actor.use_kl_loss=true", "reference.offload_params=true"),
             expect=("actor/kl_loss",)),
        # A rule source (scored by reward.custom_fn, which replaces the built-in dispatch) and a
        # custom source, weighted.
        Case("reward-sources", (
            "reward.sources=[{name: rule, type: rule}, {name: digits, type: custom, weight: 0.5, "
            "path: {root}/examples/quickstart_reward.py, function: repeat_digit_score}]",),
             expect=("reward/digits/mean",)),
        # A reward model (a tiny Qwen2ForSequenceClassification with the actor's tokenizer,
        # made beside the model) weighted with the rule source.
        Case("reward-model-source", (
            "reward.sources=[{name: rm, type: reward_model, weight: 0.5, path: {model}-rm}, "
            "{name: rule, type: rule, weight: 0.5}]",),
             expect=("reward/rm/mean", "reward/rm/std", "reward/rule/mean")),
        # The quickstart's reward as a batch class (kwargs to its constructor), weighted with
        # the function.
        Case("reward-class", (
            "reward.sources=[{name: rule, type: rule}, {name: judge, type: custom, weight: 0.5, "
            "path: {root}/examples/quickstart_reward.py, function: RepeatDigitJudge, "
            "kwargs: {length: 4}}]",),
             expect=("reward/judge/mean",)),
        Case("reward-models-fp16-fp32", (
            "reward.sources=[{name: half, type: reward_model, dtype: fp16, path: {model}-rm, "
            "micro_batch_size: 3}, {name: full, type: reward_model, dtype: fp32, path: {model}-rm}]",),
             expect=("reward/half/mean", "reward/full/mean")),
        # LoRA: the reference is the actor's base (adapters off), generation gets merged
        # weights, the checkpoints hold the adapters only (resumed here); lm_head too (the tiny
        # model is untied), its B over the padded vocabulary.
        Case("lora-grpo", ("actor.lora.enable=true", "actor.lora.init_lora_weights=gaussian",
                           "actor.lora.target_modules=[all-linear,lm_head]",
                           "actor.use_kl_loss=true", "actor.optim.lr=1e-3"), resume=True,
             expect=("actor/kl_loss", "rollout/logprob_diff_max")),
        # trainer.device=cpu where torch has CUDA: the CPU path (cpu_compat, gloo) must be taken
        # for the configured device; it segfaulted in the distributed optimizer's first
        # parameter all-gather when CUDA's presence decided (tests/e2e/test_cpu_device.py).
        Case("device-cpu", ("trainer.device=cpu", "parallel.use_distributed_optimizer=true")),
        Case("device-cpu-2-ranks", ("trainer.device=cpu", "parallel.use_distributed_optimizer=true"),
             ranks=2),
        # A mixture-of-experts actor ({model}-moe: tools.make_tiny_model --moe, 4 experts, top-2,
        # a shared expert) with routing replay: the engine records its experts, the old-log-prob
        # (two epochs), reference and update passes replay them; the mismatch metric is the
        # share of decisions the trainer's bf16 routers would have taken otherwise.
        Case("moe-router-replay", ("model.path={model}-moe", "actor.router_replay=rollout",
                                   "actor.use_kl_loss=true", "actor.ppo_epochs=2"),
             expect=("actor/router_replay_mismatch", "actor/moe_tokens_per_expert_max",
                     "actor/kl_loss")),
        Case("lora-ppo-bf16", (GAE, "actor.lora.enable=true", "critic.lora.enable=true",
                               "actor.lora.target_modules=[q_proj,v_proj]", "actor.dtype=bf16",
                               "critic.dtype=bf16", "reference.dtype=bf16"), resume=True,
             expect=("critic/vf_loss",)),
    ]
    # Every shipped config, as a user would start it, on the tiny model and one GPU (COMMON).
    cases += [Case(f"config-{p.stem}", config=f"configs/{p.name}")
              for p in sorted((ROOT / "configs").glob("*.yaml"))]
    return cases


CASES = _cases()

# Option values the matrix does not run, and why. The coverage test fails on a value that is in
# neither a case nor here, and on an entry here that a case runs or the schema no longer has.
EXEMPT: dict[tuple[str, Any], str] = {
    ("rollout.engine", "vllm"): "vLLM is not installed on the device machine (README: Not run)",
    ("rollout.mode", "one_step_off"): "needs placement.rollout, GPUs of its own: no machine of "
    "several GPUs was lent; tests/e2e/test_rollout_set.py runs it on 4 CPU gloo ranks",
    ("rollout.mode", "fully_async"): "needs placement.rollout, GPUs of its own (one GPU cannot "
    "hold a rollout set): its timings are owed to the multi-GPU issue; "
    "tests/e2e/test_fully_async.py runs it on 4 CPU gloo ranks",
    ("trainer.device", "auto"): "every case runs on --device (cuda on the H200) or on the CPU",
    ("data.truncation", "truncate_left"): "host-side prompt loading (tests/data)",
    ("data.truncation", "truncate_right"): "host-side prompt loading (tests/data)",
    ("data.on_bad_row", "skip"): "host-side prompt loading (tests/data)",
    ("checkpoint.resume", "never"): "host-side choice of the checkpoint (tests/engine)",
    **{("reward.math_compat", v): "how the host-side built-in GSM8K / MATH / DAPO scorers "
       "compare answers; the quickstart's data has no such source (tests/reward/"
       "test_verl_parity.py, in-process and in reward workers)" for v in ("lenient", "math_verify")},
    **{(f"{role}.lora.init_lora_weights", False): "both adapters random: a test setting (step 0 "
       "differs from the base), run by tests/models/test_lora.py and tests/engine on CPU"
       for role in ("actor", "critic")},
    ("critic.lora.init_lora_weights", "gaussian"): "the adapters' initial draw, host-side "
    "(models/lora.initial_values); the actor's lora-grpo case runs it on the GPU",
    # verl's names for our estimators: KL_PENALTIES maps each to the very function of ours
    # (tests/algo/test_kl.py), which the kl-reward-* and kl-loss-* cases run.
    **{(key, name): f"verl's name for {ours}: the same estimator as the {ours} cases run"
       for key in ("algorithm.kl_penalty", "actor.kl_loss_type")
       for name, ours in (("kl", "k1"), ("mse", "k2"), ("kl+", "k1+"), ("mse+", "k2+"))},
    # In the reward no gradient flows, and "+" changes only the gradient: the value is the
    # named estimator's, which its kl-reward-fixed-* case runs.
    **{("algorithm.kl_penalty", k + "+"): f"in the reward (no gradient) the same values as {k}"
       for k in KL_KINDS},
}


# ---------------------------------------------------------------------------------------------
# Commands and coverage

def commands(case: Case, *, root: str, model: str, run_dir: str, device: str,
             steps: int) -> list[list[str]]:
    """The argv of each process the case runs, in order."""
    fill = dict(root=root, model=model, run_dir=run_dir, device=device, steps=steps)

    def filled(text: str) -> str:  # not str.format: YAML values have braces of their own
        for key, value in fill.items():
            text = text.replace("{" + key + "}", str(value))
        return text

    launcher = [sys.executable]
    if case.ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.ranks}"]
    first = [*launcher, "-m", "verl_mcore.train", "--config", os.path.join(root, case.config),
             *map(filled, COMMON + case.overrides)]
    if not case.resume:
        return [first]
    return [first, first + [f"trainer.total_steps={steps + 1}"]]


def config_of(argv: list[str]):
    """The Config a `python -m verl_mcore.train --config FILE a.b=c ...` argv resolves to."""
    from verl_mcore.config import Config

    at = argv.index("--config")
    return Config.load(argv[at + 1], argv[at + 2:])


def expected_steps(argvs: list[list[str]]) -> list[int]:
    """The metrics rows' steps after the case's last command: 0 is validation before training."""
    t = config_of(argvs[-1]).trainer
    return ([0] if t.val_before_train else []) + list(range(1, t.total_steps + 1))


def option_fields(cls=None, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: its values} for every schema field whose type is a Literal (or a Union with
    one, e.g. offload_between_phases: bool or "auto"). A list of dataclasses is `key[]`."""
    from verl_mcore.config.schema import Config

    cls = cls or Config
    out: dict[str, tuple] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t, key = hints[f.name], prefix + f.name
        item = typing.get_args(t)[0] if typing.get_origin(t) is list else None
        if dataclasses.is_dataclass(t):
            out.update(option_fields(t, key + "."))
        elif item is not None and dataclasses.is_dataclass(item):
            out.update(option_fields(item, key + "[]."))
        elif values := _literal_values(t):
            out[key] = values
    return out


def _literal_values(t) -> tuple:
    if typing.get_origin(t) is typing.Literal:
        return typing.get_args(t)
    if typing.get_origin(t) is typing.Union:
        literal = [typing.get_args(a) for a in typing.get_args(t)
                   if typing.get_origin(a) is typing.Literal]
        if literal:
            bools = (True, False) if bool in typing.get_args(t) else ()
            return bools + tuple(v for vs in literal for v in vs)
    return ()


def _values_at(cfg, key: str) -> list:
    objs = [cfg]
    for part in key.split("."):
        if part.endswith("[]"):
            objs = [item for o in objs for item in getattr(o, part[:-2])]
        else:
            objs = [getattr(o, part) for o in objs]
    return objs


def _read(cfg, key: str) -> bool:
    """Whether the run reads `key` at all: a value of an unbuilt role, or of a KL that is off,
    is in every resolved config but runs nowhere."""
    from verl_mcore.build import needs_reference

    if key.startswith("critic."):
        return cfg.uses_critic
    if key.startswith("reference."):
        return needs_reference(cfg)
    if key in ("algorithm.kl_penalty", "algorithm.kl_ctrl.type"):
        return cfg.algorithm.use_kl_in_reward
    if key == "actor.kl_loss_type":
        return cfg.actor.use_kl_loss
    return True


def coverage(cases: list[Case] = CASES, device: str = "cuda") -> dict[str, set]:
    """{key: the values some case's run resolves to and reads} over option_fields()."""
    fields = option_fields()
    seen: dict[str, set] = {key: set() for key in fields}
    for case in cases:
        for argv in commands(case, root=str(ROOT), model="/m", run_dir="/r", device=device, steps=3):
            cfg = config_of(argv)
            for key in fields:
                if _read(cfg, key):
                    seen[key].update(_values_at(cfg, key))
    return seen


def uncovered(cases: list[Case] = CASES) -> list[str]:
    """'key=value' for every schema option value that no case runs and EXEMPT does not excuse."""
    seen = coverage(cases)
    return [f"{key}={value}" for key, values in option_fields().items() for value in values
            if value not in seen[key] and (key, value) not in EXEMPT]


# ---------------------------------------------------------------------------------------------
# Running a case and judging its run

@dataclass
class Result:
    name: str
    summary: str
    exit: Optional[int]  # None: not run (the time budget ran out)
    seconds: float
    rows: int
    expected_rows: int
    error: str = ""  # empty: passed
    log: str = ""
    log_tail: list[str] = dataclasses.field(default_factory=list)  # failed cases only

    @property
    def ok(self) -> bool:
        return not self.error


def first_error(log: str) -> str:
    """What went wrong, from a case's log: the exception line of the last Python traceback, the
    trainer's "config error: ..." message, else the last non-empty line."""
    # tqdm redraws its bar with carriage returns: a physical line's last segment is what shows.
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1].rstrip() for line in log.split("\n")]
    lines = [line for line in lines if line.strip()]
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if tracebacks:
        for line in lines[tracebacks[-1] + 1:]:
            if not line.startswith((" ", "\t")):  # frames are indented; the exception is not
                return line
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("config error:"):  # train.py: the message, then "  - ..." items
            items = [line.strip() for line in lines[i + 1:] if line.startswith("  - ")]
            return " ".join([lines[i], *items])
    return lines[-1] if lines else "(empty log)"


def judge(case: Case, run_dir: Path, log: str, want: list[int]) -> tuple[int, list[str]]:
    """(metrics rows written, what is wrong with the run), the process exit codes aside.
    want: the steps the rows must have, in order."""
    problems = []
    path = run_dir / "metrics.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except ValueError:
            problems.append(f"metrics.jsonl line {n} is not JSON")
    got = [r.get("step") for r in rows]
    if got != want:
        problems.append(f"{len(lines)} metrics rows with steps {got}, expected {want}")
    # The trainer writes a non-finite value as null.
    bad = sorted({k for r in rows for k, v in r.items()
                  if not (isinstance(v, (int, float)) and math.isfinite(v))})
    if bad:
        problems.append(f"non-finite metrics: {', '.join(bad)}")
    names = {k for r in rows for k in r}
    missing = [p for p in case.expect if not fnmatch.filter(names, p)]
    if missing:
        problems.append(f"no metric {', '.join(missing)}")
    present = [p for p in case.absent if fnmatch.filter(names, p)]
    if present:
        problems.append(f"unexpected metric {', '.join(present)}")
    # The engine only warns when a decode step's capture fails and then decodes eagerly: on the
    # GPU that is a bug (a stop check that synced did it once), not a slower success.
    failed = [line.strip() for line in log.splitlines() if "CUDA graph capture failed" in line]
    if failed:
        problems.append(f"the engine decoded eagerly: {failed[0][:200]}")
    if case.resume:
        resumed = want[-1] - 1  # the first run's last step, saved at its end
        if f"resumed from step {resumed}" not in log:
            problems.append(f"the second run's log does not say 'resumed from step {resumed}'")
    return len(lines), problems


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               # A one-process run needs no port (an in-memory store); anything that does bind
               # must not collide with the concurrent cases.
               MASTER_PORT=str(_free_port()))
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in paths if p])
    # Concurrent cases share the cores: one thread pool each of the machine's size would thrash.
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def _case_commands(case: Case, args) -> tuple[Path, list[list[str]]]:
    run_dir = Path(args.work) / case.name
    return run_dir, commands(case, root=str(ROOT), model=args.model, run_dir=str(run_dir),
                             device=args.device, steps=args.steps)


def run_case(case: Case, args, deadline: float) -> Result:
    run_dir, argvs = _case_commands(case, args)
    want = expected_steps(argvs)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no resume from an older matrix
    run_dir.mkdir(parents=True)
    log_path = run_dir / "log.txt"
    env = case_env(max(1, (os.cpu_count() or 1) // args.jobs))
    t0, code, timeout_note = time.monotonic(), 0, ""
    with open(log_path, "w") as log:
        for i, argv in enumerate(argvs, 1):
            limit = max(1.0, min(args.timeout, deadline - time.monotonic()))
            log.write(f"=== command {i}/{len(argvs)}: {shlex.join(argv)}\n")
            log.flush()
            # A session of its own, so a timeout ends the trainer and its reward workers.
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = 124
                timeout_note = f"timed out after {limit:.0f} s (command {i}/{len(argvs)}); last: "
            if code != 0:
                break
    seconds = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    rows, problems = judge(case, run_dir, text, want)
    if code != 0:  # the process's own error says more than the missing rows it caused
        problems = [timeout_note + first_error(text)]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # MBs a case, not needed after
    return Result(case.name, case.summary, code, round(seconds, 1), rows, len(want),
                  "; ".join(problems), str(log_path), text.splitlines()[-30:] if problems else [])


def not_run(case: Case, args) -> Result:
    want = expected_steps(_case_commands(case, args)[1])
    return Result(case.name, case.summary, None, 0.0, 0, len(want),
                  "not run: the time budget (--budget-s) ran out")


def run_all(cases: list[Case], args) -> list[Result]:
    """Run the cases --jobs at a time; one line per case as it finishes. Results in case order."""
    deadline = time.monotonic() + args.budget_s
    results: dict[str, Result] = {}

    def guarded(case: Case) -> Result:
        if deadline - time.monotonic() < 20:  # too little left for a start; report, don't start
            return not_run(case, args)
        try:
            return run_case(case, args, deadline)
        except Exception as e:  # noqa: BLE001 - one broken case must not lose the others' report
            return Result(case.name, case.summary, None, 0.0, 0, 0, f"driver error: {e!r}")

    # Two-run cases first: the longest work starts while the pool is full.
    order = sorted(cases, key=lambda c: not c.resume)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(guarded, c) for c in order]
        for future in concurrent.futures.as_completed(futures):
            r = future.result()
            results[r.name] = r
            status = "ok" if r.ok else "FAIL " + r.error
            print(f"{r.name:<36} exit {'-' if r.exit is None else r.exit:>4} {r.seconds:6.1f}s "
                  f"rows {r.rows}/{r.expected_rows}  {status}", flush=True)
    return [results[c.name] for c in cases]


# ---------------------------------------------------------------------------------------------
# Report

def header(args, results: list[Result], wall_s: float) -> dict:
    device, torch_version = args.device, "not importable"
    try:
        import torch

        torch_version = torch.__version__
        if args.device == "cuda":
            device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    except ImportError:
        pass
    passed = sum(r.ok for r in results)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device, "torch": torch_version, "commit": os.environ.get("COMMIT") or git_commit(),
        "command": ((args.command or "").strip()
                    or shlex.join(["python3", "bench/gpu_matrix.py", *args.argv])),
        "steps": args.steps, "jobs": args.jobs, "wall_s": round(wall_s, 1),
        "cases": len(results), "passed": passed, "failed": len(results) - passed,
    }


def render(head: dict, results: list[Result]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    rows = [[r.name, cell(r.summary), "-" if r.exit is None else r.exit, f"{r.seconds:.0f}",
             f"{r.rows}/{r.expected_rows}", "ok" if r.ok else cell("**FAIL** " + r.error)]
            for r in results]
    lines = [
        f"## {head['date']} — GPU matrix (bench/gpu_matrix.sh): {head['passed']}/{head['cases']} "
        "cases passed",
        "",
        f"- device: {head['device']}, torch {head['torch']}",
        f"- commit: {head['commit']}",
        f"- command: `{head['command']}`",
        f"- {head['steps']} steps a case (resume cases: then one more), {head['jobs']} at a time; "
        f"{head['wall_s']:.0f} s in all",
        "",
        markdown_table(["case", "overrides", "exit", "s", "rows", "result"], rows),
        "",
    ]
    return "\n".join(lines)


def write_report(out: Path, head: dict, results: list[Result], work: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = render(head, results)
    (out / "gpu_matrix.md").write_text(text)
    (out / "gpu_matrix.json").write_text(json.dumps(
        {"header": head, "results": [dataclasses.asdict(r) for r in results]}, indent=1))
    # One archive: only a few files come back from the device call.
    with tarfile.open(out / "gpu_matrix_logs.tar.gz", "w:gz") as tar:
        for r in results:
            for name in ("log.txt", "metrics.jsonl", "config.yaml"):
                path = work / r.name / name
                if path.exists():
                    tar.add(path, arcname=f"{r.name}/{name}")
    return text


# ---------------------------------------------------------------------------------------------

def select(cases: list[Case], patterns: Optional[str]) -> list[Case]:
    """Cases whose name matches one of the comma-separated patterns (glob, else substring)."""
    if not patterns:
        return cases
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) if any(ch in p for ch in "*?[")
                                    else p in c.name for p in wanted)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 bench/gpu_matrix.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cases", help="comma-separated name patterns: glob (adv-*) or substring (kl)")
    p.add_argument("--list", action="store_true", help="print the cases and their overrides")
    p.add_argument("--jobs", type=int, default=8, help="cases at a time (default 8)")
    p.add_argument("--steps", type=int, default=3, help="trainer steps a case (default 3)")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_matrix"),
                   help="reports: gpu_matrix.md, .json, _logs.tar.gz (default $OUT or runs/gpu_matrix)")
    p.add_argument("--work", help="run directories, one a case (default OUT/runs)")
    p.add_argument("--model", help="tiny HF model directory; made with tools.make_tiny_model if "
                                   "missing (default WORK/tiny_model)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a command (default 300)")
    p.add_argument("--budget-s", type=float, default=math.inf,
                   help="seconds for all cases: those not started by then are reported not run")
    p.add_argument("--command", help="the command to record in the report (default: this one)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.jobs < 1 or args.steps < 1:
        p.error("--jobs and --steps must be >= 1")
    args.out = os.path.abspath(args.out)
    args.work = os.path.abspath(args.work or os.path.join(args.out, "runs"))
    args.model = os.path.abspath(args.model or os.path.join(args.work, "tiny_model"))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = select(CASES, args.cases)
    if not cases:
        print(f"no case matches --cases {args.cases!r}; --list shows them", file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            print(f"{c.name:<36} {c.summary}")
        print(f"{len(cases)} cases")
        return 0
    # The tiny model, a reward model with its tokenizer beside it ({model}-rm) and a
    # mixture-of-experts model ({model}-moe).
    for out, extra in ((args.model, []), (args.model + "-rm", ["--reward-model"]),
                       (args.model + "-moe", ["--moe"])):
        if not os.path.isfile(os.path.join(out, "config.json")):
            subprocess.run([sys.executable, "-m", "tools.make_tiny_model", "--out", out, *extra],
                           cwd=ROOT, env=case_env(os.cpu_count() or 1), check=True,
                           stdout=subprocess.DEVNULL)
    t0 = time.monotonic()
    results = run_all(cases, args)
    text = write_report(Path(args.out), header(args, results, time.monotonic() - t0), results,
                        Path(args.work))
    print("\n" + text)
    print(f"written: {args.out}/gpu_matrix.md, gpu_matrix.json, gpu_matrix_logs.tar.gz")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
