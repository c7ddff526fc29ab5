"""Put each sequence's scalar reward on its last valid response token."""
from __future__ import annotations

from typing import Sequence, Union

import torch

from verl_mcore.utils.checks import same_device


def place_on_last_token(scores: Union[torch.Tensor, Sequence[float]],
                        response_mask: torch.Tensor) -> torch.Tensor:
    """scores [batch], response_mask [batch, T] (1 on response tokens) -> rewards [batch, T] float32.

    Row b is zero except at the position of its last 1 in the mask, which holds scores[b]. A row
    with no valid token (an empty response) gets no reward: there is no token it could credit.

    The mask is the loss mask (engine/batch.py): holes in it (tokens the model did not write,
    such as a tool's output) before the response's last token change nothing, and when the
    response ends in masked tokens (a tool's output after the model's last turn) the score goes
    to the last token the model wrote. Not to the masked last token: every estimator ignores
    rewards at masked positions (algo/advantages.py), so a score there would be lost.
    """
    if isinstance(scores, torch.Tensor):
        same_device("place_on_last_token", scores=scores, response_mask=response_mask)
    mask = response_mask.bool()
    batch, width = mask.shape
    scores = torch.as_tensor(scores, dtype=torch.float32, device=mask.device)
    if scores.shape != (batch,):
        raise ValueError(f"scores has shape {tuple(scores.shape)}, response_mask has batch {batch}")
    rewards = torch.zeros(batch, width, dtype=torch.float32, device=mask.device)
    has_token = mask.any(dim=1)
    # index of the last True: the first True of the row read backwards
    last = width - 1 - mask.flip(dims=[1]).to(torch.int8).argmax(dim=1)
    rows = torch.arange(batch, device=mask.device)[has_token]
    rewards[rows, last[has_token]] = scores[has_token]
    return rewards
