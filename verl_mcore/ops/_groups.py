"""Process groups by name, for custom ops (their schemas take plain values, not group objects).

The public functions register each group they are given; the op implementations look it up.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

_GROUPS: dict[str, dist.ProcessGroup] = {}


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    """Register `group` and return its name; "" for None or a one-rank group (nothing to reduce)."""
    if group is None or dist.get_world_size(group) == 1:
        return ""
    _GROUPS[group.group_name] = group
    return group.group_name


def lookup(name: str, op: str) -> Optional[dist.ProcessGroup]:
    if not name:
        return None
    try:
        return _GROUPS[name]
    except KeyError:
        raise RuntimeError(
            f"{op}: process group {name!r} was not registered; call the public function in "
            "verl_mcore.ops with the group rather than the raw torch op"
        ) from None
