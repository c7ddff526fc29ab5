"""The RL loop: one `step()` that reads like the algorithm, run on every rank (SPMD).

    batch = producer.take(step)          # sampled with the weights of step - 1 (rollouts.py)
    learner.train(step, batch)           # log-probs, rewards, advantages, updates (learner.py)
    producer.fill(step)                  # one_step_off: the batches sampled meanwhile
    -> metrics, validation, checkpoint

Where the data lives. Generation runs in the generation layout: each TP_g group is one replica
that samples responses for its share of the step's prompts (data.train_batch_size / DP_g). The
responses are then gathered so that every rank holds the same global rollout batch (sampler.py);
scoring is split over all ranks (scoring.py); the training roles (actor, reference, critic) take
the global batch and decide themselves which data-parallel rank computes which samples
(engine/batch.py).

Where the roles run (placement.*, distributed/placement.py). Colocated, every rank runs every
role. Placed on their own sets, a phase runs on its role's ranks and what other sets read of it
is broadcast as tensors; the placement decides that inside the learner's and the scorer's
phases, so the step below is the same program either way.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

import torch.distributed as dist

from verl_mcore import build
from verl_mcore.config import Config, resume
from verl_mcore.data import PromptLoader
from verl_mcore.distributed.launch import detect_launch, init_distributed, setup_logging
from verl_mcore.distributed.watchdog import process_group_timeout
from verl_mcore.errors import NonFiniteError, RewardFailureError
from verl_mcore.rollout.group_filter import GroupFilterError
from verl_mcore.run_dir import RunDir
from verl_mcore.run_parts import build_run
from verl_mcore.stage_timer import StageTimer, rss_gb
from verl_mcore.tracking import progress_bar
from verl_mcore.val_metrics import ValMetricError, ValSamples

log = logging.getLogger("verl_mcore.trainer")


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
        self.run_dir = build.resolve_run_dir(cfg)
        # Before anything is written into the run directory: a second run there is refused.
        self.run = RunDir.open(cfg, self.run_dir, self.launch.local_rank, self.launch.local_world_size)
        # Placement, inputs checked, models, engine, producer, learner, scorer, checkpoints,
        # metrics, watchdog (run_parts.py); a failure there leaves nothing running.
        try:
            p = build_run(cfg, self.launch, self.run, self.run_dir)
        except BaseException:
            self.run.close()  # this process may start another Trainer on the directory
            raise
        self.cfg, self.place, self.gen_groups, self.device = p.cfg, p.place, p.gen_groups, p.device
        self.watchdog, self.guard, self.rewards, self.val_metrics = (p.watchdog, p.guard,
                                                                     p.rewards, p.val_metrics)
        self.info, self.train_data, self.val_data, self.loader = (p.info, p.train_data,
                                                                  p.val_data, p.loader)
        self.sampler, self.scorer, self.learner, self.producer = (p.sampler, p.scorer, p.learner,
                                                                  p.producer)
        self.checkpoints, self.tracking = p.checkpoints, p.tracking
        self.actor, self.critic = self.learner.actor, self.learner.critic
        self.step_index = 0  # steps completed
        self.skipped_updates = 0
        self.memory_peak_bytes = 0  # CUDA: carried from step to step (StageTimer resets peaks)
        try:
            self._resume()
        except BaseException:  # a refused resume leaves no thread, handler or worker behind
            p.stop()
            self.run.close()
            raise

    def fit(self) -> int:
        """Run to trainer.total_steps; returns the process exit code."""
        cfg = self.cfg
        total = cfg.trainer.total_steps
        if self.rank == 0:
            log.info("run directory %s; steps %d..%d of %d", self.run_dir, self.step_index + 1,
                     total, total)
        if cfg.trainer.val_before_train and self.val_data is not None and self.step_index == 0:
            self.tracking.log(0, self.validate(0))
        progress = progress_bar(total, self.step_index, self.rank)
        self.guard.arm()  # from here a signal stops the run at the next step boundary, saved
        try:
            while self.step_index < total:
                step = self.step_index + 1
                metrics = self.step(step)
                self.step_index = step
                self.learner.last_good_step = step
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
            if isinstance(e, (NonFiniteError, RewardFailureError, ValMetricError,
                              GroupFilterError)):
                # Raised on every rank alike (from reduced or gathered values): commit the
                # pending async saves, which hold good steps, before stopping.
                self.checkpoints.close()
            # The agent tools' sandbox workers: this process may live on (the Python API,
            # pooled test ranks), and finish() is not reached.
            self.sampler.close()
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
        sampled, gen_metrics = self.producer.take(step, phase)
        if sampled is None:
            return self.step_metrics(step, gen_metrics, timer, t0, tokens=0.0)
        try:
            # The step's tensors live on the training device from here on (engine/batch.py).
            rollout, score = self.producer.batch_of(sampled)
            metrics, tokens = self.learner.train(step, rollout, phase, score)
        except Exception as e:
            if not self.place.has("rollout"):
                raise
            # A rollout set of its own waits to hand over its next batch (one_step_off) or at
            # the step's end: the failure goes to it there, so no rank waits for this step.
            self.producer.fill(step, phase, failure=e)
            self.place.hold("training", e)  # raised on every rank by step_metrics
            return self.step_metrics(step, {}, timer, t0, tokens=0.0)
        metrics.update(self.producer.fill(step, phase))  # one_step_off: sampled meanwhile
        metrics.update(gen_metrics)
        return self.step_metrics(step, metrics, timer, t0, tokens)

    def step_metrics(self, step: int, metrics: dict, timer: StageTimer, t0: float,
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
            self.memory_peak_bytes / 2**30 if timer.cuda else rss_gb())
        if "actor/mfu" in metrics:
            metrics["perf/mfu/actor"] = metrics.pop("actor/mfu")
        skipped = self.learner.skipped_now  # this rank's optimizer steps skipped in the step
        metrics.update({f"train/skipped_now/{r}": float(n) for r, n in skipped.items()})
        self.learner.skipped_now = {}
        metrics = {k: float(v) for k, v in metrics.items() if v is not None}
        self.sampler.leave_cache_room(timer)
        # Placed: each set's metrics on every rank, and a failure of one set's update stops all.
        metrics = self.place.gather_metrics(metrics, step)
        self.skipped_updates += int(sum(metrics.pop(k) for k in list(metrics)
                                        if k.startswith("train/skipped_now/")))
        if self.learner.actor_learns(step):
            metrics["train/skipped_updates"] = float(self.skipped_updates)
        if self.rank == 0:
            stages = " | ".join(f"{k} {v:.2f}s" for k, v in timer.seconds.items())
            log.info("[step %d/%d] %s", step, cfg.trainer.total_steps, stages)
        return metrics


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
        self.learner.offload_training_state()
        self.sampler.begin(step)
        for prompts in loader:
            rollout = self.sampler.generate(prompts, self.sampler.sampling(
                r.val_n, r.val_temperature, self.step_index, seed_offset=7))
            if not self.place.trains:  # a rank of placement.rollout: it sampled, others score
                continue
            scores, _, extras = self.scorer.score(rollout)
            if samples is not None:
                samples.add(rollout, scores.tolist(), extras,
                            lambda k, r=rollout: r.prompt_texts(self.info.tokenizer, range(k)))
        self.sampler.end()  # the state stays on the host until the next update needs it
        self.sampler.stats()  # validation's engine stats are not the training step's
        return self.val_metrics.report(samples, step, self.run_dir)

    # ------------------------------------------------------------------ checkpoints

    def trainer_state(self) -> dict:
        """What a resume needs beside the models: the loader's position before the first batch
        not yet trained on, and the batches sampled ahead of it (one_step_off: rollouts.py)."""
        rollouts = self.producer.state_dict()
        return {"step": self.step_index, "loader": rollouts["loader"],
                "rollout_queue": rollouts["queue"], "gen_batches": rollouts["gen_batches"],
                "rollout_partial": rollouts.get("partial"),  # rollout.partial's samples in flight
                "kl_ctrl": self.learner.kl_ctrl.state_dict(),
                "skipped_updates": self.skipped_updates,
                "optimizer_steps_per_step": {  # the LR schedules' unit (resume.rescale_schedule)
                    role: build.optimizer_steps_per_training_step(self.cfg, role)
                    for role in (("actor", "critic") if self.cfg.uses_critic else ("actor",))}}

    def save_checkpoint(self, step: int) -> None:
        with self.watchdog.phase("checkpoint", step=step):
            self.sampler.release_cache()  # the step's budget did not see a save's memory
            self.learner.onload_training_state()  # the optimizer state is saved from the GPU
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
        self.learner.last_good_step = self.step_index
        self.producer.load_state_dict({"loader": state["loader"],
                                       "queue": state.get("rollout_queue", []),
                                       "gen_batches": state.get("gen_batches"),
                                       "partial": state.get("rollout_partial")}, self.step_index)
        if state["kl_ctrl"] is not None:
            self.learner.kl_ctrl.load_state_dict(state["kl_ctrl"])
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
        self.sampler.close()  # the agent tools' sandbox workers
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

@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield
