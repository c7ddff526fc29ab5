"""Checkpoint and resume: model, optimizer, LR schedule, RNG and trainer state, at any layout.

On disk, under one root directory shared by all ranks:

    root/
      latest                    "step_00000012\\n", rewritten (atomically) after each commit
      step_00000010/            a complete checkpoint
        dist/                   megatron-core dist_checkpointing: model + optimizer, sharded by
                                global tensor, so it loads at another TP / PP / DP layout
                                (tested: TP2·DP1 -> TP1·DP2 and -> PP2; VPP is not tested)
          hf_config/            actor: the HF config and tokenizer files the run started from
                                (the trainer's extra files), as hf-to-mcore stores them, so
                                mcore-to-hf needs only --ckpt and --out
        config.yaml, model_arch.json  actor: the run's resolved config and model architecture
        trainer_state.pt        LR scheduler + the caller's trainer state (step, data position,
                                KL controller, ...), written by rank 0
        rng/rank_00000.pt       each rank's RNG states (utils/rng.py)
        meta.json               step, layout, format
        manifest.json           size and SHA-256 of every other file (utils/manifest.py);
                                written last, before the rename
      step_00000012/
      .tmp.step_00000014/       a save in progress, or one killed part-way: never loaded
      abandoned.step_00000015/  a checkpoint later than a step resumed from with load_path, or
                                the other role's half of a corrupt step: never loaded or rotated
      corrupt.step_00000016/    a checkpoint that failed its checks at resume: never loaded or
                                rotated; kept for inspection (load_newest)

Commit protocol (why a killed save never hides the previous checkpoint): every rank writes into
`.tmp.step_N/`; after a barrier rank 0 writes meta.json, the ranks hash the files they wrote and
rank 0 writes manifest.json, renames the directory to `step_N/` (one atomic rename), then
rewrites `latest` (write to a temporary name + rename), then deletes the checkpoints beyond
keep_last. A kill at any point leaves either no `step_N/` (the previous one is still complete
and `latest` still names it) or a complete `step_N/`. Every file is fsynced before the rename
publishes it, and the directory after it (a machine crash keeps the same guarantee). A failure
on any rank (a full disk) raises on every rank; the `.tmp.step_N/` it leaves is removed by
RunCheckpoints, and at the next start, by whoever holds the run-directory lock.

Loading trusts nothing in the directory (it may be someone else's, or damaged): every file is
read as data (utils/safe_read.py: allow-listed unpickling of DCP's `.metadata`, weights_only for
every torch.load), and verify_checkpoint checks the manifest, in parallel across ranks, before any
tensor is read. A resume (load_newest) sets a checkpoint that fails aside and falls back to the
newest good one; an explicit path that fails is refused. Checkpoints saved before manifests
existed load with a warning: the checks that need no manifest (meta and DCP metadata readable
and safe, no file shorter than its entries, trainer state plain data) still apply, but altered
bytes inside a file go unnoticed.

Model and optimizer use dist_checkpointing: each chunk's `sharded_state_dict()` and the optimizer's
`sharded_state_dict(model_sd)`. The distributed optimizer's format (`optimizer_sharding`):
  "fully_reshardable" (default): the optimizer state is gathered across DP and written in each
      parameter's global shape, like the model; it loads at any TP / PP / DP layout. Costs a DP
      all-gather of the state at save (host memory on every rank: its TP×PP shard of the state).
  "dp_reshardable": each rank writes its own flat buffer shards, no communication; it loads only
      at the same TP × PP (megatron documents DP changes as supported; tested here only at the
      same layout). For frequent saves of large models.
('fully_sharded_model_space', megatron's default, fails in megatron-core 0.16.1 with
"ShardedTensor.flattened_range is not supported".) The format is recorded in meta.json and the
loader follows it.

RNG states are restored only when the layout (world size, TP, PP, VPP, CP, EP, and for a role
on a set of its own its ranks) is unchanged: a rank of another layout has no counterpart, so it
keeps the seeding the caller gave it.

Roles on sets of their own (placement): megatron's dist_checkpointing is collective over the
whole world and writes the common (non-sharded) state from global rank 0, so every rank takes
part in every role's save and load; the role's ranks (`role_ranks`, the set's global ranks in
order) pass their model chunks, the others none. The role's leader (its first rank) writes
trainer_state.pt, the extra files and meta.json, and hands its common state to the other ranks
before the save, so that rank 0's common.pt is the role's own: the files are those a colocated
save of the same layout writes, and a checkpoint loads under any placement (a role saved on
rank 2 at TP=1 loads colocated at TP=2 × DP=2, and the other way round).
"""
from __future__ import annotations

import contextlib

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist

from verl_mcore.config import ConfigError
from verl_mcore.distributed.agree import raised_on_every_rank
from verl_mcore.distributed.children import children_die_with_this_process, die_with_parent
from verl_mcore.engine import optim_step
from verl_mcore.utils import manifest
from verl_mcore.utils.doing import doing
from verl_mcore.utils.files import (
    fsync_path,
    torch_save_synced,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from verl_mcore.utils.rng import capture_rng_state, restore_rng_state
from verl_mcore.utils.safe_read import (
    BadCheckpointError,
    check_dist_dir,
    dist_load,
    read_json,
    torch_load,
)

logger = logging.getLogger(__name__)

FORMAT = 1
LATEST = "latest"
META = "meta.json"
TRAINER_STATE = "trainer_state.pt"
DIST_DIR = "dist"
RNG_DIR = "rng"
TMP_PREFIX = ".tmp."
ABANDONED_PREFIX = "abandoned."  # see set_aside_checkpoints_after
CORRUPT_PREFIX = "corrupt."  # see load_newest
_NAME = re.compile(r"^step_(\d+)$")
OPTIMIZER_SHARDINGS = ("fully_reshardable", "dp_reshardable")  # see the module docstring


@dataclasses.dataclass(frozen=True)
class RoleRanks:
    """The global ranks a role's checkpoint comes from, in order; None: every rank (colocated).
    Every rank of the world knows them (the placement), members or not."""

    ranks: Optional[tuple[int, ...]] = None

    @classmethod
    def of(cls, ranks: Optional[Sequence[int]]) -> "RoleRanks":
        if ranks is None or tuple(ranks) == tuple(range(dist.get_world_size())):
            return cls(None)
        return cls(tuple(ranks))

    @property
    def placed(self) -> bool:
        """The role lives on a subset of the world (or in another order)."""
        return self.ranks is not None

    @property
    def leader(self) -> int:
        return self.ranks[0] if self.placed else 0

    def has(self, rank: int) -> bool:
        return not self.placed or rank in self.ranks

    @property
    def size(self) -> int:
        return len(self.ranks) if self.placed else dist.get_world_size()


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


# ---------------------------------------------------------------- finding checkpoints


def is_complete(path: str) -> bool:
    """True when `path` holds a checkpoint whose commit finished (meta.json readable, this
    format, and the parts it lists present)."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return False
    # dist_checkpointing writes its metadata.json last (after all ranks' shards).
    required = [TRAINER_STATE, os.path.join(DIST_DIR, "metadata.json")]
    return all(os.path.exists(os.path.join(path, r)) for r in required)


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under root, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        match = _NAME.match(name)
        path = os.path.join(root, name)
        if match and is_complete(path):
            out.append((int(match.group(1)), path))
    return sorted(out)


def find_latest_checkpoint(root: str) -> Optional[str]:
    """The checkpoint to resume from: the one `latest` names if it is complete, else (with a
    warning) the complete checkpoint with the highest step; None when there is none.

    `latest` wins over a higher step number on purpose: after a resume from an older checkpoint
    (CheckpointConfig.load_path) the newest *written* checkpoint is the one to continue from.
    """
    pointer = os.path.join(root, LATEST)
    try:
        with open(pointer) as f:
            name = f.read().strip()
    except FileNotFoundError:
        name = None
    if name:
        path = os.path.join(root, name)
        if _NAME.match(name) and is_complete(path):
            return path
    candidates = list_checkpoints(root)
    if name:
        fallback = candidates[-1][1] if candidates else None
        logger.warning(
            "checkpoint: %s names %r, which is not a complete checkpoint; using %s",
            pointer, name, fallback,
        )
    return candidates[-1][1] if candidates else None


def set_aside_checkpoints_after(root: str, step: int) -> list[tuple[str, str]]:
    """Rename every `step_N` directory under root with N > step to `abandoned.step_N`; return
    the (old, new) paths. Rank 0 only.

    For a resume from `step` (CheckpointConfig.load_path): the later checkpoints belong to a
    branch of the run that was given up. Left in place they would outrank the new branch's
    checkpoints in rotation (which keeps the highest steps, so it would delete the one resumed
    from) and in find_latest_checkpoint's fallback. They are renamed, not deleted: they are the
    user's data. `latest`, if it named one of them, then names the newest checkpoint left.
    """
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    later = [n for n in names if (m := _NAME.match(n)) and int(m.group(1)) > step]
    return [_set_aside(os.path.join(root, name), ABANDONED_PREFIX) for name in later]


def _set_aside(path: str, prefix: str) -> tuple[str, str]:
    """Rename the checkpoint `path` to `prefix + its name` beside it (`.1`, `.2`, ... when a
    checkpoint of that step was set aside before), and repoint `latest` to the newest complete
    checkpoint left if it named this one (or none). Returns (old, new). Rank 0 only."""
    root, name = os.path.split(path)
    target = os.path.join(root, prefix + name)
    suffix = 1
    while os.path.exists(target):
        target = os.path.join(root, f"{prefix}{name}.{suffix}")
        suffix += 1
    os.rename(path, target)
    pointer = os.path.join(root, LATEST)
    try:
        with open(pointer) as f:
            pointed = f.read().strip()
    except FileNotFoundError:
        pointed = None
    # Also when it names no complete checkpoint (a renamed directory): it would dangle.
    if pointed is not None and (pointed == name or not (
            _NAME.match(pointed) and is_complete(os.path.join(root, pointed)))):
        remaining = list_checkpoints(root)
        if remaining:
            write_text_atomic(pointer, os.path.basename(remaining[-1][1]) + "\n")
        else:
            os.remove(pointer)
    fsync_path(root)
    return path, target


# ---------------------------------------------------------------- checking and choosing


def verify_checkpoint(path: str) -> None:
    """Check the complete checkpoint at `path` before any of its tensors is read; raise
    BadCheckpointError, the same on every rank, naming the file and the check that failed.
    Collective.

    First the manifest, if there is one (every checkpoint saved since they exist): every file's
    size and SHA-256, the files shared out across the ranks by size; without one a warning (see
    the module docstring). Then rank 0 reads meta.json, dist/ (safe_read.check_dist_dir: DCP
    metadata allow-listed, no .distcp shorter than its entries, common.pt plain data) and
    trainer_state.pt, as data.
    """
    if not is_complete(path):
        raise FileNotFoundError(
            f"checkpoint {path} is not complete (no readable {META}, or missing "
            f"{TRAINER_STATE} / {DIST_DIR}/metadata.json): pick another one or delete it"
        )
    rank, world = dist.get_rank(), dist.get_world_size()

    def check_manifest() -> None:  # first: nothing is parsed from a file the save did not write
        files = manifest.read_manifest(path)
        if files is not None:
            manifest.verify_share(path, files, rank, world)
            return
        meta = read_json(os.path.join(path, META))
        if isinstance(meta, dict) and meta.get("manifest"):
            raise BadCheckpointError(
                f"{os.path.join(path, manifest.MANIFEST)}: missing, though {META} says this "
                "checkpoint was saved with one: its files cannot be trusted")
        if rank == 0:
            logger.warning(
                "checkpoint %s has no %s (saved before checkpoints had one): the sizes and hashes "
                "of its files cannot be checked, so altered bytes inside a file would go "
                "unnoticed; loading it after the checks that need no manifest",
                path, manifest.MANIFEST)

    def check_contents() -> None:
        if rank != 0:
            return
        meta = read_json(os.path.join(path, META))
        if meta.get("format") != FORMAT or not isinstance(meta.get("step"), int) \
                or not isinstance(meta.get("layout"), dict) or "optimizer_sharding" not in meta:
            raise BadCheckpointError(f"{os.path.join(path, META)}: not a format-{FORMAT} "
                                     "checkpoint description")
        # The step is written twice by the save (directory name, meta.json) and a third time
        # in the trainer's state: a checkpoint whose copies disagree was altered or mixed up.
        named = _NAME.match(os.path.basename(os.path.normpath(path)))
        if named and int(named.group(1)) != meta["step"]:
            raise BadCheckpointError(f"{os.path.join(path, META)}: step {meta['step']}, but the "
                                     f"directory is named for step {int(named.group(1))}")
        check_dist_dir(os.path.join(path, DIST_DIR))
        state = torch_load(os.path.join(path, TRAINER_STATE))
        if not (isinstance(state, dict) and {"scheduler", "extra"} <= state.keys()):
            raise BadCheckpointError(f"{os.path.join(path, TRAINER_STATE)}: not a trainer state "
                                     "(expected keys 'scheduler' and 'extra')")
        extra = state["extra"]
        if isinstance(extra, dict) and "step" in extra and extra["step"] != meta["step"]:
            raise BadCheckpointError(f"{os.path.join(path, TRAINER_STATE)}: trainer step "
                                     f"{extra['step']!r}, but {META} says step {meta['step']}")

    manifest.on_every_rank(check_manifest)
    manifest.on_every_rank(check_contents)


T = TypeVar("T")


def load_newest(roots: Sequence[str], load: Callable[[int, str], T],
                after: Optional[int] = None) -> Optional[list[T]]:
    """Resume: [load(i, path) for each root i] at the newest step complete under every root whose
    checkpoints all pass verify_checkpoint. roots: one checkpoint root per role, paired by step
    (RunCheckpoints: actor, critic). Collective: rank 0 chooses the step, every rank checks and
    loads the same one.

    A step whose check fails, or whose load raises BadCheckpointError, is never used: the failing
    checkpoint is renamed corrupt.step_N, the other roles' of that step abandoned.step_N (never
    deleted), `latest` is repointed, a warning says what and why, and the next newest step is
    tried. Only steps > `after` count when given. Returns None when there is no step; raises
    BadCheckpointError listing what was set aside when there were steps but none was good
    (unless `after` is given: the caller then has a fallback of its own).
    """
    set_aside: list[str] = []
    while True:
        step = _on_rank0(lambda: _newest_common_step(roots))
        if step is None or (after is not None and step <= after):
            if set_aside and after is None:
                raise BadCheckpointError(
                    f"checkpoint: no usable checkpoint left under {', '.join(roots)}; set aside: "
                    + "; ".join(set_aside) + ". Inspect or delete them; to start from scratch "
                    "use another run directory or checkpoint.resume=never")
            return None
        paths = [os.path.join(root, checkpoint_name(step)) for root in roots]
        try:
            for path in paths:  # all roles first: a bad critic must not cost an actor load
                failing = path
                verify_checkpoint(path)
            results = []
            for i, path in enumerate(paths):
                failing = path
                with doing(f"loading the checkpoint {path}"):
                    results.append(load(i, path))
            if set_aside and dist.get_rank() == 0:
                logger.warning("checkpoint: resumed from step %d, the newest good checkpoint",
                               step)
            return results
        except BadCheckpointError as e:
            reason = str(e)
        set_aside.append(f"{failing}: {reason}")
        if dist.get_rank() == 0:
            for path in paths:
                prefix = CORRUPT_PREFIX if path == failing else ABANDONED_PREFIX
                if os.path.isdir(path):
                    old, new = _set_aside(path, prefix)
                    why = (f"failed its check: {reason}" if path == failing
                           else f"its step's {failing} is corrupt, so this step is not used")
                    logger.warning("checkpoint: %s %s; moved it to %s (never loaded from there; "
                                   "delete it when no longer needed) and falling back to the "
                                   "previous checkpoint", old, why, new)
        dist.barrier()


def _newest_common_step(roots: Sequence[str]) -> Optional[int]:
    """The step to resume from: the one `latest` of the first root names (see
    find_latest_checkpoint) when every root has it complete, else the newest step complete
    under every root; None when there is none."""
    latest = find_latest_checkpoint(roots[0])
    if latest is None:
        return None
    steps = [dict(list_checkpoints(root)) for root in roots]
    latest_step = next(s for s, p in steps[0].items() if os.path.samefile(p, latest))
    if all(latest_step in s for s in steps[1:]):
        return latest_step
    common = sorted(set(steps[0]).intersection(*steps[1:]))
    if not common:
        # Not a kill between the roles' saves (rotation keeps the newest common step): the run
        # had no such role (a GRPO run resumed with adv_estimator=gae), its checkpoints were
        # removed, or an older verl_mcore rotated the common step away (keep_last=1, killed
        # between the roles' commits). Starting fresh would train the actor from scratch over
        # the run's checkpoints and metrics.

        missing = [(root, sorted(s)) for root, s in zip(roots[1:], steps[1:])
                   if not set(steps[0]) & set(s)]
        if all(not s for _, s in missing):
            raise ConfigError(
                f"checkpoint: {roots[0]} has steps {sorted(steps[0])} but "
                f"{', '.join(root for root, _ in missing)} has none: this run was not trained "
                "with that role (algorithm.adv_estimator changed to gae?) or its checkpoints "
                "were removed. Refused, to keep the run's checkpoints and metrics: resume with "
                "the config the run had, or start a new trainer.run_dir")
        raise ConfigError(
            f"checkpoint: {roots[0]} has steps {sorted(steps[0])} but "
            + ", ".join(f"{root} has steps {s}" for root, s in missing)
            + ": no step has a checkpoint of every role, so none can be resumed (a save killed "
            "between the roles' commits after the older common step was rotated away, which "
            "earlier versions of verl_mcore did with checkpoint.keep_last=1, or checkpoints "
            "removed by hand). Refused, to keep the run's checkpoints: put back a matching pair "
            "of step directories, or start a new trainer.run_dir")
    logger.warning("checkpoints: %s has no step %d (killed between the saves of the roles?); "
                   "resuming every role from step %d", ", ".join(roots[1:]), latest_step,
                   common[-1])
    return common[-1]


def _on_rank0(fn: Callable[[], T]) -> T:
    """fn() computed on rank 0 (file reads that ranks could see differently on a network file
    system, e.g. just after rank 0 renamed a directory), the same value on every rank; an error
    on rank 0 is raised on every rank. Collective."""
    return _on_rank(fn, 0, "choose a checkpoint")


def _on_rank(fn: Callable[[], T], src: int, what: str) -> T:
    """fn() computed on rank `src`, the same value on every rank; an error there is raised on
    every rank (RuntimeError naming the rank and `what` it could not do; a ConfigError as it
    is). Collective over the world."""
    if dist.get_world_size() == 1:
        return fn()

    box: list = [None]
    if dist.get_rank() == src:
        try:
            box = [(fn(), None, False)]
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            box = [(None, f"{type(e).__name__}: {e}" if not isinstance(e, ConfigError) else str(e),
                    isinstance(e, ConfigError))]
    dist.broadcast_object_list(box, src=src)
    value, error, refused = box[0]
    if refused:  # a refusal the user acts on (train.py prints it and exits 2)
        raise ConfigError(error)
    if error is not None:
        raise RuntimeError(f"checkpoint: rank {src} could not {what}: {error}")
    return value


# ---------------------------------------------------------------- save


@dataclasses.dataclass
class _PendingSave:
    step: int
    tmp: str
    final: str


class Checkpointer:
    """Saves and loads checkpoints under one root directory (see the module docstring).

        ckpt = Checkpointer(root, keep_last=2, async_save=False)
        ckpt.save(step, engine.model, engine.optimizer, engine.scheduler, {"step": step, ...})
        ...
        ckpt.maybe_finalize()                # async only: commits saves whose writes finished
        loaded = ckpt.load(engine.model, engine.optimizer, engine.scheduler)   # newest or None
        ckpt.close()                         # async only: waits for and commits pending saves

    Every method is collective: all ranks of the world call it with the same root and step.
    model_chunks: the megatron model chunks (DDP-wrapped or not; one per virtual pipeline stage).
    optimizer: a MegatronOptimizer (distributed or not, possibly chained) or None.
    scheduler: an OptimizerParamScheduler or None.
    role_ranks: the role's global ranks when it lives on a set of its own (None: every rank).
        The ranks outside it pass model_chunks=[] (optimizer, scheduler, extra_state None) and
        only take part in the collectives; `load` returns the same LoadedCheckpoint everywhere.
    """

    def __init__(
        self,
        root: str,
        keep_last: int = 2,
        async_save: bool = False,
        save_optimizer: bool = True,
        optimizer_sharding: str = "fully_reshardable",
        role_ranks: Optional[Sequence[int]] = None,
        base_weights: Optional[str] = None,
    ):
        """base_weights: where the frozen base of a LoRA model comes from (the HF directory or
        dist checkpoint the run loads), recorded in the meta of its adapter-only checkpoints."""
        if optimizer_sharding not in OPTIMIZER_SHARDINGS:
            raise ValueError(
                f"Checkpointer: optimizer_sharding={optimizer_sharding!r}, expected one of "
                f"{OPTIMIZER_SHARDINGS}"
            )
        self.optimizer_sharding = optimizer_sharding
        self.role = RoleRanks.of(role_ranks)
        self.root = root
        self.keep_last = keep_last
        self.async_save = async_save
        self.save_optimizer = save_optimizer
        self.base_weights = base_weights
        self._fingerprint: Any = _UNSET  # of base_weights, once a LoRA save needs it
        # The roots whose checkpoints of one step together make one resume point; rotation
        # keeps the newest steps complete under all of them (RunCheckpoints: actor and critic).
        self.step_roots: list[str] = [root]
        self._async_queue = None
        self._write_results = None  # this checkpointer's queue for megatron's write results

    @classmethod
    def from_config(cls, cfg, root: str, role_ranks: Optional[Sequence[int]] = None
                    ) -> "Checkpointer":
        """From a config.schema.CheckpointConfig."""
        return cls(root, keep_last=cfg.keep_last, async_save=cfg.async_save,
                   save_optimizer=cfg.save_optimizer, role_ranks=role_ranks)

    def save(
        self,
        step: int,
        model_chunks: Sequence[torch.nn.Module],
        optimizer: Any = None,
        scheduler: Any = None,
        extra_state: Optional[dict] = None,
        extra_files: Optional[dict[str, Union[str, bytes]]] = None,
    ) -> str:
        """Write the checkpoint of `step`; return the path it has (or will have, async) when
        committed. extra_state: the trainer's own state, any nesting of dicts / lists / tuples /
        str / int / float / bool / None / tensors; the role leader's copy is written (rank 0's
        when colocated). extra_files: {relative path: text or bytes} written by the leader into
        the checkpoint directory (the run's config, and under dist/hf_config/ the HF config and
        tokenizer files the run started from).

        A failure on any rank raises on every rank, and leaves the previous checkpoints as they
        were (the temporary directory is not removed here: RunCheckpoints does it)."""
        from megatron.core import dist_checkpointing

        self._own_write_results()
        rank = dist.get_rank()
        final = os.path.join(self.root, checkpoint_name(step))
        tmp = os.path.join(self.root, TMP_PREFIX + checkpoint_name(step))
        if self.async_save:
            # One save in flight at a time: the previous one must commit before this one starts
            # (rotation and `latest` assume commits happen in step order).
            self.maybe_finalize(blocking=True)
        with raised_on_every_rank(f"creating {tmp}"):  # also the barrier before the writes
            if rank == 0:
                if os.path.exists(tmp):
                    shutil.rmtree(tmp)  # a killed earlier attempt at the same step
                os.makedirs(os.path.join(tmp, DIST_DIR))
                os.makedirs(os.path.join(tmp, RNG_DIR))

        member, leader = self.role.has(rank), rank == self.role.leader
        has_optimizer = optimizer is not None and self.save_optimizer
        # Before the first optimizer step (PPO's actor during critic warmup) torch's Adam has no
        # state, which megatron cannot save: save the state Adam's first step would start from,
        # then drop it again so that step initialises Adam exactly as in a run that never saved.
        placeholders = _allocate_optimizer_state(optimizer) if has_optimizer else []
        try:
            sharded = None
            # Everywhere, before megatron's collectives: a role's ranks that cannot describe
            # their state must not leave the others waiting in them.
            with raised_on_every_rank(f"building the state of {tmp}"):
                if member:
                    sharded = _sharded_state_dict(
                        model_chunks, optimizer if has_optimizer else None,
                        self.optimizer_sharding, is_loading=False)
            if self.role.placed:
                sharded = _with_leaders_common_state(sharded, self.role.leader)
            request = dist_checkpointing.save(
                sharded,
                os.path.join(tmp, DIST_DIR),
                sharded_strategy=_save_strategy(model_chunks, self.role),
                async_sharded_save=self.async_save,
                content_metadata={"verl_mcore_format": FORMAT},
            )
        finally:
            for states, param in placeholders:
                del states[param]
        # Synced: the commit's rename must not publish files still in the page cache.
        with raised_on_every_rank(f"writing {tmp}"):
            if member:
                torch_save_synced(capture_rng_state(),
                                  os.path.join(tmp, RNG_DIR, f"rank_{rank:05d}.pt"))
            if leader:
                torch_save_synced(
                    {
                        "scheduler": scheduler.state_dict() if scheduler is not None else None,
                        "extra": extra_state,
                    },
                    os.path.join(tmp, TRAINER_STATE),
                )
                for name, content in (extra_files or {}).items():
                    path = os.path.join(tmp, name)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    write_bytes_atomic(path, content.encode() if isinstance(content, str) else content)
        pending = _PendingSave(step, tmp, final)
        meta = _meta(step, _layout(model_chunks, self.role),
                     self.optimizer_sharding if has_optimizer else None) if leader else None
        if meta is not None and _trainable_only(model_chunks):
            meta["trainable_only"] = True
            meta["base_weights"] = self.base_weights
            meta["base_fingerprint"] = self._base_fingerprint()
        if request is None:
            self._commit(pending, meta)
        else:
            request.add_finalize_fn(lambda: self._commit(pending, meta))
            self._queue().schedule_async_request(request)
        return final

    def maybe_finalize(self, blocking: bool = False) -> None:
        """Async saves: commit every save whose writes have finished on all ranks (all of them
        when blocking). Collective; call it at the same point of every step on every rank."""
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        """Wait for and commit pending async saves."""
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=True)
            self._async_queue.close()
            self._async_queue = None

    def _queue(self):
        if self._async_queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_queue = AsyncCallsQueue()
        return self._async_queue

    def _own_write_results(self) -> None:
        """Give megatron's writer this checkpointer's own write-results queue for the save.

        megatron collects every save's write results through one process-wide queue (a module
        global, filesystem_async._results_queue, read with get_nowait), so two async saves in
        flight at once, PPO's critic and actor at the same step, took each other's results: the
        actor's .metadata pointed at the critic's file offsets and no resume could load it. The
        writer takes the queue when the save is prepared, so setting the global to ours first
        gives each save its own, and both roles' writes still overlap training and each other.
        The queues live in a Manager that dies with this process (`_write_results_queue`).
        Should megatron rename the global, nothing is replaced and the two-role async test
        (tests/engine/test_checkpoint_layouts.py) fails."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if not hasattr(filesystem_async, "_results_queue"):
            return
        if self._write_results is None:
            self._write_results = _write_results_queue()
        filesystem_async._results_queue = self._write_results

    def _commit(self, pending: _PendingSave, meta: Optional[dict]) -> None:
        """Make a fully written temporary directory the newest checkpoint (the role's leader
        writes meta.json, rank 0 does the other file operations; the barrier and the final
        agreement keep every rank's view consistent, and a failure of either raises on every
        rank)."""
        dist.barrier()  # every rank's files are in pending.tmp
        with raised_on_every_rank(f"committing {pending.final}"):
            if dist.get_rank() == self.role.leader:
                write_json_atomic(os.path.join(pending.tmp, META), meta)
        files = manifest.gather_manifest(pending.tmp)  # each rank hashes the files it wrote
        with raised_on_every_rank(f"committing {pending.final}"):
            if dist.get_rank() == 0:
                self._commit_files(pending, files)

    def _commit_files(self, pending: _PendingSave, files: dict) -> None:
        write_json_atomic(os.path.join(pending.tmp, manifest.MANIFEST), files)
        _sync_before_rename(pending.tmp)
        displaced = None
        if os.path.exists(pending.final):
            # Same step written again (e.g. PPO resumed from an older step because the
            # critic lacked the newest): move the old one aside first, since a rename cannot
            # replace a non-empty directory.
            displaced = pending.final + f".replaced.{os.getpid()}.{time.time_ns()}"
            os.rename(pending.final, displaced)
        os.rename(pending.tmp, pending.final)
        write_text_atomic(os.path.join(self.root, LATEST), os.path.basename(pending.final) + "\n")
        if displaced is not None:
            shutil.rmtree(displaced, ignore_errors=True)
        _rotate(self.step_roots, self.keep_last, pending.step)

    # ---------------------------------------------------------------- load

    def load(
        self,
        model_chunks: Sequence[torch.nn.Module],
        optimizer: Any = None,
        scheduler: Any = None,
        path: Optional[str] = None,
    ) -> Optional["LoadedCheckpoint"]:
        """Load `path` (refused with BadCheckpointError if it fails its checks), or when path is
        None the newest good checkpoint under root (load_newest: bad ones are set aside); return
        None (and change nothing) when there is none. See load_checkpoint."""
        if path is not None:
            return load_checkpoint(path, model_chunks, optimizer, scheduler,
                                   role_ranks=self.role.ranks, base_weights=self.base_weights)
        loaded = load_newest([self.root], lambda _, p: load_checkpoint(
            p, model_chunks, optimizer, scheduler, verified=True, role_ranks=self.role.ranks,
            base_weights=self.base_weights))
        return loaded[0] if loaded else None

    def _base_fingerprint(self) -> Optional[str]:
        """weights_fingerprint of base_weights (a directory), computed once: recorded with a LoRA
        role's adapters, so a resume can tell model.path still holds that base."""
        if self._fingerprint is _UNSET:
            self._fingerprint = (manifest.weights_fingerprint(self.base_weights)
                                 if self.base_weights and os.path.isdir(self.base_weights) else None)
        return self._fingerprint


@dataclasses.dataclass
class LoadedCheckpoint:
    path: str
    step: int
    extra_state: Any  # what the caller passed to save() as extra_state
    rng_restored: bool  # False when the layout changed (RNG left as the caller seeded it)
    optimizer_restored: bool


_UNSET = object()


def load_checkpoint(
    path: str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any = None,
    scheduler: Any = None,
    verified: bool = False,
    role_ranks: Optional[Sequence[int]] = None,
    base_weights: Optional[str] = None,
) -> LoadedCheckpoint:
    """Load a complete checkpoint into models built at the current layout (which may differ from
    the saved one: dist_checkpointing reads each rank's slices). Collective.

    It is first checked with verify_checkpoint (skipped when `verified`: the caller has just done
    it, as load_newest does for all roles of a step before loading any); a failure raises
    BadCheckpointError naming the file and the check, before anything is loaded.
    The optimizer state is loaded when the checkpoint has it and `optimizer` is given; otherwise
    the optimizer's main parameters are refreshed from the loaded model parameters.
    role_ranks: see Checkpointer; ranks outside the role pass no chunks and get the same
    LoadedCheckpoint (the role leader's view of the layout and the optimizer).
    base_weights: the base this run's LoRA model was built from (Checkpointer.base_weights);
    an adapter-only checkpoint recorded on another base's weights (weights_fingerprint) is
    refused with ValueError before anything is loaded.
    """
    if not verified:
        verify_checkpoint(path)
    role = RoleRanks.of(role_ranks)
    member = role.has(dist.get_rank())
    meta = read_json(os.path.join(path, META))
    trainer_state = torch_load(os.path.join(path, TRAINER_STATE))
    with_optimizer = optimizer is not None and meta["optimizer_sharding"] is not None
    # Not a BadCheckpointError: the checkpoint is sound, the config does not fit it, and
    # load_newest must not set it aside for an older one.
    with raised_on_every_rank(f"matching {path} to the model", error_type=ValueError):
        saved_trainable_only = bool(meta.get("trainable_only"))
        if member and model_chunks and _trainable_only(model_chunks) != saved_trainable_only:
            raise ValueError(
                f"checkpoint {path}: it holds "
                + ("only the trainable tensors of a model with a frozen base (LoRA adapters, "
                   f"base {meta.get('base_weights')}); enable the role's lora to resume it"
                   if saved_trainable_only else
                   "every weight of a fully trained model, but this model trains LoRA adapters "
                   "on a frozen base; resume it without lora, or start the adapters fresh")
                + " (convert_hf exports either)")
        saved_base = meta.get("base_fingerprint")
        if (member and saved_trainable_only and saved_base and base_weights
                and os.path.isdir(base_weights)
                and manifest.weights_fingerprint(base_weights) != saved_base):
            raise ValueError(
                f"checkpoint {path}: its LoRA adapters were trained on the base "
                f"{meta.get('base_weights')}, and {base_weights} (model.path, or model.checkpoint) "
                f"holds other weights now (weights_fingerprint differs): the adapters would train "
                f"on another model. Point model.path at the base the run started from, or start "
                f"the adapters fresh in a new trainer.run_dir")
    if with_optimizer:
        _allocate_optimizer_state(optimizer)
    # The other roles' ranks read nothing, but take part (the load is collective).
    sharded = _sharded_state_dict(model_chunks, optimizer if with_optimizer else None,
                                  meta["optimizer_sharding"], is_loading=True) if member else {}
    state = dist_load(sharded, os.path.join(path, DIST_DIR))
    for i, chunk in enumerate(model_chunks):
        _load_model_state(_unwrap(chunk), state[f"model{i}"], path, meta)
    if with_optimizer:
        _load_optimizer(optimizer, state["optimizer"])
        optim_step.prefer_fused_adam(optimizer)  # the load put back the saved `fused` flags
    elif optimizer is not None:
        optimizer.reload_model_params()  # main (fp32) params := the loaded model params
    if scheduler is not None:
        if trainer_state["scheduler"] is None:
            raise ValueError(f"checkpoint {path} has no LR scheduler state")
        # megatron's load_state_dict advances num_steps *by* the saved count (it expects a
        # fresh scheduler): one that already stepped (a load_newest fallback after a role was
        # loaded, a second load in one process) would end up past the checkpoint.
        scheduler.num_steps = 0
        scheduler.load_state_dict(trainer_state["scheduler"])

    # Colocated, every rank knows the layout; placed, the leader does and tells the rest.
    layout = _layout(model_chunks, role) if member and model_chunks else None
    rng_restored = meta["layout"] == layout
    if role.placed:  # the leader's view, on every rank
        rng_restored, with_optimizer = _on_rank(lambda: (rng_restored, with_optimizer),
                                                role.leader, "compare the layouts")
    if rng_restored:
        rank_file = os.path.join(path, RNG_DIR, f"rank_{dist.get_rank():05d}.pt")
        # Each rank reads its own file: a failure on one rank is raised on all (no hang).
        states = manifest.on_every_rank(lambda: torch_load(rank_file) if member else None)
        if member:
            restore_rng_state(states)
    elif dist.get_rank() == role.leader:
        logger.warning(
            "checkpoint %s: saved at layout %s, running at %s; RNG states not restored",
            path, meta["layout"], layout,
        )
    dist.barrier()
    return LoadedCheckpoint(path, meta["step"], trainer_state["extra"], rng_restored,
                            with_optimizer)


# ---------------------------------------------------------------- internals


def _load_model_state(model: torch.nn.Module, state: dict, path: str, meta: dict) -> None:
    """Every saved tensor into `model`; a model with a frozen base (LoRA) takes its trainable
    tensors only and keeps the base it was built with."""
    frozen = frozen_names(model)
    if not frozen:
        model.load_state_dict(state, strict=True)
        return
    result = model.load_state_dict(state, strict=False)
    missing = {k for k in result.missing_keys if not k.endswith("._extra_state")} - frozen
    if missing or result.unexpected_keys:
        raise BadCheckpointError(f"checkpoint {path}: its tensors are not this model's trainable "
                                 f"ones (missing {sorted(missing)[:4]}, unexpected "
                                 f"{sorted(result.unexpected_keys)[:4]})")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers (the wrappers would add a
    'module.' prefix to every key, tying checkpoints to the wrapping)."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (_BaseDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def _sharded_state_dict(model_chunks, optimizer, optimizer_sharding, is_loading: bool) -> dict:
    """{"model0": ..., "model1": ..., "optimizer": ...}. The keys inside are global tensor names
    (layer numbers offset by pipeline stage), so the dict nesting does not tie a checkpoint to a
    number of chunks."""
    for chunk in model_chunks:
        _check_layout_matches(_unwrap(chunk))
    # The model's own data-parallel group for its replica ids: megatron's default reads
    # parallel_state, which a role set of its own does not initialise.
    model_sd = {}
    for i, c in enumerate(model_chunks):
        with _data_parallel_rank_of(c):
            model_sd[f"model{i}"] = _trainable_entries(
                _unwrap(c), _unwrap(c).sharded_state_dict(metadata=_replica_metadata(c)))
    sharded = dict(model_sd)
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(
            model_sd,
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": optimizer_sharding},
        )
        if not is_loading:
            sharded["optimizer"] = _common_tensors_to_cpu(sharded["optimizer"])
    return sharded


def _trainable_only(model_chunks) -> bool:
    return any(frozen_names(_unwrap(c)) for c in model_chunks)


def frozen_names(model: torch.nn.Module) -> set[str]:
    """Names of the frozen parameters of a model that also trains some (LoRA: the base), else
    the empty set: a forward-only model (every parameter frozen) saves everything."""
    params = dict(model.named_parameters())
    frozen = {n for n, p in params.items() if not p.requires_grad}
    return frozen if len(frozen) < len(params) else set()


def _trainable_entries(model: torch.nn.Module, sd: dict) -> dict:
    """The checkpoint entries of a model with frozen parameters: the trainable ones only. The
    frozen base (LoRA) is not duplicated into every checkpoint; it comes back from the weights
    the run starts from (meta.json's base_weights says which)."""
    frozen = frozen_names(model)
    if not frozen:
        return sd
    kept = {k: v for k, v in sd.items() if k not in frozen and not k.endswith("._extra_state")}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if not trainable <= set(kept):
        raise RuntimeError(f"checkpoint: trainable parameters missing from the model's "
                           f"sharded state dict: {sorted(trainable - set(kept))[:4]}")
    return {k: kept[k] for k in kept if k in trainable}


def _common_tensors_to_cpu(tree):
    """Plain tensors in a sharded state dict are common state that dist_checkpointing pickles and
    broadcasts from rank 0 (its save-time validation); a GPU tensor there unpickles onto rank 0's
    device index on every rank, which opens a CUDA context on that GPU from each process of the
    node. The fused Adam keeps its `step` on the GPU, and megatron's non-distributed optimizer
    saves one as `common_step`. Sharded tensors (not torch.Tensor) are left alone."""
    if isinstance(tree, dict | list):  # in place: the containers stay the ones megatron built
        for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
            tree[k] = _common_tensors_to_cpu(v)
        return tree
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_common_tensors_to_cpu(v) for v in tree)
    if isinstance(tree, torch.Tensor) and tree.device.type != "cpu":
        return tree.detach().cpu()
    return tree


@contextlib.contextmanager
def _data_parallel_rank_of(chunk: torch.nn.Module):
    """megatron's data-parallel rank set to the chunk's own (its DP × CP group) while its state
    dict is built, where parallel_state is not initialised (a role set of its own): the tied
    output layer of a last pipeline stage takes its replica id from
    parallel_state.get_data_parallel_rank (LanguageModule.tie_embeddings_and_output_weights_
    state_dict), which would otherwise raise."""
    from megatron.core import parallel_state

    pg = getattr(_unwrap(chunk), "pg_collection", None)
    if parallel_state.model_parallel_is_initialized() or pg is None or not hasattr(pg, "dp_cp"):
        yield
        return
    parallel_state.set_data_parallel_rank(pg.dp_cp.rank())
    try:
        yield
    finally:
        parallel_state.set_data_parallel_rank(None)


def _replica_metadata(chunk: torch.nn.Module) -> Optional[dict]:
    pg = getattr(_unwrap(chunk), "pg_collection", None)
    return {"dp_cp_group": pg.dp_cp} if pg is not None and hasattr(pg, "dp_cp") else None


def _check_layout_matches(model: torch.nn.Module) -> None:
    """Fail on every rank when the model was built for another layout than its process groups'.

    A PP=2 run whose TransformerConfig still says pipeline_model_parallel_size=1 builds every layer
    on every stage; dist_checkpointing then sees each layer claimed twice and raises "Invalid
    access pattern" on rank 0 only, while the other ranks wait in the next collective (a hang).
    """
    config = getattr(model, "config", None)
    pg = getattr(model, "pg_collection", None)
    if config is None or pg is None:
        return
    expected = {
        "tensor_model_parallel_size": pg.tp.size(),
        "pipeline_model_parallel_size": pg.pp.size(),
    }
    wrong = {k: (getattr(config, k), v) for k, v in expected.items() if getattr(config, k) != v}
    if wrong:
        detail = ", ".join(
            f"config.{k}={c} but its process groups have {p}" for k, (c, p) in wrong.items()
        )
        raise ValueError(
            f"checkpoint: rank {dist.get_rank()}: the model was built for another layout "
            f"({detail}); build it with a TransformerConfig of the current layout"
        )


def _allocate_optimizer_state(optimizer: Any) -> list[tuple[dict, torch.Tensor]]:
    """Give a torch Adam that has not stepped yet the state its first step would start from
    (step 0, zero moments); return (optimizer state, parameter) of every entry made here.

    Without TransformerEngine / apex (CPU, and our GPU image) megatron wraps torch.optim.Adam,
    whose state appears only at the first step, and DistributedOptimizer.state_dict() reads the
    common 'step' out of that state (megatron-core 0.16.1 asserts on an empty one), on save and
    on load. A load overwrites every value; a save writes them and then removes them again.
    An Adam that has stepped is left alone (a step-0 entry beside step-N ones would break that
    same assertion).
    """
    filled = []
    for opt in optim_step.sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or any(inner.state.values()):
            continue
        for group in inner.param_groups:
            moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
            for p in group["params"]:
                state = inner.state[p]
                state["step"] = torch.tensor(0.0)
                for name in moments:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                filled.append((inner.state, p))
    return filled


def _load_optimizer(optimizer: Any, state: dict) -> None:
    """optimizer.load_state_dict(state), working around three megatron-core 0.16.1 bugs of the
    distributed optimizer over torch.optim.Adam (no TransformerEngine / apex):

    1. Its load_state_dict gives every parameter's state the *same* 'step' tensor, and torch's
       Adam increments each parameter's step in place: after a resume the shared counter advances
       once per parameter per step and the bias correction is wrong (the losses drift from an
       uninterrupted run). Each parameter gets its own copy here.
    2. load_parameter_state_from_fully_reshardable copies every key of the live state, 'step'
       included, from the loaded tensors, which have no 'step' (KeyError: 'step'). The steps are
       set aside while the parameter state loads.
    3. load_parameter_state_from_dp_reshardable copies in place into the main params without
       torch.no_grad(); with fp32 parameters those are views of leaf parameters that require
       grad, and autograd refuses ("a view of a leaf Variable ... in-place operation").
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        parts = [(optimizer, state)]
    elif len(chained) == 1:
        parts = [(chained[0], state)]  # ChainedOptimizer saves a single optimizer unnested
    else:
        parts = list(zip(chained, (v for _, v in sorted(state.items()))))
    for opt, opt_state in parts:
        inner = getattr(opt, "optimizer", None)
        plain_adam = isinstance(inner, torch.optim.Adam | torch.optim.AdamW)
        affected = isinstance(opt, DistributedOptimizer) and plain_adam
        if not (affected and "param_state" in opt_state):
            opt.load_state_dict(opt_state)
            continue
        opt_state = dict(opt_state)
        param_state = opt_state.pop("param_state")
        sharding = opt_state.pop("param_state_sharding_type")
        opt.load_state_dict(opt_state)  # param groups, common step, grad scaler
        steps = {p: st.pop("step").clone() for p, st in inner.state.items() if "step" in st}
        try:
            loaders = {
                "fully_reshardable": opt.load_parameter_state_from_fully_reshardable,
                "dp_reshardable": opt.load_parameter_state_from_dp_reshardable,
            }
            if sharding not in loaders:
                raise ValueError(f"checkpoint: optimizer state in unsupported format {sharding!r}")
            with torch.no_grad():  # fp32 training: main params are views of leaf parameters
                loaders[sharding](param_state)
        finally:
            for p, step in steps.items():
                inner.state[p]["step"] = step


_WRITE_RESULTS_MANAGER: list = []  # the process's one Manager, once started


def _write_results_queue():
    """A new queue in a multiprocessing Manager whose server process dies with this one.

    megatron's writer would start that Manager itself (spawn context) on first use, and a
    SIGKILLed trainer left it and the forked writer behind, two processes a kill
    (distributed/children.py). Ours is started with an initializer that ties it to us, and the
    writer's forks inherit the fork hook."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    children_die_with_this_process()
    if not _WRITE_RESULTS_MANAGER:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        _WRITE_RESULTS_MANAGER.append(manager)
    return _WRITE_RESULTS_MANAGER[0].Queue()


def _save_strategy(model_chunks, role: RoleRanks):
    """torch_dist writer; replicated tensors (DP copies) are split across the DP ranks instead
    of all being written by DP rank 0. A role on a set of its own splits them over the world:
    the other roles' ranks hold no replica, so they get nothing to write, and every rank takes
    part in the same exchange whatever role it holds."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    if role.placed:
        group = dist.group.WORLD
    elif model_chunks and getattr(_unwrap(model_chunks[0]), "pg_collection", None) is not None:
        group = _unwrap(model_chunks[0]).pg_collection.dp_cp
    else:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)


def _with_leaders_common_state(sharded: Optional[dict], leader: int) -> dict:
    """This rank's sharded state dict for a role on a set of its own: its own on the role's
    ranks, on the others the leader's common (non-sharded) state alone.

    megatron writes common.pt from global rank 0, which may hold no part of the role: with the
    leader's common state it writes the role's own, and every rank's common state agrees (its
    save compares them with rank 0's). Common state is checkpoint metadata (param groups,
    steps, format tags), small and plain, so it is sent pickled."""
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    def leaders_common():
        _, persistent = extract_nonpersistent(sharded)
        return extract_sharded_base(persistent)[1]

    common = _on_rank(leaders_common, leader, "collect its role's common checkpoint state")
    return sharded if sharded is not None else common


def _layout(model_chunks: Sequence[torch.nn.Module], role: RoleRanks) -> dict:
    """The layout a checkpoint records (its RNG states are per rank of it): the set's size,
    TP / PP / CP / EP, the number of chunks, and for a role on a set of its own its ranks (a
    changed placement is a changed layout). From the role leader's chunks."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():  # colocated: the values checkpoints always recorded
        sizes = (ps.get_tensor_model_parallel_world_size(),
                 ps.get_pipeline_model_parallel_world_size(),
                 ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
    else:
        config = _unwrap(model_chunks[0]).config
        sizes = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                 config.context_parallel_size, config.expert_model_parallel_size)
    layout = {"world_size": role.size, "tp": sizes[0], "pp": sizes[1], "cp": sizes[2],
              "ep": sizes[3], "model_chunks": len(model_chunks)}
    if role.placed:
        layout["ranks"] = list(role.ranks)
    return layout


def _meta(step: int, layout: dict, optimizer_sharding: Optional[str]) -> dict:
    return {
        "format": FORMAT,
        "step": step,
        "layout": layout,
        "optimizer_sharding": optimizer_sharding,  # None: no optimizer state saved
        "saved_at_unix": time.time(),
        # Saved with a manifest (Checkpointer._commit): one missing later was removed, and the
        # checkpoint is treated as damaged rather than as one from before manifests.
        "manifest": True,
    }


def _rotate(roots: Sequence[str], keep_last: int, current_step: int) -> None:
    """Delete, under every root, the complete checkpoints older than the newest `keep_last`
    steps complete under all roots (0: keep all), and temporary directories of earlier steps
    (saves that were killed). roots: the roots whose checkpoints of one step make one resume
    point (Checkpointer.step_roots: PPO's actor and critic).

    Only steps complete under every root count, so a role that committed step N before the
    others did keeps the previous common step: a kill before the last role commits N must leave
    a step to resume from (keep_last=1 deleted the critic's step N-2 at the critic's commit of N,
    and a kill during the actor's save of N left no step both roles had). A step newer than the
    newest common one (a role ahead of the others) and the step just written are never deleted."""
    if keep_last > 0:
        steps = [dict(list_checkpoints(root)) for root in roots]
        common = sorted(set(steps[0]).intersection(*steps[1:]))
        kept = set(common[-keep_last:]) | {current_step}
        newest_common = common[-1] if common else None
        for per_root in steps:
            for step, path in per_root.items():
                if newest_common is not None and step < newest_common and step not in kept:
                    shutil.rmtree(path, ignore_errors=True)
    for root in roots:
        remove_unfinished_saves(root, before_step=current_step)


def remove_unfinished_saves(root: str, before_step: Optional[int] = None) -> list[str]:
    """Delete the temporary directories of saves that never committed (of steps before
    `before_step`; None: all of them); return their paths. Rank 0, with no save of this root in
    flight: at the start of a run under the run-directory lock (a save killed by a full disk
    would otherwise hold that space for good), after a failed save, and at each rotation."""
    removed = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = _NAME.match(name[len(TMP_PREFIX):]) if name.startswith(TMP_PREFIX) else None
        if match and (before_step is None or int(match.group(1)) < before_step):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed


def _sync_before_rename(tmp: str) -> None:
    """fsync what the rename of `tmp` will publish and nobody synced yet: megatron fsyncs its
    .distcp shards and .metadata but not its common.pt and metadata.json; our own files sync
    themselves (torch_save_synced); the directories' entries are synced here."""
    for name in (os.path.join(DIST_DIR, "common.pt"), os.path.join(DIST_DIR, "metadata.json"),
                 DIST_DIR, RNG_DIR, ""):
        if os.path.exists(os.path.join(tmp, name)):
            fsync_path(os.path.join(tmp, name))
