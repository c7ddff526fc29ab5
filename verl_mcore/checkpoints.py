"""A run's checkpoints: the actor (with the trainer state) and, for PPO, the critic.

    RUN_DIR/checkpoints/actor/step_N/    model + optimizer + LR schedule + RNG + trainer state
    RUN_DIR/checkpoints/critic/step_N/   model + optimizer + LR schedule (PPO with a critic)
    RUN_DIR/checkpoints/load_path_consumed.json   the last checkpoint.load_path resumed from

Each role is written by engine.checkpoint.Checkpointer (temporary directory, rename, `latest`
pointer last). The critic is saved before the actor, so a kill between the two leaves the
actor's previous step as its newest; resume takes the newest step complete for every role, and
good for every role (engine.checkpoint.load_newest: a step with a corrupt actor or critic
checkpoint is set aside as a whole, and the run falls back to the step before). An explicit
checkpoint.load_path that fails its checks is refused, never replaced by another. Rotation
(checkpoint.keep_last) counts only steps complete for every role, so the critic's commit of a
step never deletes the step the actor still needs to resume from.

The actor's checkpoint also holds the run's resolved config (config.yaml) and the model's
architecture (model_arch.json), which a resume compares with its own (config/resume.py).

Disk space: before each save rank 0 compares the space free under RUN_DIR/checkpoints with the
planner's estimate of the checkpoint (plan.checkpoint_bytes) and refuses to start one that
clearly cannot fit; a full disk during a save (ENOSPC or EDQUOT on any rank, or in megatron's
writer) removes that save's temporary directory and raises DiskFullError on every rank, naming
the path, the bytes free and the expected size. Earlier checkpoints are never touched by either.

checkpoint.load_path is a one-time request. A Slurm requeue repeats the command line, load_path
included; resuming from it again would throw away everything the run did since. So a resume from
load_path is recorded, and a later start with the same load_path continues from the run's newest
checkpoint once the run has committed one past it. A different load_path is a new request.
Resuming from load_path at step S sets this run's checkpoints of steps > S aside (renamed
abandoned.step_N): they belong to the continuation given up, and would otherwise outrank the new
ones in rotation and in the choice of the newest.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional, Sequence, Union

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from verl_mcore.distributed.agree import raised_on_every_rank
from verl_mcore.engine.checkpoint import (
    BadCheckpointError,
    Checkpointer,
    LoadedCheckpoint,
    find_latest_checkpoint,
    load_checkpoint,
    load_newest,
    remove_unfinished_saves,
    set_aside_checkpoints_after,
    verify_checkpoint,
)
from verl_mcore.utils.files import disk_full_error, free_bytes, is_disk_full, write_json_atomic

log = logging.getLogger("verl_mcore.checkpoints")

CHECKPOINTS = "checkpoints"
CONSUMED = "load_path_consumed.json"


def role_roots(run_dir: str) -> dict[str, str]:
    """{role: the directory of its checkpoints} (see the module docstring)."""
    return {role: os.path.join(run_dir, CHECKPOINTS, role) for role in ("actor", "critic")}


def _engine_parts(role):
    """(chunks, optimizer, scheduler) of a role; nothing on a rank that does not hold it (the
    role lives on other ranks: this rank only takes part in the collectives)."""
    if role is None:
        return [], None, None
    e = role.engine
    return e.model, e.optimizer, e.scheduler


class RunCheckpoints:
    """expected_bytes: {role: bytes} of one checkpoint (plan.checkpoint_bytes), None when the
    model shape is unknown (no space check before a save). run_files: {relative path: text or
    bytes} saved in each actor checkpoint (the run's config.yaml and model_arch.json, its HF
    config and tokenizer files: build.build_checkpointers).

    role_ranks: {"actor" / "critic": the role's global ranks} when a role lives on a set of its
    own (placement); a role left out runs on every rank. Every rank calls save / resume / close
    alike; a rank that does not hold a role passes None for it (its checkpoint is written and
    read by the role's ranks, its trainer_state.pt by the role's first rank)."""

    def __init__(self, ckpt_cfg, run_dir: str, with_critic: bool,
                 expected_bytes: Optional[dict[str, int]] = None,
                 run_files: Optional[dict[str, Union[str, bytes]]] = None,
                 role_ranks: Optional[dict[str, Sequence[int]]] = None,
                 base_weights: Optional[str] = None):
        self.root = os.path.join(run_dir, CHECKPOINTS)
        roots = role_roots(run_dir)
        ranks = role_ranks or {}
        self.actor = Checkpointer.from_config(ckpt_cfg, roots["actor"], ranks.get("actor"))
        self.critic = (Checkpointer.from_config(ckpt_cfg, roots["critic"], ranks.get("critic"))
                       if with_critic else None)
        for ckpt in self._roles():
            ckpt.base_weights = base_weights  # recorded by a LoRA role's adapter-only checkpoints
            ckpt.step_roots = [c.root for c in self._roles()]  # rotated as pairs of one step
        self.expected = sum(expected_bytes.values()) if expected_bytes else None
        self.run_files = run_files

    def _roles(self) -> list[Checkpointer]:
        return [c for c in (self.actor, self.critic) if c is not None]

    def save(self, step: int, actor, critic, trainer_state: dict) -> None:
        what = f"the checkpoint of step {step}"
        try:
            for ckpt in self._roles():  # saves in flight hold space and may fail first
                ckpt.maybe_finalize(blocking=True)
            self._check_space(what)
            if self.critic is not None:
                self.critic.save(step, *_engine_parts(critic))
            self.actor.save(step, *_engine_parts(actor), extra_state=trainer_state,
                            extra_files=self.run_files)
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            self._failed(e, what)

    def _check_space(self, what: str) -> None:
        """Refuse, on every rank, a save that clearly cannot fit (rank 0 looks, all agree)."""
        if self.expected is None:
            return
        with raised_on_every_rank("checking the free disk space"):
            if dist.get_rank() == 0 and free_bytes(self.root) < self.expected:
                raise disk_full_error(self.root, what, self.expected)

    def _failed(self, error: BaseException, what: str) -> None:
        """A save raised on every rank (dist_checkpointing and Checkpointer raise everywhere).
        Only the failing ranks see a full disk in their error, so they agree: then rank 0
        removes the unfinished save (it holds the space the next attempt needs) and every rank
        raises DiskFullError. Other errors are raised as they are.

        A full disk does not always say ENOSPC: torch's zip writer in megatron's workers has
        reported one as "unexpected pos 704 vs 598". So a save that failed with less space left
        than a checkpoint needs counts as a full disk too (the original error is chained)."""
        full: list = [None] * dist.get_world_size()
        short = self.expected is not None and free_bytes(self.root) < self.expected
        dist.all_gather_object(full, is_disk_full(error) or short)
        if not any(full):
            raise error
        if dist.get_rank() == 0:
            for ckpt in self._roles():
                for path in remove_unfinished_saves(ckpt.root):
                    log.warning("checkpoints: removed the unfinished save %s (disk full)", path)
        raise disk_full_error(self.root, what, self.expected) from error

    def _load_newest(self, actor, critic, check=None, after: Optional[int] = None
                     ) -> Optional[LoadedCheckpoint]:
        """The run's newest step good for every role, loaded (load_newest); the actor's result.
        check(actor checkpoint path) runs before any weight of that step is read; what it
        raises is not a corrupt checkpoint and propagates (it refuses the config, not the
        checkpoint)."""
        roles = [(self.actor, actor)]
        if self.critic is not None:
            roles.append((self.critic, critic))

        def load(i, path):
            if i == 0 and check is not None:
                check(path)
            ckpt, role = roles[i]
            return load_checkpoint(path, *_engine_parts(role), verified=True,
                                   role_ranks=ckpt.role.ranks, base_weights=ckpt.base_weights)

        loaded = load_newest([ckpt.root for ckpt, _ in roles], load, after=after)
        return loaded[0] if loaded else None

    def _load_from_load_path(self, load_path: str, actor, critic, check=None) -> LoadedCheckpoint:
        actor_path = os.path.abspath(load_path)
        paths = [(actor_path, actor, self.actor)]
        if self.critic is not None:
            # The critic saved with this actor: the same step of the same run, which need not be
            # this run.
            run_checkpoints = os.path.dirname(os.path.dirname(actor_path))
            critic_path = os.path.join(run_checkpoints, "critic", os.path.basename(actor_path))
            if not os.path.isdir(critic_path):
                raise FileNotFoundError(
                    f"checkpoint.load_path={load_path}: PPO resumes the critic saved with that "
                    f"actor, expected at {critic_path} (checkpoints/critic/ beside the actor's "
                    f"checkpoints/actor/), which does not exist")
            paths.append((critic_path, critic, self.critic))
        for path, _, _ in paths:  # every role checked before any is loaded
            try:
                verify_checkpoint(path)
            except BadCheckpointError as e:
                raise BadCheckpointError(
                    f"checkpoint.load_path={load_path}: refused, nothing was loaded: {e}. "
                    "Pick another checkpoint (an explicit load_path is never replaced by "
                    "another one)") from None
        if check is not None:
            check(actor_path)
        loaded = [load_checkpoint(path, *_engine_parts(role), verified=True,
                                  role_ranks=ckpt.role.ranks, base_weights=ckpt.base_weights)
                  for path, role, ckpt in paths]
        return loaded[0]

    def _consumed_step(self, load_path: str) -> Optional[int]:
        """The step resumed from when this run last consumed this very load_path, else None."""
        marker = os.path.join(self.root, CONSUMED)
        try:
            with open(marker) as f:
                record = json.load(f)
            consumed, step = record["load_path"], int(record["step"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:
            log.warning("checkpoints: %s is unreadable (%s); treating checkpoint.load_path=%s as a "
                        "new request", marker, e, load_path)
            return None
        return step if consumed == os.path.realpath(load_path) else None

    def _consume(self, load_path: str, step: int) -> None:
        """Record that this run resumed from load_path at `step`, and set the run's later
        checkpoints aside (rank 0, after the load)."""
        for ckpt in (self.actor, self.critic):
            if ckpt is None:
                continue
            for old, new in set_aside_checkpoints_after(ckpt.root, step):
                log.warning("checkpoints: resumed from checkpoint.load_path=%s (step %d), so %s "
                            "belongs to an abandoned continuation of this run; moved it to %s "
                            "(never loaded from there; delete it when no longer needed)",
                            load_path, step, old, new)
        os.makedirs(self.root, exist_ok=True)
        write_json_atomic(os.path.join(self.root, CONSUMED),
                          {"load_path": os.path.realpath(load_path), "step": step})

    def resume(self, ckpt_cfg, actor, critic, check=None) -> Optional[dict]:
        """Load the checkpoint to resume from into the roles; return the trainer state (None:
        a fresh start). check(actor checkpoint path), when given, runs before any of its
        weights are read and may refuse it by raising (config/resume.py: a config that cannot
        resume from it)."""
        load_path = ckpt_cfg.load_path
        if load_path:
            consumed = self._consumed_step(load_path)
            if consumed is not None and ckpt_cfg.resume == "auto":
                loaded = self._load_newest(actor, critic, check, after=consumed)
                if loaded is not None:
                    log.info("checkpoint.load_path=%s was resumed from (step %d) by an earlier "
                             "start of this run (%s); continued from the run's newest checkpoint "
                             "%s (step %d) instead. Pass another load_path to go back again.",
                             load_path, consumed, os.path.join(self.root, CONSUMED), loaded.path,
                             loaded.step)
                    return loaded.extra_state
            loaded = self._load_from_load_path(load_path, actor, critic, check)
            # Only now: every rank has chosen (the load is collective) and the load succeeded.
            if dist.get_rank() == 0:
                self._consume(load_path, loaded.step)
            dist.barrier()
        elif ckpt_cfg.resume == "never":
            return None
        else:
            loaded = self._load_newest(actor, critic, check)
            if loaded is None:
                return None
        log.info("loaded checkpoint %s (step %d)", loaded.path, loaded.step)
        return loaded.extra_state

    def latest_path(self) -> Optional[str]:
        return find_latest_checkpoint(self.actor.root)

    def close(self) -> None:
        """Wait for and commit the async saves in flight."""
        try:
            for ckpt in self._roles():
                ckpt.close()
        except (Exception, CheckpointException) as e:
            self._failed(e, "the last asynchronous checkpoint")
