"""A run's checkpoints: the actor (with the trainer state) and, for PPO, the critic.

    RUN_DIR/checkpoints/actor/step_N/    model + optimizer + LR schedule + RNG + trainer state
    RUN_DIR/checkpoints/critic/step_N/   model + optimizer + LR schedule (PPO with a critic)

Each role is written by engine.checkpoint.Checkpointer (temporary directory, rename, `latest`
pointer last). The critic is saved before the actor, so a kill between the two leaves the
actor's previous step as its newest; resume takes the newest step complete for every role.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from verl_mcore.engine.checkpoint import Checkpointer, find_latest_checkpoint, list_checkpoints, load_checkpoint

log = logging.getLogger("verl_mcore.checkpoints")


def _engine_parts(role):
    e = role.engine
    return e.model, e.optimizer, e.scheduler


class RunCheckpoints:
    def __init__(self, ckpt_cfg, run_dir: str, with_critic: bool):
        self.root = os.path.join(run_dir, "checkpoints")
        self.actor = Checkpointer.from_config(ckpt_cfg, os.path.join(self.root, "actor"))
        self.critic = Checkpointer.from_config(ckpt_cfg, os.path.join(self.root, "critic")) if with_critic else None

    def save(self, step: int, actor, critic, trainer_state: dict) -> None:
        if self.critic is not None:
            self.critic.save(step, *_engine_parts(critic))
        self.actor.save(step, *_engine_parts(actor), extra_state=trainer_state)

    def _choose(self, load_path: Optional[str]) -> Optional[tuple[str, Optional[str]]]:
        """(actor path, critic path) to resume from, or None for a fresh start."""
        if load_path:
            actor_path = os.path.abspath(load_path)
            step = os.path.basename(actor_path.rstrip("/"))
            critic_path = os.path.join(self.critic.root, step) if self.critic else None
            if critic_path and not os.path.isdir(critic_path):
                raise FileNotFoundError(f"checkpoint.load_path={load_path}: no critic checkpoint "
                                        f"{critic_path} for the same step")
            return actor_path, critic_path
        latest = find_latest_checkpoint(self.actor.root)
        if latest is None:
            return None
        if self.critic is None:
            return latest, None
        critic_steps = dict(list_checkpoints(self.critic.root))
        actor_steps = dict(list_checkpoints(self.actor.root))
        latest_step = next(s for s, p in actor_steps.items() if os.path.samefile(p, latest))
        if latest_step in critic_steps:
            return latest, critic_steps[latest_step]
        common = sorted(set(critic_steps) & set(actor_steps))
        if not common:
            log.warning("checkpoints: actor has steps %s but the critic none of them; starting fresh",
                        sorted(actor_steps))
            return None
        step = common[-1]
        log.warning("checkpoints: critic has no step %d (killed between the two saves?); "
                    "resuming both roles from step %d", latest_step, step)
        return actor_steps[step], critic_steps[step]

    def resume(self, ckpt_cfg, actor, critic) -> Optional[dict]:
        """Load the chosen checkpoint into the roles; return the trainer state (None: fresh)."""
        if ckpt_cfg.resume == "never" and not ckpt_cfg.load_path:
            return None
        chosen = self._choose(ckpt_cfg.load_path)
        if chosen is None:
            return None
        actor_path, critic_path = chosen
        loaded = load_checkpoint(actor_path, *_engine_parts(actor))
        if critic_path is not None:
            load_checkpoint(critic_path, *_engine_parts(critic))
        log.info("loaded checkpoint %s (step %d)", actor_path, loaded.step)
        return loaded.extra_state

    def latest_path(self) -> Optional[str]:
        return find_latest_checkpoint(self.actor.root)

    def close(self) -> None:
        self.actor.close()
        if self.critic is not None:
            self.critic.close()
