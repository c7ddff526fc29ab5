"""A prompt group: one prompt's n samples from one generation batch, as group filters see them
(rollout/group_filter.py).

Built from what a step holds once it has scored a generation batch, all [B] in the batch's
sample order and identical on every rank: the group ids, the total scores, the reward extras
("source/key" -> [B] values, Trainer.score), the decoded responses, the dataset rows (one per
sample), the finish reasons and the response lengths. Building copies references and small
numbers only: no tensor is kept (a tensor is read once with .tolist()).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence


@dataclass(frozen=True)
class PromptGroup:
    """One prompt's samples; every per-sample field is a tuple of n, in the batch's order.

    index             the group's place in its generation batch (0 ..), in the order its first
                      sample appears
    gen_batch         which generation batch of the step it came from (0 ..)
    samples           [n] the samples' places in that generation batch: what selects their
                      tensors when the group is kept
    row               the prompt's dataset row (data_source, reward_model, extra_info, ...)
    responses         [n] the decoded responses
    scores            [n] each sample's total reward score (the weighted sum of the sources)
    extras            "source/key" -> [n] the scorers' numeric extras (RewardOutput.extras);
                      None where a sample's scorer gave no such key or failed. Every group of a
                      batch has the batch's keys.
    finish            [n] why each response ended: "stop", "length", ...
    response_lengths  [n] response tokens
    """

    index: int
    gen_batch: int
    samples: tuple[int, ...]
    row: Mapping[str, Any]
    responses: tuple[str, ...]
    scores: tuple[float, ...]
    extras: Mapping[str, tuple[Optional[float], ...]]
    finish: tuple[str, ...]
    response_lengths: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.samples)


def groups_from_batch(group_ids: Any, scores: Any, responses: Sequence[str],
                      rows: Sequence[Mapping[str, Any]], finish: Sequence[str],
                      response_lengths: Any, extras: Optional[Mapping[str, Sequence]] = None,
                      gen_batch: int = 0) -> list[PromptGroup]:
    """The prompt groups of one scored generation batch, in the order of their first samples.

    group_ids [B] (a tensor or a sequence; samples of one prompt share an id, consecutive or
    not), scores [B], responses [B], rows [B] (each sample's prompt row), finish [B],
    response_lengths [B], extras "source/key" -> [B]. A column of another length raises
    ValueError naming it."""
    ids = _as_list(group_ids)
    columns = {"scores": [float(s) for s in _as_list(scores)], "responses": list(responses),
               "rows": list(rows), "finish": list(finish),
               "response_lengths": [int(n) for n in _as_list(response_lengths)]}
    extras = {key: list(values) for key, values in (extras or {}).items()}
    for name, column in [*columns.items(), *((f"extras[{k!r}]", v) for k, v in extras.items())]:
        if len(column) != len(ids):
            raise ValueError(f"groups_from_batch: {len(column)} {name} for {len(ids)} samples "
                             "(group_ids): every column holds one value per sample")
    members: dict[Any, list[int]] = {}
    for i, group_id in enumerate(ids):
        members.setdefault(group_id, []).append(i)

    def pick(column: list, idx: list[int]) -> tuple:
        return tuple(column[i] for i in idx)

    return [PromptGroup(index=index, gen_batch=gen_batch, samples=tuple(idx),
                        row=columns["rows"][idx[0]], responses=pick(columns["responses"], idx),
                        scores=pick(columns["scores"], idx),
                        extras={key: pick(values, idx) for key, values in extras.items()},
                        finish=pick(columns["finish"], idx),
                        response_lengths=pick(columns["response_lengths"], idx))
            for index, idx in enumerate(members.values())]


def _as_list(values: Any) -> list:
    """A tensor's or an array's values as a Python list (read once), else list(values)."""
    tolist = getattr(values, "tolist", None)
    return tolist() if callable(tolist) else list(values)
