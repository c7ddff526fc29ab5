"""The learner: one step's training on a rollout batch, the same for `Trainer` and the Python
API's `PPOTrainer`.

    old / ref log-probs -> scores -> KL -> token rewards -> critic values + update
        -> advantages -> actor update -> metrics

The critic learns before the advantages are computed: both read its values before the update
(V_old), which a one-step critic update computes in its own forward passes (engine/critic.py).

Where the roles run. Colocated, every rank runs every role. Placed on their own sets
(distributed/placement.py), a phase runs on its role's ranks and what other sets read of it
(reward-model scores, values, log-probs for an in-reward KL) is broadcast as tensors; `place`
decides that inside the phase methods, so `train` is the same program either way, and the sets'
phases overlap between those exchanges (the log-prob passes run while a reward set scores).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from verl_mcore import ops
from verl_mcore.algo.advantages import compute_advantages
from verl_mcore.algo.kl import apply_kl_penalty
from verl_mcore.algo.off_policy import correct_off_policy
from verl_mcore.algo.overlong import actor_batch
from verl_mcore.algo.policy_loss import truncated_is_weights
from verl_mcore.engine.engine import DivergedStepError
from verl_mcore.errors import NonFiniteError
from verl_mcore.reward import place_on_last_token
from verl_mcore.rollout.batch import Rollout

# () -> (scores [B] on the training device, reward metrics, ReMax baselines [B] or None)
ScoreFn = Callable[[], tuple[torch.Tensor, dict, Optional[torch.Tensor]]]


class Learner:
    """cfg: the run's Config; place: the RolePlacement (which rank runs which role); device: the
    training device; actor, reference, critic: this rank's roles (None for a role it does not
    run); kl_ctrl: the in-reward KL controller; offloaders: role -> HostOffloader of the
    optimizer state between phases ({} without offload).

    The counters of skipped optimizer steps (trainer.on_nonfinite=skip) and the last good step
    carry from step to step; the trainer reads and sets them (checkpoints, metrics)."""

    def __init__(self, cfg, place, device, actor, reference=None, critic=None, kl_ctrl=None,
                 offloaders: Optional[dict] = None):
        self.cfg, self.place, self.device = cfg, place, device
        self.actor, self.reference, self.critic = actor, reference, critic
        self.kl_ctrl, self.offloaders = kl_ctrl, offloaders or {}
        self.last_good_step = 0
        self.skipped_now: dict[str, int] = {}  # role -> optimizer steps skipped in this step
        self.consecutive_skips: dict[str, int] = {}  # role -> skipped in a row (on_nonfinite=skip)

    def train(self, step: int, rollout: Rollout, phase,
              score: Optional[ScoreFn] = None) -> tuple[dict[str, float], float]:
        """The step's training on `rollout` (its tensors on the training device): log-probs,
        scores (the rollout's own when it was scored, else `score()`, after the log-prob
        passes), advantages, the critic's and the actor's updates; `phase(name)` times each.
        (metrics, tokens of the batch)."""
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
            scores, reward_metrics, baseline = (score() if rollout.scores is None else
                                                (rollout.scores, {}, rollout.baseline))
        with phase("adv"):
            token_rewards, kl_metrics = self.token_rewards(batch, scores)
            off_policy_metrics, actor_mask = self.off_policy(rollout, batch)
            metrics: dict[str, float] = dict(off_policy_metrics)
        if self.place.has("critic"):  # leaves the values before its update in batch.values
            metrics.update(self.fit_critic(step, batch, token_rewards, phase))
        with phase("adv"):
            batch.advantages, batch.returns = self.advantages(batch, token_rewards, scores,
                                                              rollout.group_ids, baseline)
        if self.actor_learns(step):
            # actor.mask_truncated_samples: its own batch, truncated samples out of the loss
            trained, mask_metrics = actor_batch(self.cfg, rollout)
            if actor_mask is not None:  # rollout.correction's masks: out of the actor's loss
                trained = dataclasses.replace(trained,
                                              response_mask=trained.response_mask * actor_mask)
            with phase("actor"):  # placed, alongside the critic set's update
                actor_metrics = self.update(step, "actor", trained)
            metrics.update(actor_metrics)
            metrics.update(mask_metrics)
        metrics.update(reward_metrics)
        metrics.update(kl_metrics)
        metrics.update(self.data_metrics(step, rollout, scores, token_rewards, entropy))
        return metrics, float(batch.seq_lens.sum())

    def actor_learns(self, step: int) -> bool:
        """Whether the actor updates at `step` (not during critic.warmup_steps)."""
        return step > self.cfg.critic.warmup_steps or not self.place.has("critic")

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
        # Samples of older weights (one_step_off, fully_async, rollout.partial's continued
        # samples), or weighed against the engine's log-probs (rollout.tis_cap,
        # rollout.correction): the ratio's denominator is the actor's current policy.
        off_policy = (cfg.rollout.mode != "sync" or cfg.rollout.partial.enable
                      or cfg.rollout.weighs_engine_log_probs)
        return (cfg.actor.recompute_old_log_probs == "always" or cfg.algorithm.use_kl_in_reward
                or not on_policy or off_policy)

    def off_policy(self, rollout: Rollout,
                   batch) -> tuple[dict[str, float], Optional[torch.Tensor]]:
        """How far the engine's sampling policy is from the actor's recomputed old log-probs, and
        the corrections for it: (metrics, the actor's loss mask `[B, R]` or None).

        `rollout/engine_vs_trainer_logp_diff` (mean |difference| over response tokens; in
        one_step_off it includes the staleness); with rollout.tis_cap the truncated importance
        weights min(pi_old / pi_engine, cap) the actor's loss multiplies each token by
        (algo/policy_loss.truncated_is_weights); with rollout.correction the masks that take
        tokens or samples out of the actor's loss and the decoupled objective's weights
        (algo/off_policy.py). Nothing without the engine's log-probs, except that a
        rollout.correction without them is an error, not a silent no-op."""
        c = self.cfg.rollout.correction
        if rollout.engine_log_probs is None or batch.old_log_probs is None:
            if c.enabled and batch.old_log_probs is not None:
                raise ValueError("rollout.correction is on, but the rollout batch has no engine "
                                 "log-probs: sample with SamplingParams.logprobs=True (the "
                                 "trainer's Sampler.sampling asks for them under this config)")
            return {}, None
        mask = batch.response_mask
        engine = rollout.engine_log_probs.to(mask.device)
        diff = ((batch.old_log_probs - engine).abs() * mask).sum() / mask.sum().clamp(min=1)
        metrics = {"rollout/engine_vs_trainer_logp_diff": float(diff)}
        if self.cfg.rollout.tis_cap is not None:
            batch.is_weights, tis = truncated_is_weights(batch.old_log_probs, engine, mask,
                                                         self.cfg.rollout.tis_cap)
            metrics.update(tis)
        if not c.enabled:
            return metrics, None
        fix = correct_off_policy(batch.old_log_probs, engine, mask, token_mask=c.token_mask,
                                 seq_mask=c.seq_mask, decoupled=c.decoupled,
                                 decoupled_cap=c.decoupled_cap)
        if fix.weights is not None:  # decoupled (validation keeps rollout.tis_cap unset then)
            batch.is_weights = fix.weights
        metrics.update(fix.metrics)
        return metrics, fix.loss_mask

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

    def data_metrics(self, step: int, rollout: Rollout, scores, token_rewards,
                     entropy) -> dict[str, float]:
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
        m.update(rollout.trajectory_metrics(step - 1))
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
