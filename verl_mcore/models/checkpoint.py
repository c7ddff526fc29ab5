"""Load a megatron-core dist checkpoint (e.g. from `tools.convert_hf hf-to-mcore`) into a model.

dist_checkpointing reshards at load: the checkpoint may have been written at any TP/PP.
Every file is read as data only (engine/safe_read.py).
"""
from __future__ import annotations

import os
from typing import Sequence

from verl_mcore.engine.safe_read import check_dist_dir, dist_load


def load_dist_checkpoint(model, ckpt_dir: str | os.PathLike, role: str = "actor",
                         skip: Sequence[str] = ()) -> None:
    """Fill `model` (this rank's TP/PP slice) from the dist checkpoint at `ckpt_dir`.

    A critic's scalar head is read when the checkpoint has one of the same shape (resuming a
    critic); from an actor checkpoint (an LM head or a tied embedding) it keeps its fresh
    initialisation. Keys in `skip` (sharded-state-dict keys) are not read either. Anything else
    missing from the checkpoint is an error (megatron names the key).
    """
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(f"{ckpt_dir}: not a megatron dist checkpoint (no metadata.json)")
    metadata = check_dist_dir(ckpt_dir)  # BadCheckpointError names the file: refused
    sharded = model.sharded_state_dict()
    dropped = set(skip)
    if role == "critic" and not _has_scalar_head(metadata, sharded.get("output_layer.weight")):
        dropped.add("output_layer.weight")
    for key in dropped:
        sharded.pop(key, None)
    state = dist_load(sharded, ckpt_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in dropped and not k.endswith("._extra_state")]
    if missing or unexpected:
        raise KeyError(f"load_dist_checkpoint({ckpt_dir}): parameters not loaded {missing}, "
                       f"unexpected {unexpected}")


def _has_scalar_head(metadata, head) -> bool:
    """Whether the checkpoint stores an `output_layer.weight` shaped like this model's head."""
    if head is None:
        return False  # not the last pipeline stage
    stored = metadata.state_dict_metadata.get("output_layer.weight")
    return stored is not None and tuple(stored.size) == tuple(head.global_shape)
