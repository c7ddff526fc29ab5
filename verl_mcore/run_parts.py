"""A training run's parts, built from its config in the order a user's mistakes are cheapest to
find: the placement, then every input the user supplied (config, data, model directory, reward
code) checked before minutes of model building, then the models, the engine, the producer of
rollout batches, the learner, the checkpoints and the metrics.

    parts = build_run(cfg, launch, run, run_dir)    # every rank alike (collective)

A failure part way leaves no thread, signal handler or scoring worker behind (this process may
start another run on the directory).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_mcore import build
from verl_mcore.config import Config, ConfigError
from verl_mcore.config.placement import Placement
from verl_mcore.data.report import log_data_stage
from verl_mcore.distributed.agree import all_ranks_agree
from verl_mcore.distributed.placement import RolePlacement
from verl_mcore.distributed.preemption import PreemptionGuard
from verl_mcore.distributed.watchdog import Watchdog, process_group_timeout
from verl_mcore.engine.engine import training_device
from verl_mcore.fully_async import FullyAsyncProducer
from verl_mcore.generation import WeightSender
from verl_mcore.learner import Learner
from verl_mcore.partial_rollouts import PartialProducer
from verl_mcore.planning import memory as planner
from verl_mcore.rollouts import Producer
from verl_mcore.sampler import Sampler
from verl_mcore.scoring import Scorer
from verl_mcore.tracking import Tracking
from verl_mcore.utils.rng import seed_everything
from verl_mcore.val_metrics import ValMetrics

log = logging.getLogger("verl_mcore.trainer")


@dataclass
class RunParts:
    """What `Trainer` runs. cfg: the config with the planner's micro-batches resolved; place:
    this rank's RolePlacement; gen_groups: the generating set's groups (None on the ranks that
    only receive samples); info: the actor's ModelInfo; train_data / val_data: the datasets
    (val_data None without validation files)."""

    cfg: Config
    place: RolePlacement
    gen_groups: Any
    device: torch.device
    watchdog: Watchdog
    guard: PreemptionGuard
    rewards: Any
    val_metrics: ValMetrics
    info: Any
    train_data: Any
    val_data: Any
    loader: Any
    sampler: Sampler
    scorer: Scorer
    learner: Learner
    producer: Producer
    checkpoints: Any
    tracking: Tracking

    def stop(self) -> None:
        """Stop what runs beside the loop: the watchdog's thread, the signal handlers, the
        scoring workers, the agent tools' sandbox workers."""
        self.watchdog.stop()
        self.sampler.close()
        self.guard.uninstall()
        self.rewards.close()


def build_run(cfg: Config, launch, run, run_dir: str) -> RunParts:
    """Every part of a run on this rank (module docstring); `run` is the opened RunDir of
    `run_dir` (the start is recorded in it once the inputs passed their checks)."""
    made: list = []  # (object, its stop method) to undo when a later part fails
    try:
        return _build(cfg, launch, run, run_dir, made)
    except BaseException:
        for part, stop in reversed(made):
            getattr(part, stop)()
        raise


def _build(cfg: Config, launch, run, run_dir: str, made: list) -> RunParts:
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    # The placement is checked before any group is built (a bad one is a ConfigError naming
    # the role and the ranks, alike on every rank); then each set's groups.
    placement = Placement.resolve(cfg, world, launch.local_world_size)
    timeout = process_group_timeout(cfg.trainer.collective_timeout_s)
    place = RolePlacement.build(placement, cfg.rollout.tensor_parallel_size,
                                int(timeout.total_seconds() // 60) + 1,
                                cfg.parallel.expert_model_parallel_size)
    # The generating set's (the rollout set's with placement.rollout): its replicas share out
    # each prompt batch; None on the ranks that only receive the samples.
    gen_groups = place.groups[place.generating_set]
    seed_everything(cfg.trainer.seed, rank)
    place.seed_rng(cfg.trainer.seed)
    watchdog = Watchdog(cfg.trainer.collective_timeout_s, rank)
    made.append((watchdog, "stop"))
    # Unarmed until the loop starts: a signal while building ends the process at once.
    guard = PreemptionGuard(armed=False).install()
    made.append((guard, "uninstall"))
    # After the guard's handlers: a rank blocked in a collective still reports a signal.
    watchdog.start(watch_signals=True)

    # Everything the user supplied (config, data, model directory, reward code) is read and
    # checked before minutes of model building, and "auto" offload refuses a run whose phases
    # would not fit; a problem on any rank stops every rank.
    with watchdog.phase("check inputs"):
        inputs = build.build_inputs(cfg, world, launch.local_world_size, launch.local_rank)
        rewards = inputs.rewards
        made.append((rewards, "close"))
        # Token budgets where no micro-batch size is set (the planner's, on every rank alike),
        # before the offload choice that plans with them.
        cfg, micro_batches = build.resolve_micro_batches(cfg, inputs.info, world,
                                                         launch.local_world_size)
        offload, why = build.resolve_offload(cfg, inputs.info, world, launch.local_world_size)
        # Before the models too; a failure on any rank (only rank 0 loads the user's metric
        # function) stops every rank.
        val_metrics = all_ranks_agree(lambda: ValMetrics.from_config(cfg, rank),
                                      "checking the validation metrics")
    run.record_start(cfg)  # inputs checked: a refused start leaves the record alone
    info = inputs.info
    build.declare_token_fields(cfg, info)  # every rank, whichever roles it builds
    loader = build.build_prompt_loader(cfg, inputs.train_data, gen_groups)
    if rank == 0:  # what the data stage kept, before minutes of model building
        log_data_stage(inputs.train_data, inputs.val_data, cfg.data, loader.batches_per_epoch)
        if not placement.colocated:
            log.info("placement: %s", placement.describe())
        _log_lora(cfg, info)

    # Each rank builds its own roles' models only (None / {} for the others').
    with watchdog.phase("build models"):
        roles = _build_roles(cfg, place, info, inputs.reward_models)
        sampler = _build_sampler(cfg, place, info, roles["actor"], inputs.generate_fn, inputs.agent_loop)
    for role in (roles["actor"], roles["critic"]):
        if role is not None:
            role.engine.skip_nonfinite = cfg.trainer.on_nonfinite == "skip"
    if rank == 0:
        for line in micro_batches:
            log.info("micro-batches: %s", line)
        log.info("offload between phases: %s (%s)", "on" if offload else "off", why)
    device = training_device()
    learner = Learner(cfg, place, device, roles["actor"], roles["reference"], roles["critic"],
                      build.build_kl_controller(cfg),
                      build.build_offloaders(cfg, roles["actor"], roles["critic"], offload))
    scorer = Scorer(cfg, rewards, roles["reward_models"], list(inputs.reward_models), place,
                    info.tokenizer, device, rank)
    if cfg.rollout.mode == "fully_async":  # on a rollout set of its own (config/validate.py)
        producer = FullyAsyncProducer(sampler, loader, place, cfg, learner.offload_training_state,
                                      scorer)
    elif cfg.rollout.partial.enable:  # colocated, sync mode (config/validate.py)
        producer = PartialProducer(sampler, loader, place, cfg, learner.offload_training_state,
                                   scorer)
    else:
        producer = Producer(sampler, loader, place, cfg, learner.offload_training_state,
                            cfg.rollout.max_staleness if cfg.rollout.mode == "one_step_off" else 0,
                            scorer, inputs.group_filters)
    checkpoints = build.build_checkpointers(
        cfg, run_dir, info,
        role_ranks=None if placement.colocated else place.role_ranks())
    tracking = Tracking(cfg.trainer.logger, run_dir, rank, cfg.trainer.project,
                        cfg.trainer.experiment_name, config=None)
    return RunParts(cfg, place, gen_groups, device, watchdog, guard, rewards, val_metrics, info,
                    inputs.train_data, inputs.val_data, loader, sampler, scorer, learner,
                    producer, checkpoints, tracking)


def _build_roles(cfg: Config, place: RolePlacement, info, rm_infos: dict) -> dict:
    """This rank's actor, reference, critic (None off their sets) and reward models ({})."""
    groups, runs, seed = place.groups, place.runs, cfg.trainer.seed
    roles: dict[str, Optional[Any]] = {}
    # Each role from its own seed: a fresh value head is the same whichever roles a rank built
    # before it (placed, the critic's set builds nothing else).
    with build.role_seed(seed, "actor"):
        roles["actor"] = build.build_actor(cfg, groups["actor"], info) if runs("actor") else None
    with build.role_seed(seed, "reference"):
        roles["reference"] = (build.build_reference(cfg, groups["reference"], info, roles["actor"])
                              if runs("reference") else None)
    with build.role_seed(seed, "critic"):
        roles["critic"] = build.build_critic(cfg, groups["critic"], info) if runs("critic") else None
    with build.role_seed(seed, "reward_model"):
        roles["reward_models"] = (build.build_reward_models(cfg, groups["reward_model"], info, rm_infos)
                                  if runs("reward_model") else {})
    return roles


def _build_sampler(cfg: Config, place: RolePlacement, info, actor, generate_fn=None,
                   agent_loop=None) -> Sampler:
    """The engine's side: a GenerationPhase where it runs (the actor's ranks, or those of
    placement.rollout), the WeightSender on the actor's ranks of a rollout set; generate_fn:
    rollout.generate_fn's function, agent_loop: rollout.agent_loop's runtime, or None."""
    generation = sender = None
    if place.generating_set == "rollout":
        side = build.build_rollout_set_phase(cfg, place, info, actor)
        generation, sender = (None, side) if isinstance(side, WeightSender) else (side, None)
    elif place.runs("actor"):
        generation = build.build_generation_phase(cfg, place.groups["actor"], info, actor)
    return Sampler(cfg, info, place, generation, sender, generate_fn, agent_loop)


def _log_lora(cfg: Config, info) -> None:
    """What trains with LoRA (the count from the shape)."""
    for role in planner.lora_roles(cfg):
        try:
            dims = planner.resolve_dims(info.hf_dir or cfg.model.path)
        except ConfigError as e:  # a log line must not stop the run
            log.info("LoRA on %s (no parameter count: %s)", role, e)
        else:
            log.info("%s", planner.lora_summary(cfg, dims, role))
