"""Group filters and DAPO's dynamic sampling: which prompt groups a step trains on.

A step samples generation batches of prompts, scores each, cuts it into prompt groups
(prompt_group.groups_from_batch) and hands them to a GroupAccumulator, until the accumulator
says it is `done`; `take()` then gives the groups the step trains on:

    filters = GroupFilters.from_config(cfg, rewards.extra_keys())   # at start-up (build.py)
    acc = filters.accumulator(cfg.data.train_batch_size)            # each step
    while not acc.done:
        acc.add(groups_from_batch(...one more scored generation batch...))
    groups, metrics = acc.take(), acc.metrics()

Each group goes through the filters in order, the built-in one (algorithm.filter_groups) first,
then the user's (rollout.group_filter); the first that drops it gives the reason, counted in
rollout/filter/dropped/<reason>. Kept groups stay in arrival order.

The semantics are verl's (recipe/dapo/dapo_ray_trainer.py, FilterGroupsConfig):
  keep rule    a group is kept when the std of `metric` over its samples is > 0, or when it has
               one sample; the others ("zero_std") would all get a zero GRPO advantage
  metric       score, seq_reward, seq_final_reward, acc or any reward extra (resolve_metric)
  refill       generation batches until train_batch_size groups are kept; with
               max_num_gen_batches > 0, at most that many per step (0: no limit; verl reads a
               negative value so too, config/validate.py refuses one)
  surplus      kept groups beyond train_batch_size are dropped (verl's batch[:train_batch_size
               * n]), not carried to the next step: nothing outlives a step, so a checkpoint
               needs no new state and a resumed run continues as the stopped one would have
  exhaustion   verl raises; here algorithm.filter_groups.on_max_gen_batches says: "error" (the
               default, verl's) or "train" on the groups kept so far
Where ours differ from verl's:
  - "std > 0" is decided exactly: a group is dropped when all its values are equal. verl's
    np.std of equal values that are not exact binary fractions can round to 1e-17 > 0 and keep
    the group (np.std([0.1] * 3)); 0/1 and +-1 rewards are decided the same by both.
  - `score` and `seq_reward` are the sample's total reward score (the weighted sum over
    reward.sources). verl's `score` is the scorer's own "score" key (before the overlong
    penalty, absent for scorers returning a number); its seq_reward is the score with the
    penalty. With one source returning a number, both are the score here.
  - `seq_final_reward` (verl: after the in-reward KL penalty) is refused with
    algorithm.use_kl_in_reward=true: the KL needs log-probs computed after filtering.
  - reward extras are named "source/key" here (reward/manager.py); `acc` alone names the one
    source that can give it (resolve_metric), and with one source a sample whose scorer
    returned a number compares its score, as verl's reward loop sets acc = score then.
  - a sample without the metric's extra (its scorer gave none, or failed and got
    reward.fallback_score) counts as a value of its own (None), so a group is kept when only
    some of its samples have it; one where none has it is dropped ("missing_metric"). verl
    would fail on such a batch.
  - the user's filter (rollout.group_filter) is ours (slime has one: --dynamic-sampling-filter-path).

Every rank holds the same gathered groups, but the filters run on one rank only, the first
training rank (Producer._sample_filtered: distributed/agree.decided_on_one_rank), which sends its
decisions (`decide`) to the others: a user's filter that decides differently on another rank
(unseeded randomness, state of its own) or fails there (a file missing on one node) cannot set
the ranks apart, and its failure stops every rank at once. The accumulator itself is pure (no
randomness, no clock, no rank, dicts in insertion order): given the decisions, every rank keeps,
takes and counts alike.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from verl_mcore.config.schema import Config, UserFunctionConfig
from verl_mcore.errors import ConfigError
from verl_mcore.rollout.prompt_group import PromptGroup
from verl_mcore.user_code import UserFunction, load_user_function
from verl_mcore.utils.metric_names import name_fragment

log = logging.getLogger(__name__)

METRICS = "rollout/filter/"
ZERO_STD, MISSING_METRIC = "zero_std", "missing_metric"  # the built-in filter's reasons
USER_REASON = "group_filter"  # a user's drop that gave no reason
SCORE_METRICS = ("score", "seq_reward", "seq_final_reward")
SIGNATURE = "fn(group, **kwargs) -> bool | (bool, reason)"
_KEY = "rollout.group_filter"


class GroupFilterError(RuntimeError):
    """A group filter failed while a step sampled: the user's filter raised or returned something
    else than a decision, or the metric is missing from the batch. Raised alike on every rank."""


class FilterExhaustedError(GroupFilterError):
    """max_num_gen_batches were sampled without a full batch (on_max_gen_batches=error)."""


class GroupFilter(Protocol):
    """(keep, reason) for one group; `reasons`: those it may give, logged from the first step."""

    reasons: tuple[str, ...]

    def __call__(self, group: PromptGroup) -> tuple[bool, Optional[str]]: ...


# ------------------------------------------------------------------ the metric (built-in filter)

@dataclass(frozen=True)
class GroupMetric:
    """What the built-in filter compares within a group (resolve_metric makes it)."""

    name: str  # as configured (algorithm.filter_groups.metric)
    key: Optional[str]  # the reward extra compared; None: the samples' scores
    # `acc` of a one-source reward: a sample without the extra compares its score (verl).
    score_if_missing: bool = False

    def values(self, group: PromptGroup) -> list:
        """[n] the group's values; None for a sample without the extra."""
        if self.key is None:
            return list(group.scores)
        values = group.extras.get(self.key)
        if values is None and not self.score_if_missing:
            raise GroupFilterError(
                f"algorithm.filter_groups.metric={self.name!r}: no sample of generation batch "
                f"{group.gen_batch} has the reward extra {self.key!r}; its extras are "
                f"{sorted(group.extras)}. Have the scorer return it ({{'score': ..., "
                f"{self.key.rsplit('/', 1)[-1]!r}: ...}}), or set the metric to one of those "
                "keys or to score")
        values = values or (None,) * group.n
        if self.score_if_missing:
            return [s if v is None else v for v, s in zip(values, group.scores)]
        return list(values)


def resolve_metric(metric: str, extra_keys: Mapping[str, Optional[frozenset]]) -> GroupMetric:
    """algorithm.filter_groups.metric for a reward whose sources give `extra_keys` (source name
    -> the extra keys its scorers may return, None: user code, any; RewardManager.extra_keys).

      score, seq_reward, seq_final_reward   the sample's total score (config/validate.py refuses
                                            seq_final_reward with an in-reward KL)
      <source>/<key>                        that extra; the source must exist and be able to give it
      acc, with one reward source           its "acc" extra, else the sample's score (verl)
      <key>                                 "<source>/<key>" of the one source that can give it

    Raises ConfigError naming the metric and what each source gives when it cannot exist."""
    key = "algorithm.filter_groups.metric"
    if metric in SCORE_METRICS:
        return GroupMetric(metric, None)
    gives = "; ".join(f"{s!r} gives " + ("any (user code)" if k is None else
                                        ", ".join(sorted(k)) or "none")
                      for s, k in extra_keys.items())
    advice = f"the reward's sources: {gives}. Use {key}=score, or a key a source returns"
    for source, keys in extra_keys.items():
        if metric.startswith(source + "/"):
            name = metric[len(source) + 1:]
            if keys is not None and name not in keys:
                raise ConfigError(f"{key}={metric!r}: source {source!r} cannot give the extra "
                                  f"{name!r}; {advice}")
            return GroupMetric(metric, metric, score_if_missing=name == "acc" and len(extra_keys) == 1)
    if "/" in metric:
        raise ConfigError(f"{key}={metric!r} names no reward source ({sorted(extra_keys)}): a "
                          f"reward extra is named <source>/<key>; {advice}")
    if metric == "acc" and len(extra_keys) == 1:
        return GroupMetric(metric, f"{next(iter(extra_keys))}/acc", score_if_missing=True)
    able = [s for s, keys in extra_keys.items() if keys is None or metric in keys]
    if len(able) == 1:
        return GroupMetric(metric, f"{able[0]}/{metric}")
    if not able:
        raise ConfigError(f"{key}={metric!r}: no reward source can give an extra {metric!r}; "
                          f"{advice}")
    raise ConfigError(f"{key}={metric!r}: several reward sources may give it "
                      f"({', '.join(able)}): name one, e.g. {key}={able[0]}/{metric}")


class ZeroStdFilter:
    """DAPO's filter (algorithm.filter_groups): drop a group whose metric is the same for every
    sample; keep one of one sample (module docstring: how "the same" differs from verl)."""

    reasons = (ZERO_STD, MISSING_METRIC)

    def __init__(self, metric: GroupMetric):
        self.metric = metric

    def __call__(self, group: PromptGroup) -> tuple[bool, Optional[str]]:
        values = self.metric.values(group)
        if len(values) <= 1:
            return True, None
        if all(v is None for v in values):
            return False, MISSING_METRIC
        if all(v == values[0] for v in values):
            return False, ZERO_STD
        return True, None


# ------------------------------------------------------------------ the user's filter

class UserGroupFilter(UserFunction):
    """rollout.group_filter: the user's function, called as fn(group, **kwargs) in the trainer.
    What it raises, or returns other than a bool or (bool, reason str), stops the run naming
    the file, the function, the line and the group."""

    reasons = (USER_REASON,)

    def __init__(self, fn: Callable, kwargs: Mapping[str, Any], path: str, name: str):
        super().__init__(_KEY, fn, kwargs, path, name)

    def __call__(self, group: PromptGroup) -> tuple[bool, Optional[str]]:
        where = (f"on prompt group {group.index} of generation batch {group.gen_batch} "
                 f"(data_source={group.row.get('data_source')!r})")
        result = self.call(group, doing_what=where, returns="return a decision",
                           error=GroupFilterError, where=f", {where}")
        return self._decision(result, where)

    def _decision(self, result: Any, where: str) -> tuple[bool, Optional[str]]:
        keep, reason = (result if isinstance(result, tuple) and len(result) == 2
                        else (result, None))
        if not _is_bool(keep) or not (reason is None or isinstance(reason, str)):
            raise GroupFilterError(f"{self.label} returned {type(result).__name__} "
                                   f"{str(result)[:80]!r} {where}; a group filter returns a bool "
                                   "(keep) or (bool, reason str)")
        return bool(keep), (None if keep else name_fragment(reason) if reason else USER_REASON)


def _is_bool(value: Any) -> bool:
    # numpy's bool_ too (a comparison made with numpy); not an int, whose 0 / 1 would hide a bug
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def load_user_filter(cfg: UserFunctionConfig) -> Optional[UserGroupFilter]:
    """rollout.group_filter's function, or None when none is configured. Its file is imported
    first in a fresh interpreter under import_timeout_s, where the signature is checked
    (user_code.check_user_function), so a file that blocks, exits or fails, a missing name or a wrong
    signature fail here, before any model is built, naming the file and the function."""
    loaded = load_user_function(cfg, _KEY, ("group",), SIGNATURE)
    if loaded is None:
        return None
    fn, path = loaded
    return UserGroupFilter(fn, cfg.kwargs, path, cfg.name)


# ------------------------------------------------------------------ the filters of a run

@dataclass(frozen=True)
class GroupFilters:
    """The run's group filters, in order, and how far a step may refill its batch."""

    filters: tuple[GroupFilter, ...] = ()
    max_gen_batches: int = 0  # <= 0: no limit
    on_max: str = "error"  # on_max_gen_batches: "error" | "train"

    @classmethod
    def from_config(cls, cfg: Config,
                    extra_keys: Mapping[str, Optional[frozenset]]) -> "GroupFilters":
        """algorithm.filter_groups and rollout.group_filter, checked: the metric against what
        the reward's sources can give (`extra_keys`: RewardManager.extra_keys), the user's
        file and signature in an import probe. Raises ConfigError / ValueError naming the key
        or the file."""
        f = cfg.algorithm.filter_groups
        filters: list[GroupFilter] = []
        if f.enable:
            filters.append(ZeroStdFilter(resolve_metric(f.metric, extra_keys)))
        user = load_user_filter(cfg.rollout.group_filter)
        if user is not None:
            filters.append(user)
        return cls(tuple(filters), f.max_num_gen_batches, f.on_max_gen_batches)

    @property
    def enabled(self) -> bool:
        """Whether any group is ever dropped (without filters a step samples one batch)."""
        return bool(self.filters)

    def accumulator(self, target: int) -> "GroupAccumulator":
        return GroupAccumulator(target, self.filters, self.max_gen_batches, self.on_max)


class GroupAccumulator:
    """One step's kept prompt groups, until `target` of them are kept (module docstring).

    Pure and deterministic: the same generation batches and decisions give the same groups and
    metrics on every rank."""

    def __init__(self, target: int, filters: Sequence[GroupFilter] = (), max_gen_batches: int = 0,
                 on_max: str = "error"):
        if target < 1:
            raise ValueError(f"GroupAccumulator: target={target} groups; it must be >= 1")
        if on_max not in ("error", "train"):
            raise ValueError(f"algorithm.filter_groups.on_max_gen_batches={on_max!r}: 'error' or 'train'")
        self.target, self.filters = target, tuple(filters)
        self.max_gen_batches, self.on_max = max_gen_batches, on_max
        self.kept: list[PromptGroup] = []
        self.gen_batches = 0
        self.seen = 0
        self.dropped: dict[str, int] = {r: 0 for f in self.filters for r in f.reasons}
        self.taken: Optional[list[PromptGroup]] = None

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target

    @property
    def exhausted(self) -> bool:
        """max_num_gen_batches sampled, the batch not full."""
        return not self.full and 0 < self.max_gen_batches <= self.gen_batches

    @property
    def done(self) -> bool:
        """No more generation batches for this step: take() now."""
        return self.full or self.exhausted

    def add(self, groups: Sequence[PromptGroup],
            reasons: Optional[Sequence[Optional[str]]] = None) -> None:
        """One generation batch's groups, in their order: each kept or dropped by the filters,
        or as `reasons` (`decide`'s, made on another rank) say."""
        if self.done or self.taken is not None:
            raise RuntimeError(f"GroupAccumulator.add: the step's batch is done ({len(self.kept)} "
                               f"of {self.target} groups kept in {self.gen_batches} generation "
                               "batches): take() it")
        reasons = self.decide(groups) if reasons is None else list(reasons)
        if len(reasons) != len(groups):
            raise ValueError(f"GroupAccumulator.add: {len(reasons)} decisions for {len(groups)} "
                             "groups")
        self.gen_batches += 1
        for group, reason in zip(groups, reasons):
            self.seen += 1
            if reason is None:
                self.kept.append(group)
            else:
                self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def decide(self, groups: Sequence[PromptGroup]) -> list[Optional[str]]:
        """[len(groups)] the reason each group is dropped (the first filter's that drops it), or
        None where every filter keeps it. Raises GroupFilterError where a filter fails."""
        return [self._drop_reason(group) for group in groups]

    def _drop_reason(self, group: PromptGroup) -> Optional[str]:
        for f in self.filters:
            keep, reason = f(group)
            if not keep:
                return reason
        return None

    def take(self) -> list[PromptGroup]:
        """The step's groups: the first `target` kept ones (the surplus is dropped, as verl
        does), or, exhausted with on_max_gen_batches=train, every kept one (fewer). Exhausted
        with on_max_gen_batches=error, or with no group kept at all, raises
        FilterExhaustedError."""
        if not self.done:
            raise RuntimeError(f"GroupAccumulator.take: {len(self.kept)} of {self.target} groups "
                               f"kept and generation batches may still be sampled: add() more")
        if self.full:
            self.taken = self.kept[:self.target]
            return self.taken
        counts = (f"{len(self.kept)} of {self.target} prompt groups (data.train_batch_size) kept "
                  f"after {self.gen_batches} generation batches (algorithm.filter_groups."
                  f"max_num_gen_batches={self.max_gen_batches}); dropped: {self._dropped_text()}")
        if self.on_max == "error" or not self.kept:
            what = ("nothing to train on" if self.on_max == "train" else
                    "algorithm.filter_groups.on_max_gen_batches=error")
            raise FilterExhaustedError(
                f"{counts} ({what}). The data may be too easy or too hard for the filter: raise "
                "max_num_gen_batches (0: no limit), set on_max_gen_batches=train to train on "
                "fewer groups, or check the filters (rollout/filter/dropped/* in metrics.jsonl)")
        log.warning("%s: training on %d groups (algorithm.filter_groups.on_max_gen_batches=train)",
                    counts, len(self.kept))
        self.taken = list(self.kept)
        return self.taken

    def _dropped_text(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in self.dropped.items() if n) or "none"

    def metrics(self) -> dict[str, float]:
        """rollout/filter/...: gen_batches (sampled this step), groups (seen), kept_groups,
        kept_fraction, dropped/<reason> (the filters' own reasons from the first step, 0 when
        none), and after take(): trained_groups, surplus_groups (kept beyond the target,
        dropped), short_batch (1 when the step trains on fewer than the target)."""
        m = {METRICS + "gen_batches": float(self.gen_batches), METRICS + "groups": float(self.seen),
             METRICS + "kept_groups": float(len(self.kept)),
             METRICS + "kept_fraction": len(self.kept) / self.seen if self.seen else 0.0}
        m.update({f"{METRICS}dropped/{reason}": float(n) for reason, n in self.dropped.items()})
        if self.taken is not None:
            m[METRICS + "trained_groups"] = float(len(self.taken))
            m[METRICS + "surplus_groups"] = float(len(self.kept) - len(self.taken))
            m[METRICS + "short_batch"] = float(len(self.taken) < self.target)
        return m
