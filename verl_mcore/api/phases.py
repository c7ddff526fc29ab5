"""The trainer's phases, run over the Python API's objects.

A RolloutWorker generates and scores, a PPOTrainer computes the old / reference log-probs, the
token rewards, the critic's update, the advantages and the actor's update: what `Trainer.step`
does, in its order. Not a copy of those phases, which would drift from the trainer's: they are
`Trainer`'s own methods, taken onto `Phases`. Each reads the attributes of a Trainer it needs
(`cfg`, `rollout`, `actor`, `groups`, `rewards`, ...); the API objects set them, the
RolloutWorker those of generating and scoring, the PPOTrainer those of the update, and keep one
`Phases` each, as a Trainer keeps its counters (`step_index`, `skipped_updates`) from step to
step. tests/api/test_api.py runs the API and `Trainer` side by side: the same metrics.
"""
from __future__ import annotations

from verl_mcore.config.placement import ROLES, Placement, RoleSet
from verl_mcore.distributed.placement import RolePlacement
from verl_mcore.trainer import Trainer


# The Trainer methods an API object runs: what they read of a Trainer, the objects set.
TRAINER_PHASES = ("sampling", "generate", "sample_part", "share_part", "_gen_replica", "score",
                  "needs_old_log_probs", "old_log_probs", "ref_log_probs", "off_policy",
                  "token_rewards", "fit_critic", "advantages", "update", "_update",
                  "check_finite", "data_metrics", "offload_training_state",
                  "onload_training_state", "generation_stats")


class Phases:
    """A Trainer's phase methods (TRAINER_PHASES) over the parts given as keyword arguments
    (module docstring)."""

    def __init__(self, **parts):
        # What the API objects do not move between phases (no offload, no skipped steps yet).
        self.offloaders: dict = {}
        self.skipped_updates = 0
        self.consecutive_skips: dict[str, int] = {}
        self.last_good_step = 0
        self.step_index = 0
        self.skipped_now: dict[str, int] = {}
        vars(self).update(parts)
        self.reward_model_names = list(getattr(self, "reward_models", {}))
        self.place = _colocated(getattr(self, "groups", None))


def _colocated(groups):
    """The API's objects run every role on every rank: the trainer's placement of that case,
    in which each phase simply runs where it is called (distributed/placement.py)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    everywhere = RoleSet(tuple(range(world)), 1, 1)
    placement = Placement(world, {role: everywhere for role in ROLES})
    rank = dist.get_rank() if dist.is_initialized() else 0
    return RolePlacement(placement, {role: groups if groups is not None else True for role in ROLES},
                         rank)


for _name in TRAINER_PHASES:
    setattr(Phases, _name, vars(Trainer)[_name])
