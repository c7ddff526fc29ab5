"""The RL loop: one `step()` that reads like the algorithm, run on every rank (SPMD).

    prompts -> repartition + generate -> rewards -> old / ref log-probs -> KL -> token rewards
            -> critic values + update -> advantages -> actor update -> metrics
            -> validation / checkpoint

The critic learns before the advantages are computed: both read its values before the update
(V_old), which a one-step critic update computes in its own forward passes (engine/critic.py).

Where the data lives. Generation runs in the generation layout: each TP_g group is one replica
that samples responses for its share of the step's prompts (data.train_batch_size / DP_g). The
responses are then gathered so that every rank holds the same global rollout batch; scoring is
split over all ranks; the training roles (actor, reference, critic) take the global batch and
decide themselves which data-parallel rank computes which samples (engine/batch.py).

Where the roles run (placement.*, distributed/placement.py). Colocated, every rank runs every
role. Placed on their own sets, a phase runs on its role's ranks and what other sets read of it
(the rollout batch, reward-model scores, values, log-probs for an in-reward KL) is broadcast as
tensors; `self.place` decides that inside the phase methods, so the step below is the same
program either way, and the sets' phases overlap between those exchanges.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from verl_mcore import build, ops
from verl_mcore.algo.advantages import compute_advantages
from verl_mcore.algo.kl import apply_kl_penalty
from verl_mcore.algo.policy_loss import truncated_is_weights
from verl_mcore.config import Config, ConfigError, resume
from verl_mcore.config.placement import Placement
from verl_mcore.config.seeds import rollout_seed
from verl_mcore.data import PromptLoader
from verl_mcore.data.report import log_data_stage
from verl_mcore.distributed.agree import all_ranks_agree
from verl_mcore.distributed.launch import detect_launch, init_distributed, setup_logging
from verl_mcore.distributed.placement import RolePlacement
from verl_mcore.distributed.preemption import PreemptionGuard
from verl_mcore.distributed.watchdog import Watchdog, process_group_timeout
from verl_mcore.engine.batch import TrainBatch, response_aligned
from verl_mcore.engine.engine import DivergedStepError, training_device
from verl_mcore.errors import NonFiniteError, RewardFailureError
from verl_mcore.generation import WeightSender
from verl_mcore.planning import memory as planner
from verl_mcore.reward import place_on_last_token
from verl_mcore.rollout.base import SamplingParams
from verl_mcore.rollout.gather import (RolloutPart, agreed_failure, decode_responses, gather_rollout,
                                      share_rollout)
from verl_mcore.rollouts import GENERATING, RolloutSchedule
from verl_mcore.run_dir import RunDir
from verl_mcore.tracking import MetricAccumulator, Tracking
from verl_mcore.utils.device import cuda_in_use
from verl_mcore.val_metrics import ValMetricError, ValMetrics, ValSamples

log = logging.getLogger("verl_mcore.trainer")


@dataclass
class Rollout:
    """One step's global rollout batch, identical on every rank.

    train       engine.batch.TrainBatch: prompt+response ids, lengths, response mask [B, R]
    rows        [B] the dataset rows of each sample's prompt (reward functions read them)
    group_ids   [B] int64, one id per prompt: samples of the same prompt share it (GRPO, RLOO)
    responses   [B] decoded response texts
    finish      [B] "stop" | "length" | "aborted" (rollout/base.py FinishReason)
    engine_log_probs  [B, R] the engine's log-prob of each response token (0 elsewhere), or
                None when it was not asked for (Trainer.sampling)
    """

    train: Any
    rows: list
    group_ids: torch.Tensor
    responses: list
    finish: list
    engine_log_probs: Optional[torch.Tensor] = None

    def to(self, device) -> "Rollout":
        """The rollout with its tensors on `device` (the step's rule: engine/batch.py)."""
        lp = self.engine_log_probs
        return dataclasses.replace(self, train=self.train.to(device),
                                   group_ids=self.group_ids.to(device),
                                   engine_log_probs=None if lp is None else lp.to(device))


class StageTimer:
    """Wall time per phase (CUDA synchronised), for `timing_s/<phase>` and the stage line; on
    CUDA also the peak allocated memory of each phase, for `memory_gb/<phase>`, and how often
    the caching allocator had to free its cache and retry a cudaMalloc in it
    (`memory/alloc_retries/<phase>`): each retry synchronises the device and returns memory to
    the driver, so a phase that retries runs near the memory limit and slower than it should.

    Per-phase peaks need `torch.cuda.reset_peak_memory_stats()` at each phase start, which would
    lose the process peak `perf/max_memory_allocated_gb` reports; so the peak reached since the
    previous reset (the last phase, the work between phases, model building before the first
    step) is read just before each reset and kept in `peak_seen`. `peak_seen` starts at the
    previous step's `process_peak_bytes()`, so the process peak carries over steps.
    """

    def __init__(self, peak_seen: int = 0):
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}  # phase -> max over its repeats (CUDA only)
        self.alloc_retries: dict[str, int] = {}  # phase -> sum over its repeats (CUDA only)
        self.peak_seen = peak_seen  # bytes: every peak read before a reset
        self.cuda = cuda_in_use()

    @contextlib.contextmanager
    def __call__(self, name: str):
        retries = 0
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_seen = max(self.peak_seen, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            retries = _alloc_retries()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)
                self.alloc_retries[name] = self.alloc_retries.get(name, 0) + _alloc_retries() - retries
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def process_peak_bytes(self) -> int:
        """Peak allocated bytes since the process started: the largest reading taken before a
        reset (this step's, and `peak_seen` carried in), or now."""
        return max(self.peak_seen, torch.cuda.max_memory_allocated()) if self.cuda else 0

    def metrics(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory_gb/{k}": v / 2**30 for k, v in self.peak_bytes.items()})
        out.update({f"memory/alloc_retries/{k}": float(v) for k, v in self.alloc_retries.items()})
        return out


def _alloc_retries() -> int:
    # reset_peak_memory_stats leaves this counter alone (it resets only peaks).
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


class Trainer:
    """`Trainer(cfg).fit()` under torchrun / srun / mpirun (or one plain process)."""

    def __init__(self, cfg: Config, launch=None):
        self.cfg = cfg
        self.launch = launch or detect_launch()
        if not dist.is_initialized():
            setup_logging(self.launch.rank)
        # Also when the caller initialised torch.distributed: the device follows trainer.device.
        init_distributed(self.launch, cfg.trainer.device,
                         process_group_timeout(cfg.trainer.collective_timeout_s).total_seconds())
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = training_device()
        self.run_dir = build.resolve_run_dir(cfg)
        # Before anything is written into the run directory: a second run there is refused.
        self.run = RunDir.open(cfg, self.run_dir, self.launch.local_rank, self.launch.local_world_size)
        try:
            self._build(cfg)
        except BaseException:
            self._undo_partial_build()
            raise

    def _undo_partial_build(self) -> None:
        """A Trainer that never was leaves no thread, signal handler, worker or lock behind
        (this process may start another Trainer on the directory)."""
        for part, stop in (("watchdog", "stop"), ("guard", "uninstall"), ("rewards", "close")):
            if hasattr(self, part):
                getattr(getattr(self, part), stop)()
        self.run.close()

    def _build(self, cfg: Config) -> None:
        # The placement is checked before any group is built (a bad one is a ConfigError
        # naming the role and the ranks, alike on every rank); then each set's groups.
        placement = Placement.resolve(cfg, self.world, self.launch.local_world_size)
        self.place = RolePlacement.build(
            placement, cfg.rollout.tensor_parallel_size,
            int(process_group_timeout(cfg.trainer.collective_timeout_s).total_seconds() // 60) + 1,
            cfg.parallel.expert_model_parallel_size)
        self.groups = self.place.groups["actor"]  # the actor set's (None on the other ranks)
        # The generating set's (the rollout set's with placement.rollout): its replicas share
        # out each prompt batch; None on the ranks that only receive the samples.
        self.gen_groups = self.place.groups[self.place.generating_set]
        _seed_everything(cfg.trainer.seed, self.rank)
        self.place.seed_rng(cfg.trainer.seed)
        self.watchdog = Watchdog(cfg.trainer.collective_timeout_s, self.rank)
        # Unarmed until the loop starts: a signal while building ends the process at once.
        self.guard = PreemptionGuard(armed=False).install()
        # After the guard's handlers: a rank blocked in a collective still reports a signal.
        self.watchdog.start(watch_signals=True)

        # Everything the user supplied (config, data, model directory, reward code) is read and
        # checked before minutes of model building, and "auto" offload refuses a run whose
        # phases would not fit; a problem on any rank stops every rank.
        with self.watchdog.phase("check inputs"):
            inputs = build.build_inputs(cfg, self.world, self.launch.local_world_size,
                                        self.launch.local_rank)
            self.rewards = inputs.rewards
            # Token budgets where no micro-batch size is set (the planner's, on every rank
            # alike), before the offload choice that plans with them.
            cfg, micro_batches = build.resolve_micro_batches(cfg, inputs.info, self.world,
                                                             self.launch.local_world_size)
            self.cfg = cfg
            offload, why = build.resolve_offload(cfg, inputs.info, self.world,
                                                 self.launch.local_world_size)
            # Before the models too; a failure on any rank (only rank 0 loads the user's metric
            # function) stops every rank.
            self.val_metrics = all_ranks_agree(lambda: ValMetrics.from_config(cfg, self.rank),
                                               "checking the validation metrics")
        self.run.record_start(cfg)  # inputs checked: a refused start leaves the record alone
        self.info, self.train_data, self.val_data = inputs.info, inputs.train_data, inputs.val_data
        rm_infos = inputs.reward_models
        self.loader = build.build_prompt_loader(cfg, self.train_data, self.gen_groups)
        self.schedule = RolloutSchedule(self, cfg.rollout.max_staleness
                                        if cfg.rollout.mode == "one_step_off" else 0)
        if self.rank == 0:  # what the data stage kept, before minutes of model building
            log_data_stage(self.train_data, self.val_data, cfg.data, self.loader.batches_per_epoch)
        if self.rank == 0 and not placement.colocated:
            log.info("placement: %s", placement.describe())
        if self.rank == 0 and planner.lora_roles(cfg):  # what trains (the count from the shape)
            try:
                dims = planner.resolve_dims(self.info.hf_dir or cfg.model.path)
            except ConfigError as e:  # a log line must not stop the run
                log.info("LoRA on %s (no parameter count: %s)", planner.lora_roles(cfg), e)
            else:
                for role in planner.lora_roles(cfg):
                    log.info("%s", planner.lora_summary(cfg, dims, role))
        # Each rank builds its own roles' models only (None / {} for the others').
        with self.watchdog.phase("build models"):
            groups, runs, seed = self.place.groups, self.place.runs, cfg.trainer.seed
            # Each role from its own seed: a fresh value head is the same whichever roles a
            # rank built before it (placed, the critic's set builds nothing else).
            with build.role_seed(seed, "actor"):
                self.actor = build.build_actor(cfg, groups["actor"], self.info) if runs("actor") else None
            with build.role_seed(seed, "reference"):
                self.reference = (build.build_reference(cfg, groups["reference"], self.info,
                                                        self.actor)
                                  if runs("reference") else None)
            with build.role_seed(seed, "critic"):
                self.critic = build.build_critic(cfg, groups["critic"], self.info) if runs("critic") else None
            with build.role_seed(seed, "reward_model"):
                self.reward_models = (build.build_reward_models(cfg, groups["reward_model"], self.info, rm_infos)
                                      if runs("reward_model") else {})
            # The engine's side: a GenerationPhase where it runs (the actor's ranks, or those of
            # placement.rollout), the WeightSender on the actor's ranks of a rollout set.
            self.rollout, self.sender = None, None
            if self.place.generating_set == "rollout":
                side = build.build_rollout_set_phase(cfg, self.place, self.info, self.actor)
                self.rollout, self.sender = ((None, side) if isinstance(side, WeightSender)
                                             else (side, None))
            elif runs("actor"):
                self.rollout = build.build_generation_phase(cfg, self.groups, self.info, self.actor)
        self.reward_model_names = list(rm_infos)
        for role in (self.actor, self.critic):
            if role is not None:
                role.engine.skip_nonfinite = cfg.trainer.on_nonfinite == "skip"
        if self.rank == 0:
            for line in micro_batches:
                log.info("micro-batches: %s", line)
            log.info("offload between phases: %s (%s)", "on" if offload else "off", why)
        self.offloaders = build.build_offloaders(cfg, self.actor, self.critic, offload)
        self.kl_ctrl = build.build_kl_controller(cfg)
        self.checkpoints = build.build_checkpointers(
            cfg, self.run_dir, self.info, role_ranks=None if placement.colocated else self.place.role_ranks())
        self.tracking = Tracking(cfg.trainer.logger, self.run_dir, self.rank, cfg.trainer.project,
                                 cfg.trainer.experiment_name, config=None)
        self.step_index = 0  # steps completed
        self.last_good_step = 0
        self.skipped_updates = 0
        self.skipped_now: dict[str, int] = {}  # role -> optimizer steps skipped in this step
        self.consecutive_skips: dict[str, int] = {}  # role -> skipped in a row (on_nonfinite=skip)
        self.memory_peak_bytes = 0  # CUDA: carried from step to step (StageTimer resets peaks)
        self._resume()

    # ------------------------------------------------------------------ the loop

    def fit(self) -> int:
        """Run to trainer.total_steps; returns the process exit code."""
        cfg = self.cfg
        total = cfg.trainer.total_steps
        if self.rank == 0:
            log.info("run directory %s; steps %d..%d of %d", self.run_dir, self.step_index + 1,
                     total, total)
        if cfg.trainer.val_before_train and self.val_data is not None and self.step_index == 0:
            self.tracking.log(0, self.validate(0))
        progress = _progress(total, self.step_index, self.rank)
        self.guard.arm()  # from here a signal stops the run at the next step boundary, saved
        try:
            while self.step_index < total:
                step = self.step_index + 1
                metrics = self.step(step)
                self.step_index = step
                self.last_good_step = step
                if self.val_data is not None and cfg.trainer.val_every and step % cfg.trainer.val_every == 0:
                    metrics.update(self.validate(step))
                self.tracking.log(step, metrics)
                progress.update(1)
                last = step == total
                saved = last or bool(cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0)
                if saved:
                    self.save_checkpoint(step)
                if not last and self.guard.should_stop():
                    if not saved:  # a second save of the same step would only eat the grace period
                        self.save_checkpoint(step)
                    self.finish("stopped for preemption")  # commits async saves too
                    return self.guard.preempted_exit(step, self.rank)
        except BaseException as e:
            if isinstance(e, (NonFiniteError, RewardFailureError, ValMetricError)):
                # Raised on every rank alike (from reduced or gathered values): commit the
                # pending async saves, which hold good steps, before stopping.
                self.checkpoints.close()
            self.run.close()  # this process may start another Trainer on the directory
            raise
        finally:
            progress.close()
        self.finish()
        return 0

    def step(self, step: int) -> dict[str, float]:
        timer = StageTimer(peak_seen=self.memory_peak_bytes)
        phase = lambda name: _both(self.watchdog.phase(name, step=step), timer(name))  # noqa: E731
        t0 = time.perf_counter()

        # The batch this step trains on: sampled now with the weights of step - 1 (sync), or
        # during an earlier step (one_step_off); rollouts.py. A rank of placement.rollout only
        # samples: its step ends with the metrics.
        sampled, gen_metrics = self.schedule.take(step, phase)
        if sampled is None:
            return self.step_metrics(step, gen_metrics, timer, t0, tokens=0.0)
        try:
            metrics, tokens = self.train_on(step, sampled, phase)
        except Exception as e:
            if not self.place.has("rollout"):
                raise
            # A rollout set of its own waits to hand over its next batch (one_step_off) or at
            # the step's end: the failure goes to it there, so no rank waits for this step.
            self.schedule.fill(step, phase, failure=e)
            self.place.hold("training", e)  # raised on every rank by step_metrics
            return self.step_metrics(step, {}, timer, t0, tokens=0.0)
        metrics.update(self.schedule.fill(step, phase))  # one_step_off: sampled meanwhile
        metrics.update(gen_metrics)
        return self.step_metrics(step, metrics, timer, t0, tokens)

    def train_on(self, step: int, sampled, phase) -> tuple[dict[str, float], float]:
        """The step's training on its batch: log-probs, rewards, advantages, the critic's and
        the actor's updates. (metrics, tokens of the batch)."""
        cfg = self.cfg
        # The step's tensors live on the training device from here on (engine/batch.py).
        rollout = rollout_from_part(sampled.part, sampled.part.prompt_of, self.info).to(self.device)
        baseline = (rollout_from_part(sampled.baseline, sampled.baseline.prompt_of, self.info)
                    if sampled.baseline is not None else None)
        batch = rollout.train
        # The log-prob passes first: placed, the actor set runs them while the reward set scores.
        entropy = None
        if self.needs_old_log_probs(batch):
            with phase("old_logp"):
                batch.old_log_probs, entropy = self.old_log_probs(batch)
        if self.place.has("reference"):
            with phase("ref"):
                batch.ref_log_probs = self.ref_log_probs(batch)
        with phase("reward"):
            scores, reward_metrics, _ = self.score(rollout)
            if baseline is not None:  # ReMax: the greedy response's score, for each sample
                baseline = self.score(baseline)[0].repeat_interleave(cfg.rollout.n)
        with phase("adv"):
            token_rewards, kl_metrics = self.token_rewards(batch, scores)
            metrics: dict[str, float] = dict(self.off_policy(rollout, batch))
        if self.place.has("critic"):  # leaves the values before its update in batch.values
            metrics.update(self.fit_critic(step, batch, token_rewards, phase))
        with phase("adv"):
            batch.advantages, batch.returns = self.advantages(batch, token_rewards, scores,
                                                              rollout.group_ids, baseline)
        if step > cfg.critic.warmup_steps or not self.place.has("critic"):
            with phase("actor"):  # placed, alongside the critic set's update
                actor_metrics = self.update(step, "actor", batch)
            metrics.update(actor_metrics)
        metrics.update(reward_metrics)
        metrics.update(kl_metrics)
        metrics.update(self.data_metrics(rollout, scores, token_rewards, entropy))
        return metrics, float(batch.seq_lens.sum())

    def step_metrics(self, step: int, metrics: dict, timer: "StageTimer", t0: float,
                     tokens: float) -> dict[str, float]:
        """The step's metrics on every rank: this rank's, its phase times and memory, merged
        over the sets (a failure of one set's update stops every rank here)."""
        cfg = self.cfg
        metrics.update(timer.metrics())
        seconds = time.perf_counter() - t0
        metrics["timing_s/step"] = seconds
        metrics["perf/throughput"] = tokens / seconds / self.world
        # Peak since the process started (model building included), as before per-phase resets.
        self.memory_peak_bytes = timer.process_peak_bytes()
        metrics["perf/max_memory_allocated_gb"] = (
            self.memory_peak_bytes / 2**30 if timer.cuda else _rss_gb())
        if "actor/mfu" in metrics:
            metrics["perf/mfu/actor"] = metrics.pop("actor/mfu")
        metrics.update({f"train/skipped_now/{r}": float(n) for r, n in self.skipped_now.items()})
        self.skipped_now = {}
        metrics = {k: float(v) for k, v in metrics.items() if v is not None}
        self.leave_cache_room(timer)
        # Placed: each set's metrics on every rank, and a failure of one set's update stops all.
        metrics = self.place.gather_metrics(metrics, step)
        self.skipped_updates += int(sum(metrics.pop(k) for k in list(metrics)
                                        if k.startswith("train/skipped_now/")))
        if step > cfg.critic.warmup_steps or not self.place.has("critic"):
            metrics["train/skipped_updates"] = float(self.skipped_updates)
        if self.rank == 0:
            stages = " | ".join(f"{k} {v:.2f}s" for k, v in timer.seconds.items())
            log.info("[step %d/%d] %s", step, cfg.trainer.total_steps, stages)
        return metrics

    def leave_cache_room(self, timer: "StageTimer") -> None:
        """How much KV cache the colocated engine may keep through the next steps' training (its
        cache and CUDA graphs then stay, NativeEngine.sleep): a quarter of the GPU memory this
        step's training phases left free, their peak less what the engine kept through them. The
        same on every rank (the least), so the ranks of a generation TP group keep or free
        together. Nothing on CPU: there the engine frees its cache after each call."""
        if not timer.cuda:
            return
        kept = self.rollout.kept_bytes if self.rollout is not None else 0
        training = [peak for name, peak in timer.peak_bytes.items() if name not in GENERATING]
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        free = (total - max(training) + kept) // 4 if training else 0
        room = torch.tensor([free], dtype=torch.int64, device="cuda")
        if dist.is_initialized():
            dist.all_reduce(room, op=dist.ReduceOp.MIN)
        if self.rollout is not None:
            self.rollout.cache_budget(int(room.item()))

    # ------------------------------------------------------------------ phases

    def offload_training_state(self, keep: Optional[str] = None) -> dict[str, float]:
        """Optimizer state and grad buffers of the trainable roles (all but `keep`) to pinned
        host memory (trainer.offload_between_phases). Forward-only phases need neither, so they
        stay there until their role's update: each role's state moves off and on once a step."""
        freed = 0
        for role, offloader in self.offloaders.items():
            if role != keep and not offloader.offloaded:
                freed += offloader.offload().total_bytes
        return {"perf/offloaded_gb": freed / 2**30} if self.offloaders else {}

    def onload_training_state(self, role: Optional[str] = None) -> None:
        """Back to the GPU: `role`'s state for its update (the other roles' stay on the host, so
        the update gets their memory), or every role's (role=None, e.g. to save a checkpoint)."""
        if role is not None:
            self.offload_training_state(keep=role)
        for name, offloader in self.offloaders.items():
            if (role is None or name == role) and offloader.offloaded:
                offloader.onload()

    def needs_old_log_probs(self, batch) -> bool:
        """The old-log-prob forward pass, unless the actor update is one on-policy step that can
        use its own log-probs and no in-reward KL reads them (actor.recompute_old_log_probs)."""
        cfg = self.cfg
        # Actor.is_on_policy_step, from the config: every set decides alike, the actor set or not.
        on_policy = (cfg.actor.ppo_epochs == 1
                     and cfg.actor.ppo_mini_batch_size * cfg.rollout.n == batch.num_samples)
        # Samples of older weights (one_step_off), or weighed against the engine's log-probs
        # (rollout.tis_cap): the ratio's denominator is the actor's current policy.
        off_policy = cfg.rollout.mode == "one_step_off" or cfg.rollout.tis_cap is not None
        return (cfg.actor.recompute_old_log_probs == "always" or cfg.algorithm.use_kl_in_reward
                or not on_policy or off_policy)

    @property
    def sends_weights(self) -> bool:
        """Whether this rank sends the actor's weights to a rollout set of its own."""
        return self.sender is not None

    def begin_generation(self, step: int, prompt_ids=None) -> dict[str, float]:
        """The actor's weights into the generation layout (the engine's ranks receive them, a
        rollout set's from the actor's ranks), and with `prompt_ids` (the next batch's, on the
        engine's ranks; True on the sending ones) the weight-sync check on a few of them;
        nothing elsewhere."""
        if self.sender is not None:
            return self.sender.begin(step, prompt_ids)
        if self.rollout is None:
            return {}
        return self.rollout.begin(step, prompt_ids)

    def end_generation(self) -> None:
        if self.rollout is not None:
            self.rollout.end()

    def generation_stats(self) -> dict[str, float]:
        """The engine's stats of the calls since the last look (preemptions, peak live
        sequences, slot occupancy, shared prompt blocks) and the weight-sync check's metrics;
        nothing where no engine runs."""
        return {} if self.rollout is None else self.rollout.take_stats()

    def off_policy(self, rollout: "Rollout", batch) -> dict[str, float]:
        """How far the engine's sampling policy is from the actor's recomputed old log-probs:
        `rollout/engine_vs_trainer_logp_diff` (mean |difference| over response tokens; in
        one_step_off it includes the staleness), and with rollout.tis_cap the truncated
        importance weights min(pi_old / pi_engine, cap) the actor's loss multiplies each token
        by (algo/policy_loss.truncated_is_weights). Nothing without the engine's log-probs."""
        if rollout.engine_log_probs is None or batch.old_log_probs is None:
            return {}
        mask = batch.response_mask
        engine = rollout.engine_log_probs.to(mask.device)
        diff = ((batch.old_log_probs - engine).abs() * mask).sum() / mask.sum().clamp(min=1)
        metrics = {"rollout/engine_vs_trainer_logp_diff": float(diff)}
        if self.cfg.rollout.tis_cap is not None:
            batch.is_weights, tis = truncated_is_weights(batch.old_log_probs, engine, mask,
                                                         self.cfg.rollout.tis_cap)
            metrics.update(tis)
        return metrics

    def old_log_probs(self, batch):
        """(old log-probs [B, R], entropies [B, R]) of the actor's current weights, on the actor
        set; on every rank when an in-reward KL needs them there, else None elsewhere."""
        out = {}

        def compute():
            out["logp"], out["entropy"] = self.actor.compute_log_prob(batch, compute_entropy=True)
            return out["logp"]

        logp = self.place.on("actor", compute, batch.response_mask.shape,
                             share=self.cfg.algorithm.use_kl_in_reward)
        return logp, out.get("entropy")

    def ref_log_probs(self, batch):
        """Reference log-probs [B, R] on the reference's set, and where the actor (the KL loss) or
        an in-reward KL reads them."""
        sets = self.place.placement.sets
        share = self.cfg.algorithm.use_kl_in_reward or (
            self.cfg.actor.use_kl_loss and sets["reference"].ranks != sets["actor"].ranks)
        return self.place.on("reference", lambda: self.reference.compute_ref_log_prob(batch),
                             batch.response_mask.shape, share=share)

    def sampling(self, n: int, temperature: float, seed_offset: int = 0,
                 batch: Optional[int] = None):
        """How to sample batch number `batch` + 1 (None: the one after the steps done so far);
        the seed depends on the batch, the offset and the replica, not on when it is sampled.
        The engine's log-probs come along where the trainer reads them (a rollout set of its
        own, rollout.tis_cap)."""
        r = self.cfg.rollout
        greedy = temperature == 0
        index = self.step_index if batch is None else batch
        return SamplingParams(
            n=n, temperature=temperature, top_p=1.0 if greedy else r.top_p,
            top_k=-1 if greedy else r.top_k, max_new_tokens=self.cfg.data.max_response_length,
            stop_token_ids=self.info.eos_token_ids,
            seed=rollout_seed(self.cfg) + 1000003 * (index + seed_offset) + self._gen_replica(),
            logprobs=self.cfg.placement.rollout is not None or r.tis_cap is not None,
        )

    def generate(self, prompts, sampling) -> Rollout:
        """Sample responses for this replica's prompts; the global rollout batch on every
        rank (sample_part, then share_part)."""
        batch = self.share_part(prompts, *self.sample_part(prompts, sampling))
        return rollout_from_part(batch, batch.prompt_of, self.info)

    def sample_part(self, prompts, sampling, failure: Optional[BaseException] = None):
        """(the generating set's batch, None) on its ranks, (None, the error) where its
        sampling failed, or this rank's earlier `failure` (then it does not sample), on any of
        them, (None, None) on the ranks that only receive.

        Global order: generation replica, then prompt, then sample, so the n samples of a prompt
        are consecutive (mini-batches keep GRPO groups together) and group ids count prompts.
        The batch crosses ranks as tensors, token ids in one flat buffer (rollout/gather.py).
        """
        if self.rollout is None:
            return None, None
        vocab, groups = self.info.arch.vocab_size, self.rollout.groups
        mine = None
        try:
            if failure is None:
                outputs = self.rollout.generate(prompts.input_ids, sampling)
                if groups.gen_tp_rank == 0:  # every rank of a TP_g group holds the same samples
                    mine = RolloutPart.from_outputs(prompts, outputs, vocab)
        except Exception as e:  # noqa: BLE001 - raised on every rank by share_part
            failure = e
        # A replica that failed would leave the others waiting in the gather: agree first.
        failure = agreed_failure(failure, groups.whole, "gathering the samples")
        if failure is None:
            try:  # after a weight update, on a few of these samples (generation.py)
                self.rollout.check_samples()
            except Exception as e:  # noqa: BLE001 - WeightSyncError comes on every rank alike
                failure = e
        if failure is not None:
            return None, failure
        return gather_rollout(mine, groups, vocab), None

    def share_part(self, prompts, batch, failure=None):
        """The generating set's batch on every rank (a failure there raises on every rank)."""
        return share_rollout(self.place, batch, prompts, self.info.arch.vocab_size, failure)

    def _gen_replica(self) -> int:
        """This rank's generation replica (0 where no engine runs, which samples nothing)."""
        return self.rollout.groups.gen_dp_rank if self.rollout is not None else 0

    def score(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float], dict[str, list]]:
        """Rule / custom / model scores [B] on the training device: the reward models score the
        whole batch on every rank together; each rank scores a slice with the other sources,
        then all-gather. Also the metrics, and the scorers' extras of the whole batch
        ("source/key" -> [B] float or None, RewardOutput.extras) on every rank."""
        n = len(rollout.responses)
        # Split over the training ranks (a rollout set of its own samples meanwhile).
        scorers = self.place.training_ranks
        mine = list(range(scorers.index(self.rank), n, len(scorers)))
        model_scores = {  # on the reward models' set, then on every rank
            name: self.place.on("reward_model", lambda name=name: self.reward_models[name].score(
                rollout.train, rollout.rows, rollout.responses), [n]).cpu()
            for name in self.reward_model_names}
        token_ids = _token_ids(rollout.train, mine) if self.rewards.needs_token_ids else (None, None)
        prompts = None
        if self.rewards.needs_prompts:  # a batch reward class reads the prompts the model saw
            prompts = _prompt_texts(self.info.tokenizer, rollout.train, mine)
        out = self.rewards.score([rollout.responses[i] for i in mine], [rollout.rows[i] for i in mine],
                                 *token_ids, indices=mine, prompts=prompts,
                                 model_scores={k: v[mine].tolist() for k, v in model_scores.items()})
        part = (mine, out.scores, out.source_scores, out.failed, out.first_failure, out.routes,
                out.extras)
        gathered: list = [None] * len(scorers)
        dist.all_gather_object(gathered, part, group=self.place.training)
        scores = torch.zeros(n)
        per_source: dict[str, torch.Tensor] = {}
        failed, firsts, routes, extras = 0, [], [None] * n, {}
        for idx, s, sources, f, first, r, extra in gathered:
            scores[idx] = torch.tensor(s, dtype=torch.float32)
            for i, value in zip(idx, r):
                routes[i] = value
            for name, values in extra.items():
                for i, value in zip(idx, values):
                    extras.setdefault(name, [None] * n)[i] = value
            for name, values in sources.items():
                per_source.setdefault(name, torch.zeros(n))[idx] = torch.tensor(values, dtype=torch.float32)
            failed += sum(f)
            firsts += [first] if first else []
        # The whole batch's count on every rank: all stop together (reward.max_failed_fraction).
        self.rewards.check_failures(failed, n, min(firsts, default=None))
        acc = MetricAccumulator()
        for name, values in out.metrics.items():
            acc.add_mean(name, values, weight=max(1, len(mine)))
        metrics = dict(acc.reduce(group=self.place.training))
        for name, values in per_source.items():
            metrics[f"reward/{name}/mean"] = float(values.mean())
        for name, values in model_scores.items():  # the whole batch's, on every rank
            stats = {"mean": values.mean(), "std": values.std(unbiased=False), "min": values.min(),
                     "max": values.max()}
            metrics.update({f"reward/{name}/{k}": float(v) for k, v in stats.items()})
            if self.rank == 0:
                log.info("reward model %s: %s", name, " ".join(f"{k} {float(v):.4g}" for k, v in stats.items()))
        metrics["reward/failed"] = float(failed)
        # From the gathered per-sample values: exact over the whole batch, however it was split.
        metrics.update(self.rewards.route_metrics(routes, scores.tolist()))
        return scores.to(self.device), metrics, extras

    def token_rewards(self, batch, scores) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.response_mask
        rewards = place_on_last_token(scores, mask)
        if not self.cfg.algorithm.use_kl_in_reward:
            return rewards, {}
        rewards, info = apply_kl_penalty(rewards, batch.old_log_probs, batch.ref_log_probs, mask,
                                         self.kl_ctrl, kind=self.cfg.algorithm.kl_penalty)
        self.kl_ctrl.update(float(info["current_kl"]), batch.num_samples)
        return rewards, {"critic/kl": float(info["current_kl"]), "critic/kl_coef": float(info["kl_coef"])}

    def advantages(self, batch, token_rewards, scores, group_ids, baseline):
        a = self.cfg.algorithm
        return compute_advantages(
            a.adv_estimator, token_rewards, batch.response_mask, values=batch.values,
            group_ids=group_ids, baseline_scores=baseline, gamma=a.gamma, lam=a.lam,
            norm_by_std=a.norm_adv_by_std_in_grpo, whiten=a.whiten_advantages, scores=scores)

    def data_metrics(self, rollout: Rollout, scores, token_rewards, entropy) -> dict[str, float]:
        """The batch statistics RLHF users know (the batch is global: no reduction needed)."""
        b = rollout.train
        mask = b.response_mask.bool()
        resp_len = b.response_lens.float()
        m = {
            "critic/score/mean": float(scores.mean()), "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/rewards/mean": float(token_rewards.sum(-1).mean()),
            "critic/advantages/mean": float(b.advantages[mask].mean()) if mask.any() else 0.0,
            "critic/returns/mean": float(b.returns[mask].mean()) if mask.any() else 0.0,
            "response_length/mean": float(resp_len.mean()),
            "response_length/max": float(resp_len.max()),
            "response_length/clip_ratio": float(sum(f == "length" for f in rollout.finish)) / len(rollout.finish),
            "prompt_length/mean": float(b.prompt_lens.float().mean()),
        }
        if entropy is not None:  # from the old-log-prob pass, when it ran
            m["actor/old_entropy"] = float(entropy[mask].mean()) if mask.any() else 0.0
        if b.values is not None and mask.any():
            values, returns = b.values[mask], b.returns[mask]
            m["critic/values/mean"] = float(values.mean())
            var = returns.var(unbiased=False)
            m["critic/vf_explained_var"] = float(1 - (returns - values).var(unbiased=False) / (var + 1e-8))
        return m

    def fit_critic(self, step: int, batch, token_rewards, phase) -> dict[str, float]:
        """The critic's update of this step, on the GAE returns of its values before the update
        (V_old, left in batch.values for the advantages). A one-step update computes V_old in its
        own forward passes; otherwise, or with critic.recompute_values=always, a forward-only
        values pass runs first (engine/critic.py)."""
        a = self.cfg.algorithm

        def returns_of(rewards, values, mask):
            return ops.gae(rewards, values, mask, a.gamma, a.lam)[1]

        batch.token_rewards = token_rewards
        if self.cfg.critic_values_pass:  # always for a critic placed on its own set
            with phase("values"):
                batch.values = self.place.on("critic", lambda: self.critic.compute_values(batch),
                                             batch.response_mask.shape)
                batch.returns = returns_of(token_rewards, batch.values, batch.response_mask)
        with phase("critic"):
            return self.update(step, "critic", batch, returns_of)

    def update(self, step: int, role: str, batch, *args) -> dict[str, float]:
        """`role`'s (actor or critic) PPO update of this step on its set ({} elsewhere; placed,
        a failure there stops every rank at the step's end: RolePlacement.gather_metrics),
        checked (check_finite); a step that diverged the weights stops the run naming the
        update and the last good step."""
        return self.place.run(role, lambda: self._update(step, role, batch, *args))

    def _update(self, step: int, role: str, batch, *args) -> dict[str, float]:
        self.onload_training_state(role)
        try:
            summary, per_step = getattr(self, role).update(batch, *args)
        except DivergedStepError as e:
            raise NonFiniteError(f"the {role} update at step {step}: {e}. The last good step is "
                                 f"{self.last_good_step} (its checkpoint, if saved, is intact).") from e
        self.check_finite(step, f"{role} update", summary, per_step, role=role)
        return summary

    def check_finite(self, step: int, phase: str, metrics: dict, per_step: list[dict],
                     role: str = "actor") -> None:
        """trainer.on_nonfinite=stop: a non-finite loss or grad norm stops the run, naming the
        phase and the last good step. =skip: the engine already refused those optimizer steps
        (engine.optimizer_step); they are counted in `train/skipped_updates` (actor and critic
        together), and trainer.max_consecutive_skips of one role in a row stop the run."""
        if self.cfg.trainer.on_nonfinite == "skip":
            for s in per_step:
                self.skipped_now[role] = self.skipped_now.get(role, 0) + int(s.get("skipped", 0.0))
                self.consecutive_skips[role] = (self.consecutive_skips.get(role, 0) + 1
                                                if s.get("skipped_nonfinite") else 0)
            limit = self.cfg.trainer.max_consecutive_skips
            if self.consecutive_skips.get(role, 0) >= limit:
                raise NonFiniteError(
                    f"the last {self.consecutive_skips[role]} optimizer steps of the {role} were "
                    f"skipped for a non-finite gradient norm (trainer.on_nonfinite=skip, "
                    f"trainer.max_consecutive_skips={limit}), the last in the {phase} at step "
                    f"{step}; the last good step is {self.last_good_step}. Lower the learning rate "
                    f"or check the data and rewards ({role}/grad_norm in metrics.jsonl).")
            return
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)
               and (k.endswith("loss") or k.endswith("grad_norm"))]
        if bad:
            raise NonFiniteError(f"non-finite {bad} in the {phase} at step {step}; the last good "
                                 f"step is {self.last_good_step} (its checkpoint, if saved, is "
                                 f"intact). Lower the learning rate or check the data/rewards, or "
                                 f"set trainer.on_nonfinite=skip to skip such updates.")

    # ------------------------------------------------------------------ validation

    def validate(self, step: int) -> dict[str, float]:
        """val/<data_source>/<metric> over the whole validation set (val_metrics.py): each
        replica generates for its share of each batch, which generate() and score() gather onto
        every rank; rank 0 keeps the samples and computes, and every rank logs its result."""
        r = self.cfg.rollout
        rank, replicas = build.prompt_shard(self.gen_groups)
        loader = PromptLoader(self.val_data, len(self.val_data) if self.cfg.data.val_batch_size is None
                              else self.cfg.data.val_batch_size, rank=rank, world_size=replicas,
                              shuffle=False, drop_last=False, num_epochs=1)
        samples = ValSamples(keep_prompts=self.cfg.trainer.log_val_generations) if self.rank == 0 else None
        self.offload_training_state()
        self.begin_generation(step)
        for prompts in loader:
            rollout = self.generate(prompts, self.sampling(r.val_n, r.val_temperature, seed_offset=7))
            if not self.place.trains:  # a rank of placement.rollout: it sampled, others score
                continue
            scores, _, extras = self.score(rollout)
            if samples is not None:
                samples.add(rollout, scores.tolist(), extras,
                            lambda k, b=rollout.train: _prompt_texts(self.info.tokenizer, b, range(k)))
        self.end_generation()  # the state stays on the host until the next update needs it
        self.generation_stats()  # validation's engine stats are not the training step's
        return self.val_metrics.report(samples, step, self.run_dir)

    # ------------------------------------------------------------------ checkpoints

    def trainer_state(self) -> dict:
        """What a resume needs beside the models: the loader's position before the first batch
        not yet trained on, and the batches sampled ahead of it (one_step_off: rollouts.py)."""
        rollouts = self.schedule.state_dict()
        return {"step": self.step_index, "loader": rollouts["loader"],
                "rollout_queue": rollouts["queue"], "kl_ctrl": self.kl_ctrl.state_dict(),
                "skipped_updates": self.skipped_updates,
                "optimizer_steps_per_step": {  # the LR schedules' unit (resume.rescale_schedule)
                    role: build.optimizer_steps_per_training_step(self.cfg, role)
                    for role in (("actor", "critic") if self.cfg.uses_critic else ("actor",))}}

    def save_checkpoint(self, step: int) -> None:
        with self.watchdog.phase("checkpoint", step=step):
            if self.rollout is not None:  # the step's budget did not see a save's memory
                self.rollout.release_cache()
            self.onload_training_state()  # the optimizer state is saved from the GPU
            self.checkpoints.save(step, self.actor, self.critic, self.trainer_state())

    def _resume(self) -> None:
        changes = []

        def check(checkpoint: str) -> None:  # before any weight is read: refuses by key name
            changes[:] = resume.compare(checkpoint, self.cfg, self.info.arch)
            resume.check_lora_base(checkpoint, self.info.checkpoint or self.info.hf_dir)

        # The config wins over the checkpoint, in the optimizer and in the trainer state
        # (config/resume.py).
        with contextlib.ExitStack() as keep:
            for role in (self.actor, self.critic):
                if role is not None:
                    keep.enter_context(role.engine.config_hyperparameters_kept())
            state = self.checkpoints.resume(self.cfg.checkpoint, self.actor, self.critic, check=check)
        if state is None:
            # Rows an earlier start logged before dying without a checkpoint are stale too.
            self.tracking.resumed_at(0)
            return
        state = resume.apply_to_state(changes, state, PromptLoader.rebatch)
        saved_per_step = state.get("optimizer_steps_per_step") or {}  # absent: older checkpoints
        for name, role in (("actor", self.actor), ("critic", self.critic)):
            if role is not None and name in saved_per_step:
                resume.rescale_schedule(name, role.engine.scheduler, saved_per_step[name],
                                        build.optimizer_steps_per_training_step(self.cfg, name))
        self.step_index = int(state["step"])
        self.last_good_step = self.step_index
        self.schedule.load_state_dict({"loader": state["loader"],
                                       "queue": state.get("rollout_queue", [])}, self.step_index)
        if state["kl_ctrl"] is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.tracking.resumed_at(self.step_index)  # metrics rows past the checkpoint are stale
        restarts = os.environ.get("SLURM_RESTART_COUNT")
        if self.rank == 0:
            log.info("resumed from step %d%s", self.step_index,
                     f" (SLURM_RESTART_COUNT={restarts})" if restarts else "")

    def finish(self, how: str = "finished") -> None:
        self.checkpoints.close()
        self.tracking.close()
        self.rewards.close()
        self.watchdog.stop()
        self.guard.uninstall()
        self.run.close()
        if self.rank == 0:
            ckpt = self.checkpoints.latest_path()
            print(f"\nrun {how}: {self.step_index} steps\n"
                  f"  metrics:     {os.path.join(self.run_dir, 'metrics.jsonl')}\n"
                  f"  plots:       python -m verl_mcore.plot {self.run_dir}\n"
                  f"  checkpoint:  {ckpt}\n"
                  f"  config:      {os.path.join(self.run_dir, 'config.yaml')}", flush=True)


# ---------------------------------------------------------------------------------------------

def _token_ids(batch, rows) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) of `rows` of a TrainBatch, as lists (reward-model objects
    handed in from Python take them); an empty response is [] again, not its masked pad."""
    ids, prompt, seq = batch.input_ids.cpu(), batch.prompt_lens.tolist(), batch.seq_lens.tolist()
    empty = (batch.response_mask.sum(dim=1) == 0).tolist()
    prompts = [ids[i, :prompt[i]].tolist() for i in rows]
    responses = [[] if empty[i] and seq[i] - prompt[i] == 1 else ids[i, prompt[i]:seq[i]].tolist()
                 for i in rows]
    return prompts, responses


def _prompt_texts(tokenizer, batch, rows) -> list[str]:
    """The decoded prompts of `rows` of a TrainBatch, as the model saw them (chat template
    included, special tokens left out)."""
    ids, lens = batch.input_ids[list(rows)].tolist(), batch.prompt_lens[list(rows)].tolist()
    return tokenizer.batch_decode([p[:k] for p, k in zip(ids, lens)], skip_special_tokens=True)


def make_rollout(samples, group_ids, info) -> Rollout:
    """samples: [(prompt ids, dataset row, response ids, finish reason)] -> Rollout."""
    part = RolloutPart.from_samples(samples, info.arch.vocab_size)
    return rollout_from_part(part, torch.as_tensor(group_ids, dtype=torch.int64), info)


def rollout_from_part(part, group_ids: torch.Tensor, info) -> Rollout:
    """A Rollout from flat samples (rollout.gather.RolloutPart) and their group ids [B]; its
    response mask is the samples' loss mask (rollout/token_fields.py)."""
    # An empty response (the engine stopped at once) gets one masked EOS token.
    pad = info.eos_token_ids[0] if info.eos_token_ids else info.pad_token_id
    train = TrainBatch.from_flat(part.prompt_ids, part.prompt_lens, part.response_ids,
                                 part.response_lens, pad, prompt_of=part.prompt_of,
                                 loss_mask=part.token_field("loss_mask"))
    engine_log_probs = None
    if part.logprobs is not None:  # response-aligned like the trainer's own log-probs
        engine_log_probs = response_aligned(part.logprobs, part.response_lens, train.response_width)
    return Rollout(train=train, rows=part.sample_rows(), group_ids=group_ids.to(torch.int64),
                   responses=decode_responses(info.tokenizer, part), finish=part.finish_reasons(),
                   engine_log_probs=engine_log_probs)


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def _seed_everything(seed: int, rank: int) -> None:
    import random

    import numpy as np

    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed)  # same on all ranks: identical fresh heads, replicated init
    try:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    except Exception:  # noqa: BLE001 - parallel state not initialised yet: seeded again later
        pass


def _rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class _NoProgress:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, done: int, rank: int):
    if rank != 0:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="steps", unit="step", dynamic_ncols=True,
                file=sys.stderr)
