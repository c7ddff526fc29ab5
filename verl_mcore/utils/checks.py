"""Input checks shared by the algo functions, the ops' torch references and reward placement.

Every tensor a function of `verl_mcore.algo` (and `verl_mcore.ops`, reward placement) reads must
be on one device: the step's rule (engine/batch.py) puts the whole rollout batch on the training
device once, so a tensor elsewhere is a bug in the caller. torch would say only "Expected all
tensors to be on the same device" from deep inside an expression; this names the function and
each tensor.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

__all__ = ["same_device"]


def same_device(where: str, **tensors: Optional[Tensor]) -> None:
    """Raise ValueError naming every tensor and its device when `tensors` (None entries skipped)
    are not all on one device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(
            f"{where}: tensors on different devices ({listed}); the step's tensors must all live "
            "on the training device (see verl_mcore/engine/batch.py: where the tensors live)"
        )
