"""Experiences (scored samples) and the buffer that gathers them for an update.

    buffer = ExperienceBuffer()
    buffer.add(worker.generate(prompts))           # as often as you like
    for mini in buffer.mini_batches(4, shuffle=True, seed=step):   # whole prompts' groups
        ...
    trainer.update(buffer)                          # all of it, as Trainer.step's batch
    buffer.clear()                                  # on-policy: each sample trains once

Every rank holds the same experiences (the step's global batch, as the trainer's): mini-batches
and samples are drawn from seeded generators, the same on every rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np
from torch import Tensor

from verl_mcore.rollout.batch import Rollout, response_pad


@dataclass
class Experiences:
    """Scored samples of one or more RolloutWorker.generate calls, B samples of P prompts; the n
    samples of a prompt are consecutive and share a group id.

    rollout         rollout.batch.Rollout, scored: .train (engine/batch.TrainBatch: ids, lengths,
                    loss mask), .rows [B] dataset rows, .group_ids [B], .responses [B] texts,
                    .finish [B], .scores [B] (the weighted reward sources, on the training
                    device), .extras, .baseline (ReMax's, RolloutWorker(greedy_baseline=True)),
                    .version (the policy's updates when they were sampled)
    metrics         the generation and reward metrics of the call (empty for a concatenation)
    cfg             the Config of the worker that made them (rollout.n, temperature, lengths)
    policy          the Policy that sampled them
    """

    rollout: Any
    metrics: dict
    cfg: Any
    policy: Any

    @property
    def scores(self) -> Tensor:
        """[B] float32 rewards (the weighted reward sources), on the training device."""
        return self.rollout.scores

    @property
    def baseline(self) -> Optional[Tensor]:
        """[B] or None: ReMax's greedy-baseline scores."""
        return self.rollout.baseline

    @property
    def extras(self) -> dict:
        """"source/key" -> [B] numeric extras of dict-returning scorers (None: absent)."""
        return self.rollout.extras

    @property
    def policy_version(self) -> int:
        """The policy's updates when these were sampled (the oldest, for a concatenation)."""
        return self.rollout.version

    @property
    def num_samples(self) -> int:
        return len(self.rollout.responses)

    @property
    def groups(self) -> list[int]:
        """The group ids, in the order their samples come."""
        return list(dict.fromkeys(self.rollout.group_ids.tolist()))

    @property
    def num_prompts(self) -> int:
        return len(self.groups)

    @property
    def responses(self) -> list[str]:
        return self.rollout.responses

    @classmethod
    def concat(cls, parts: Sequence["Experiences"]) -> "Experiences":
        """The samples of `parts` one after another, their group ids renumbered so that groups of
        different parts stay apart. The parts must come from one policy and one worker's
        sampling settings (the update's log-probs need one temperature and length)."""
        if not parts:
            raise ValueError("Experiences.concat: nothing to concatenate (the buffer is empty)")
        first = parts[0]
        for i, p in enumerate(parts[1:], 1):
            if p.policy is not first.policy:
                raise ValueError(f"experiences {i} were sampled by another Policy than experiences 0")
            for section in ("rollout", "data"):
                if getattr(p.cfg, section) != getattr(first.cfg, section):
                    raise ValueError(f"experiences {i} were made with other {section}.* settings "
                                     f"than experiences 0 ({getattr(p.cfg, section)} vs "
                                     f"{getattr(first.cfg, section)}): update them apart")
        if len(parts) == 1:
            return first
        if len({p.baseline is None for p in parts}) > 1:
            raise ValueError("Experiences.concat: some parts have greedy baselines and some not")
        rollout = Rollout.concat([p.rollout for p in parts], response_pad(first.policy.info))
        return cls(rollout, {}, first.cfg, first.policy)

    def select_groups(self, groups: Sequence[int]) -> "Experiences":
        """The samples of the prompts with these group ids, in that order (whole groups)."""
        ids = self.rollout.group_ids.cpu()
        rows = [i for g in groups for i in (ids == g).nonzero().flatten().tolist()]
        if not rows:
            raise ValueError(f"Experiences.select_groups: none of the groups {list(groups)[:8]} "
                             f"is here (the groups are {self.groups[:8]}...)")
        return dataclasses.replace(self, rollout=self.rollout.select(rows), metrics={})


class ExperienceBuffer:
    """Experiences gathered for an update (module docstring)."""

    def __init__(self):
        self._parts: list[Experiences] = []
        self._draws = 0  # sample() calls so far: the seed of the next one

    def add(self, experiences: Experiences) -> None:
        if not isinstance(experiences, Experiences):
            raise TypeError(f"ExperienceBuffer.add takes Experiences (RolloutWorker.generate's "
                            f"result), got {type(experiences).__name__}")
        self._parts.append(experiences)

    def __len__(self) -> int:
        """Samples held."""
        return sum(p.num_samples for p in self._parts)

    @property
    def num_prompts(self) -> int:
        return sum(p.num_prompts for p in self._parts)

    def batch(self) -> Experiences:
        """Everything held, as one Experiences (Experiences.concat)."""
        return Experiences.concat(self._parts)

    def mini_batches(self, num_prompts: int, *, shuffle: bool = False, seed: int = 0,
                     drop_last: bool = False) -> Iterator[Experiences]:
        """Mini-batches of `num_prompts` prompts' samples (whole groups, so GRPO's statistics
        stay whole), in buffer order or shuffled by `seed`; the last one may be smaller unless
        `drop_last`."""
        whole = self.batch()
        groups = whole.groups
        if shuffle:
            groups = [groups[i] for i in np.random.default_rng(seed).permutation(len(groups))]
        for start in range(0, len(groups), _positive(num_prompts, "mini_batches")):
            chunk = groups[start:start + num_prompts]
            if len(chunk) == num_prompts or not drop_last:
                yield whole.select_groups(chunk)

    def sample(self, num_prompts: int, *, seed: Optional[int] = None) -> Experiences:
        """`num_prompts` prompts' samples drawn without replacement; without a seed, the n-th
        call draws with seed n (the same draws on every rank)."""
        whole = self.batch()
        groups = whole.groups
        if _positive(num_prompts, "sample") > len(groups):
            raise ValueError(f"ExperienceBuffer.sample({num_prompts}): the buffer holds "
                             f"{len(groups)} prompts")
        rng = np.random.default_rng(self._draws if seed is None else seed)
        self._draws += 1
        return whole.select_groups([groups[i] for i in rng.choice(len(groups), num_prompts,
                                                                  replace=False)])

    def clear(self) -> None:
        self._parts.clear()


def _positive(n: int, what: str) -> int:
    if n < 1:
        raise ValueError(f"ExperienceBuffer.{what}: num_prompts={n} must be at least 1")
    return n
