"""Load a megatron-core dist checkpoint (e.g. from `tools.convert_hf hf-to-mcore`) into a model.

dist_checkpointing reshards at load: the checkpoint may have been written at any TP/PP.
The directory is checked before any tensor is read (its manifest, then the metadata files) and
read as data only (utils/safe_read.py): it is the user's explicit choice (`model.checkpoint`),
so a failed check is an error, never a fallback.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

import torch.distributed as dist

from verl_mcore.utils import manifest
from verl_mcore.utils.safe_read import BadCheckpointError, check_dist_dir, dist_load

logger = logging.getLogger(__name__)

# Directories verified by this process, for its lifetime: the actor, reference and critic (and
# each virtual pipeline chunk) of a run usually load the same model.checkpoint, and hashing it
# once is enough. Every rank calls the loads in the same order, so the caches agree.
_verified: dict[str, object] = {}


def verify_manifest_share(ckpt_dir: str, rank: int = 0, world: int = 1) -> None:
    """This rank's share (all of it at world=1) of the manifest check of a dist checkpoint
    directory: its own manifest (tools/convert_hf) or that of the run checkpoint whose `dist/`
    it is; a warning when there is none. Raises BadCheckpointError naming the file."""
    found = manifest.find_manifest(ckpt_dir)
    if found is not None:
        root, prefix = found
        manifest.verify_share(root, manifest.read_manifest(root), rank, world, prefix)
    elif rank == 0:
        logger.warning("dist checkpoint %s has no %s (written before checkpoints had one, or by "
                       "another tool): the sizes and hashes of its files cannot be checked; "
                       "loading it after the checks that need no manifest",
                       ckpt_dir, manifest.MANIFEST)


def verify_dist_checkpoint(ckpt_dir: str):
    """Every check of a dist checkpoint directory in this process (tools/convert_hf): the
    manifest, then safe_read.check_dist_dir. Returns the DCP metadata."""
    verify_manifest_share(ckpt_dir)
    return check_dist_dir(ckpt_dir)


def load_dist_checkpoint(model, ckpt_dir: str | os.PathLike, role: str = "actor",
                         skip: Sequence[str] = ()) -> None:
    """Fill `model` (this rank's TP/PP slice) from the dist checkpoint at `ckpt_dir`. Collective.

    A critic's scalar head is read when the checkpoint has one of the same shape (resuming a
    critic); from an actor checkpoint (an LM head or a tied embedding) it keeps its fresh
    initialisation. Keys in `skip` (sharded-state-dict keys) are not read either. Anything else
    missing from the checkpoint is an error (megatron names the key).
    """
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    _check_on_every_rank(model, ckpt_dir)
    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(f"{ckpt_dir}: not a megatron dist checkpoint (no metadata.json)")
    if ckpt_dir not in _verified:
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            manifest.on_every_rank(lambda: verify_manifest_share(ckpt_dir, rank, world))
            _verified[ckpt_dir] = manifest.on_every_rank(lambda: check_dist_dir(ckpt_dir))
        except BadCheckpointError as e:
            raise BadCheckpointError(f"dist checkpoint {ckpt_dir} refused, nothing was loaded: "
                                     f"{e}. Pick another checkpoint or convert it again") from None
    sharded = model.sharded_state_dict()
    dropped = set(skip)
    head = sharded.get("output_layer.weight")
    if role == "critic" and not _has_scalar_head(_verified[ckpt_dir], head):
        dropped.add("output_layer.weight")
    for key in dropped:
        sharded.pop(key, None)
    state = dist_load(sharded, ckpt_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in dropped and not k.endswith("._extra_state")]
    if missing or unexpected:
        raise KeyError(f"load_dist_checkpoint({ckpt_dir}): parameters not loaded {missing}, "
                       f"unexpected {unexpected}")


def _check_on_every_rank(model, ckpt_dir: str) -> None:
    """Refuse a load that would hang: megatron's dist_checkpointing reads collectively over the
    whole world, so a model whose ranks are not the whole world (a role on a set of its own)
    would wait there for ranks that never load it."""
    pg = getattr(model, "pg_collection", None)
    if pg is None or not hasattr(pg, "mp") or not hasattr(pg, "dp_cp"):
        return
    ranks = pg.mp.size() * pg.dp_cp.size()
    if ranks != dist.get_world_size():
        raise ValueError(
            f"load_dist_checkpoint({ckpt_dir}): this model lives on {ranks} of the job's "
            f"{dist.get_world_size()} ranks (a role placed on ranks of its own), and a dist "
            "checkpoint loads collectively over every rank; give the role's initial weights as "
            "a Hugging Face directory (model.path, or the reward source's path) instead")


def _has_scalar_head(metadata, head) -> bool:
    """Whether the checkpoint stores an `output_layer.weight` shaped like this model's head."""
    if head is None:
        return False  # not the last pipeline stage
    stored = metadata.state_dict_metadata.get("output_layer.weight")
    return stored is not None and tuple(stored.size) == tuple(head.global_shape)
