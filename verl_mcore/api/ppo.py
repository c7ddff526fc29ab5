"""PPOTrainer: `update(buffer) -> metrics`, the second half of `Trainer.step`.

    trainer = PPOTrainer(policy, algorithm="grpo", kl_loss_coef=0.001)
    metrics = trainer.update(buffer)       # or update(experiences)

By the trainer's own learner (learner.py), in its order: old log-probs (unless the update is one
on-policy optimizer step), reference log-probs (with a KL term), token rewards (scores on each
response's last token, minus the in-reward KL), the critic's update on its GAE returns (gae),
the advantages (algorithm: a name of algo/advantages.ADV_ESTIMATORS: grpo, gae, rloo,
reinforce_plus_plus, reinforce_plus_plus_baseline, remax), the actor's update (PPO epochs x
mini-batches). The metrics are the trainer's (actor/pg_loss, critic/score/mean, ...).

The batch is every experience given, as one (Experiences.concat): data.train_batch_size is its
prompts, and mini_batch_size (prompts per optimizer step) defaults to all of them. It must have
been sampled by the current policy: the old log-probs of a sample drawn before the last update
would be the new policy's (clear the buffer after each update, as Trainer.step does).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

from verl_mcore import build
from verl_mcore.api import session as sess
from verl_mcore.api.buffer import ExperienceBuffer, Experiences
from verl_mcore.api.models import micro_batched
from verl_mcore.config import ConfigError
from verl_mcore.config.loading import from_dict
from verl_mcore.distributed.placement import RolePlacement
from verl_mcore.engine.reward_model import same_tokenizer
from verl_mcore.learner import Learner
from verl_mcore.stage_timer import StageTimer

_BATCH_KEYS = ("data.train_batch_size is the experiences' prompts, rollout.n the worker's n, "
               "actor.ppo_mini_batch_size the PPOTrainer's mini_batch_size, "
               "actor.micro_batch_size_per_gpu the Policy's")


class PPOTrainer:
    """The update of a policy (and its critic, for gae) from experiences.

    algorithm: the advantage estimator. ppo_epochs, mini_batch_size (prompts), clip_ratio
    (both sides of PPO's clip), entropy_coeff, loss_agg_mode, gamma, lam: the actor.* and
    algorithm.* keys of those names. kl_loss_coef: a KL-to-reference term in the loss
    (actor.use_kl_loss); kl_reward_coef: a KL penalty in the reward (algorithm.use_kl_in_reward);
    either builds the reference, a frozen copy of the policy's initial weights. None leaves the
    config's default. overrides: more keys (session.OWNED lists them).
    """

    def __init__(self, policy, critic=None, *, algorithm: str = "grpo",
                 ppo_epochs: Optional[int] = None, mini_batch_size: Optional[int] = None,
                 clip_ratio: Optional[float] = None, entropy_coeff: Optional[float] = None,
                 loss_agg_mode: Optional[str] = None, gamma: Optional[float] = None,
                 lam: Optional[float] = None, kl_loss_coef: Optional[float] = None,
                 kl_reward_coef: Optional[float] = None, overrides: Sequence[str] = ()):
        who = "PPOTrainer"
        self.policy, self.critic, self.mini_batch_size = policy, critic, mini_batch_size
        tree = sess.settings(who, {
            "algorithm.adv_estimator": algorithm, "algorithm.gamma": gamma, "algorithm.lam": lam,
            "actor.ppo_epochs": ppo_epochs, "actor.clip_ratio_low": clip_ratio,
            "actor.clip_ratio_high": clip_ratio, "actor.entropy_coeff": entropy_coeff,
            "actor.loss_agg_mode": loss_agg_mode,
            "actor.use_kl_loss": None if kl_loss_coef is None else True,
            "actor.kl_loss_coef": kl_loss_coef,
            "algorithm.use_kl_in_reward": None if kl_reward_coef is None else True,
            "algorithm.kl_ctrl.kl_coef": kl_reward_coef}, overrides)
        critic_tree = {"critic": critic._tree.get("critic", {})} if critic is not None else {}
        self.cfg = sess.config_of(policy._tree, tree, critic_tree)
        sess.check(self.cfg, who, policy._session.world)
        if self.cfg.uses_critic != (critic is not None):
            raise ConfigError(f"{who}: algorithm={self.cfg.algorithm.adv_estimator!r} "
                              + ("learns values: pass critic=Critic.from_pretrained(...)"
                                 if critic is None else "uses no critic: leave critic=None, or "
                                 "choose algorithm='gae'"))
        if critic is not None and not same_tokenizer(policy.info.tokenizer, critic.info.tokenizer):
            raise ConfigError(f"{who}: the critic's tokenizer ({critic.info.hf_dir}) is not the "
                              f"policy's ({policy.info.hf_dir}), but the critic reads the "
                              "policy's token ids: give Critic.from_pretrained tokenizer="
                              "policy.tokenizer, or a critic of the policy's vocabulary")
        self.kl_ctrl = build.build_kl_controller(self.cfg)
        with build.role_seed(self.cfg.trainer.seed, "reference"):  # as the Trainer builds it
            self.reference = build.build_reference(micro_batched(self.cfg, policy.info),
                                                  policy._session.groups, policy.info, policy.actor)
        roles = ("actor",) + (("reference",) if self.reference is not None else ()) + (
            ("critic",) if critic is not None else ())
        self._learner = Learner(self.cfg, RolePlacement.everywhere(policy._session.groups, roles),
                                policy._session.device, None, self.reference,
                                kl_ctrl=self.kl_ctrl)
        self.skipped_updates = 0
        self.updates = 0

    def update(self, experiences: Union[ExperienceBuffer, Experiences]) -> dict[str, float]:
        """One update from all of `experiences` (module docstring); the trainer's metrics."""
        exp = experiences.batch() if isinstance(experiences, ExperienceBuffer) else experiences
        self._check_sampled_by_policy(exp)
        cfg = self._config_for(exp)
        learner, timer, step = self._learner, StageTimer(), self.updates + 1
        learner.cfg, learner.actor = cfg, self.policy.actor_for(cfg)
        learner.critic = self.critic.role_for(cfg) if self.critic is not None else None
        if self.reference is not None:  # its log-probs at the temperature the samples were drawn
            self.reference.temperature = learner.actor.temperature
        # The update writes log-probs, values and advantages into a batch of its own: the
        # caller's experiences stay as generate made them.
        rollout = dataclasses.replace(exp.rollout, train=dataclasses.replace(exp.rollout.train))
        metrics, _ = learner.train(step, rollout, timer)  # scored: the learner reads its scores
        # The optimizer steps skipped for a non-finite gradient (on_nonfinite=skip), as
        # Trainer.step counts them.
        self.skipped_updates += sum(learner.skipped_now.values())
        learner.skipped_now = {}
        if learner.actor_learns(step):
            metrics["train/skipped_updates"] = float(self.skipped_updates)
            self.policy.version += 1
        metrics.update(timer.metrics())
        if "actor/mfu" in metrics:
            metrics["perf/mfu/actor"] = metrics.pop("actor/mfu")
        self.updates = learner.last_good_step = step
        return {k: float(v) for k, v in metrics.items() if v is not None}

    def _check_sampled_by_policy(self, exp: Experiences) -> None:
        if exp.policy is not self.policy:
            raise ValueError("PPOTrainer.update: these experiences were sampled by another "
                             "Policy than the one this trainer updates")
        if exp.policy_version != self.policy.version:
            raise ValueError(
                f"PPOTrainer.update: experiences sampled after {exp.policy_version} policy "
                f"updates, but the policy has had {self.policy.version}: their old log-probs "
                "would be the updated policy's. Update from fresh experiences (clear the buffer "
                "after each update)")
        if exp.baseline is None and self.cfg.algorithm.adv_estimator == "remax":
            raise ValueError("PPOTrainer.update: algorithm='remax' needs greedy baselines: make "
                             "the experiences with RolloutWorker(..., greedy_baseline=True)")

    def _config_for(self, exp: Experiences):
        """The update's Config: this trainer's, the sampling of the worker that made `exp`, and
        its batch sizes, checked by the trainer's rules (batches divide over mini-batches, DP
        ranks and micro-batches)."""
        n = exp.cfg.rollout.n
        if exp.num_samples != exp.num_prompts * n:
            raise ValueError(f"PPOTrainer.update: {exp.num_samples} samples of {exp.num_prompts} "
                             f"prompts, not rollout.n={n} per prompt: keep prompts' groups whole "
                             "(ExperienceBuffer.mini_batches / Experiences.select_groups)")
        prompts = exp.num_prompts
        base = dataclasses.replace(self.cfg, rollout=exp.cfg.rollout, data=exp.cfg.data,
                                   reward=exp.cfg.reward)
        cfg = from_dict(type(self.cfg), {
            "data": {"train_batch_size": prompts},
            "actor": {"ppo_mini_batch_size": self.mini_batch_size or prompts}}, defaults=base)
        sess.check(cfg, "PPOTrainer.update", self.policy._session.world, lengths=True,
                   batches=True, what=_BATCH_KEYS)
        return cfg
