"""RewardManager: one scalar reward per response, from the sources configured under `reward`.

    manager = RewardManager.from_config(cfg.reward, reward_models={"rm": model})
    out = manager.score(responses, rows, prompt_ids, response_ids)
    out.scores                # [batch] the weighted total, to put on the last response token
    out.source_scores["rule"] # [batch] one source on its own (logged as reward/rule/mean)

Sources (`reward.sources`, each {name, weight, type}); the total is sum(weight * score):
  rule          per sample: the scorer its route names (below); without a route,
                reward.custom_fn (a function, `custom_fn_kwargs` to each call) or
                reward.custom_cls (a class, its `kwargs` to the constructor) if set, or a
                Python callable (`from_config(score_fn=...)`, in this process), else the
                built-in dispatch by data_source
  custom        `function` from the Python file `path`: a function called with `kwargs`, or a
                class constructed with them
  reward_model  a learned model. The trainer builds a megatron model from `path` and scores the
                whole batch with it on every rank together (engine/reward_model.py), then
                hands the scores in (`scored_outside` names, `model_scores` per batch). From
                Python, an object with `score_batch(prompt_ids, response_ids) -> list[float]`
                may be passed in `reward_models` by source name instead.
  environment   the reward the sampling gave each trajectory (an agent loop's environment:
                Rollout.sampled_rewards), handed in like a reward model's (`model_scores`); a
                trajectory without one fails that sample (reward.fallback_score, counted)
An empty `reward.sources` means one `rule` source of weight 1.

A class is constructed once per scoring process and is either per-sample (`score(data_source,
response, ground_truth, extra_info)` or `__call__`) or a batch class (`compute_reward(batch) ->
B scores`, where batch["prompts"], batch["responses"] and batch[<column>] are lists over the
call's B samples): custom.py. A batch class gets one call per batch, with all the samples it
scores (a route target: the samples routed to it); through the workers that call is one item,
with a time limit of reward.timeout_s x B. Each value of the result is checked like a score; a
result of the wrong length fails every sample of the call.

Routing (`reward.route_by: category`, `reward.routes: {math: lighteval/MATH, code: my_judge}`,
`reward.default_route`): the rule source scores each sample with the scorer its column value
names — a built-in data_source name or the name of another source. A source that is a route
target scores only the samples routed to it and is not added to the total on its own.
`RewardOutput.routes` holds each sample's column value; `route_metrics` of the whole batch's
values and totals (Scorer.score gathers them from every rank) gives reward/route/<value>/mean
(the mean total score of those samples) and reward/route/<value>/count. A sample without a value
counts under `<none>`; a value that is not 1-64 of [A-Za-z0-9_.-] is named by its first 48
characters, the others replaced by "_", and 8 hex digits of its SHA-1 ("C++" -> "C__-fc2b4216").

Every scorer sees `(data_source, response, ground_truth, extra_info)`: ground_truth is
`reward_model["ground_truth"]`, and extra_info is the row's extra_info with every other column of
the row (category, ability, prompt, ...) added under its own name unless extra_info has that key.

Rule and custom scorers run isolated in `reward.num_workers` spawned processes with a per-item
`reward.timeout_s` and an optional address-space cap `reward.max_memory_mb` (see pool.py);
num_workers=0 scores in this process, without timeouts or a cap, and a crash of the scorer
(a segfault) is a crash of the trainer there. Every user file is imported first in a fresh
interpreter within `reward.import_timeout_s` (user_code.py), so a file that blocks or exits
at import fails at start-up naming itself; that probe also checks the signatures of the object
named (and constructs a class once), so a wrong one fails at start-up naming the file, the class
or function and the signature expected, never at step 1 and never as silent fallback scores.

A call that raises, times out, kills its worker, or returns anything but a finite number (a
string, a bool, None, NaN, inf, or one too large for float32 statistics: scorers.check_result)
gives `reward.fallback_score` for that source and sample: counted in reward/errors,
reward/timeouts and reward/invalid, and per sample in `RewardOutput.failed`. Each batch with failures logs one line naming the first one (sample,
data_source, source, scorer, reason); the first exception of the run is logged with its
traceback. `check_failures` stops the run when more than `reward.max_failed_fraction` of a
batch failed.
"""
from __future__ import annotations

import collections
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

from verl_mcore.config.schema import RewardConfig, RewardSourceConfig
from verl_mcore.errors import RewardFailureError
from verl_mcore.reward import custom
from verl_mcore.reward.builtin import EXTRAS, SCORERS, unknown_source_hint
from verl_mcore.reward.pool import ScoringPool
from verl_mcore.reward.scorers import ScorerSpec
from verl_mcore.reward.worker import Outcome, checked, run_item
from verl_mcore.user_code import check_import, exit_raises_in_this_thread
from verl_mcore.utils.doing import doing
from verl_mcore.utils.metric_names import name_fragment

logger = logging.getLogger(__name__)

# Seconds a scoring worker may take to start beyond reward.import_timeout_s (interpreter start-up
# on a loaded node); the probe import has already kept the file itself within the limit.
_WORKER_START_MARGIN_S = 30.0
_CRASHES_LOGGED = 5  # dead workers named one by one per batch; the rest are counted
# What an os._exit of a scorer running in the trainer (reward.num_workers=0) is told instead.
_SCORER_EXIT = ("the scorer", "with reward.num_workers=0 it runs in the trainer, which this would "
                "have ended: return a score, or use reward.num_workers >= 1 for code that may exit")


_ROW_FIELDS = ("data_source", "reward_model", "extra_info")


@runtime_checkable
class RewardModel(Protocol):
    """A learned reward model (e.g. a megatron value-head model): one score per sequence."""

    def score_batch(self, prompt_ids: Sequence[Sequence[int]],
                    response_ids: Sequence[Sequence[int]]) -> list[float]: ...


@dataclass
class RewardOutput:
    scores: list[float]  # [batch] weighted total over the sources
    source_scores: dict[str, list[float]]  # source -> [batch], unweighted
    extras: dict[str, list[Optional[float]]]  # "source/key" -> [batch] from dict-returning scorers
    failed: list[bool]  # [batch] some source of this sample fell back to reward.fallback_score
    metrics: dict[str, float] = field(default_factory=dict)
    # (sample number, description) of the batch's first failure in sample order, or None
    first_failure: Optional[tuple[int, str]] = None
    # [batch] each sample's reward.route_by value (str; None where the row has none), for
    # route_metrics over the whole batch; empty without reward.route_by
    routes: list[Optional[str]] = field(default_factory=list)


@dataclass(frozen=True)
class _Source:
    name: str
    weight: float
    type: str
    key: str  # config key, for messages


class RewardManager:
    def __init__(self, cfg: RewardConfig, sources: list[RewardSourceConfig],
                 reward_models: Mapping[str, RewardModel], scored_outside: Sequence[str] = (),
                 score_fn: Optional[Callable] = None):
        self.cfg = cfg
        # The environment's rewards always come with the batch (Scorer.score), route targets
        # included.
        self.environment_sources = [s.name for s in sources if s.type == "environment"]
        self._scored_outside = set(scored_outside) | set(self.environment_sources)
        keyed = {s.name: (s, f"reward.sources[{i}]") for i, s in enumerate(sources)}
        if len(keyed) != len(sources):
            names = [s.name for s in sources]
            raise ValueError(f"reward.sources: duplicate names in {names}")
        specs = {"dispatch": ScorerSpec("dispatch", "reward", math_compat=cfg.math_compat),
                 **_fallback_specs(cfg, score_fn)}
        self._fallback_key = next((k for k in ("custom_fn", "custom_cls") if k in specs), "dispatch")
        for name, (s, key) in keyed.items():
            if s.type == "custom":
                specs["source:" + name] = ScorerSpec("custom", key, path=s.path,
                                                     function=s.function, kwargs=dict(s.kwargs))
        self._models: dict[str, RewardModel] = {}
        for name, (s, key) in keyed.items():
            if s.type == "reward_model" and name not in self._scored_outside:
                model = reward_models.get(name)
                if model is None:
                    raise ValueError(f"{key} ({name!r}) is a reward_model source: build the model "
                                     f"from path={s.path!r} and pass it as "
                                     f"reward_models={{{name!r}: model}}")
                if not isinstance(model, RewardModel):
                    raise TypeError(f"{key} ({name!r}): the reward model must have "
                                    f"score_batch(prompt_ids, response_ids), got {type(model)}")
                self._models[name] = model

        # Routing: value of cfg.route_by -> target (a source name, or a built-in scorer name).
        self._route_targets: dict[str, str] = {}
        for value, target in [*cfg.routes.items(), (None, cfg.default_route)]:
            if target is None:
                continue
            key = "reward.default_route" if value is None else f"reward.routes.{value}"
            if target in keyed:
                if keyed[target][0].type == "rule":
                    raise ValueError(f"{key}={target!r}: a route cannot lead to a rule source")
                self._route_targets[target] = target
            elif target in SCORERS:
                specs["builtin:" + target] = ScorerSpec("builtin", key, name=target,
                                                        math_compat=cfg.math_compat)
                self._route_targets[target] = "builtin:" + target
            else:
                raise ValueError(f"{key}={target!r} is neither a reward.sources name "
                                 f"({sorted(keyed)}) nor a built-in scorer ({sorted(SCORERS)})")
        if (cfg.routes or cfg.default_route) and not cfg.route_by:
            raise ValueError("reward.routes / reward.default_route are set but reward.route_by "
                             "(the column to route by) is not")
        self.sources = [_Source(s.name, float(s.weight), s.type, key)
                        for name, (s, key) in keyed.items() if name not in self._route_targets]
        if cfg.route_by and not any(s.type == "rule" for s in self.sources):
            raise ValueError("reward.route_by is set but reward.sources has no source of type "
                             "'rule' to route")
        # Every user file is imported in a probe process first, so one that blocks, exits or
        # crashes at import fails here naming itself instead of hanging or killing the trainer.
        # The probe also checks each object's signatures and constructs a class once, so a wrong
        # signature or a constructor that raises fails here too, naming the file and the class.
        kinds = {key: check_import(spec.path, spec.function, spec.key, cfg.import_timeout_s,
                                   "reward.import_timeout_s", spec.name_field,
                                   check=(custom.check, (spec,)))
                 for key, spec in specs.items() if spec.kind == "custom"}
        for key, spec in specs.items():
            if spec.kind == "object":  # a Python callable: nothing to import, signature bound here
                if cfg.num_workers:
                    raise ValueError(f"{spec.key} ({spec.function}) is a Python object: it scores "
                                     "in this process, with reward.num_workers=0 (to score in "
                                     "workers, name a function in a file: reward.custom_fn)")
                kinds[key] = custom.check(spec.obj, spec)
        # Scorer keys of batch classes: one call per batch (of the samples each one scores).
        self._batch_keys = {key for key, kind in kinds.items() if kind == "batch"}
        # What messages call each scorer: the user's file and function (`rewards.py:boolean`),
        # and the file whose frames locate a failure in a traceback.
        self._labels = {key: spec.label(kinds.get(key, "function")) for key, spec in specs.items()}
        self._labels.update({"model:" + name: f"the reward model {name!r} ({key})"
                             for name, (s, key) in keyed.items() if s.type == "reward_model"})
        self._labels.update({"model:" + name: f"the environment's reward {name!r} ({key})"
                             for name, (s, key) in keyed.items() if s.type == "environment"})
        self._files = {key: spec.path for key, spec in specs.items() if spec.path}
        # Then only the processes that score import them: this one with num_workers=0, else
        # the workers (a bad path or name fails there too, before training starts). Here an
        # os._exit that the probe did not meet (a file that exits where RANK is set) fails the
        # import, naming the file, instead of ending the trainer without a word.
        self._fns = {}
        if cfg.num_workers == 0:
            with exit_raises_in_this_thread(_SCORER_EXIT):
                self._fns = {key: spec.load() for key, spec in specs.items()}
        self._pool = (ScoringPool(specs, cfg.num_workers, cfg.timeout_s,
                                  startup_timeout_s=cfg.import_timeout_s + _WORKER_START_MARGIN_S,
                                  max_memory_mb=cfg.max_memory_mb)
                      if cfg.num_workers > 0 else None)
        self._logged_first_error = False

    @property
    def needs_token_ids(self) -> bool:
        """Whether `score` needs prompt_ids / response_ids (reward-model objects read them)."""
        return bool(self._models)

    @classmethod
    def from_config(cls, cfg: RewardConfig,
                    reward_models: Optional[Mapping[str, RewardModel]] = None,
                    scored_outside: Sequence[str] = (),
                    score_fn: Optional[Callable] = None) -> "RewardManager":
        """scored_outside: reward_model sources whose scores come with each `score` call
        (`model_scores`), computed by the caller (the trainer's megatron reward models).
        score_fn: a Python callable `fn(data_source, response, ground_truth, extra_info)` in
        place of reward.custom_fn (the Python API's reward_fn; reward.num_workers=0)."""
        sources = list(cfg.sources) or [RewardSourceConfig(name="rule", weight=1.0, type="rule")]
        return cls(cfg, sources, dict(reward_models or {}), scored_outside, score_fn)

    # ---- scoring -----------------------------------------------------------------------------

    def _target(self, source: _Source, row: Mapping[str, Any]) -> str:
        """Scorer key (pool) or 'model:<name>' for one source and one sample."""
        if source.type == "custom":
            return "source:" + source.name
        if source.type in ("reward_model", "environment"):
            return "model:" + source.name
        target = None
        if self.cfg.route_by:
            value = self._route_value(row)
            target = self.cfg.routes.get(value) if value is not None else None
            target = target or self.cfg.default_route
        if target is None:
            return self._fallback_key
        resolved = self._route_targets[target]
        if resolved in self._models or resolved in self._scored_outside:
            return "model:" + resolved
        return "source:" + resolved if not resolved.startswith("builtin:") else resolved

    def _route_value(self, row: Mapping[str, Any]) -> Optional[str]:
        value = row.get(self.cfg.route_by)
        return None if value is None else str(value)

    def route_metrics(self, routes: Sequence[Optional[str]],
                      totals: Sequence[float]) -> dict[str, float]:
        """route_metrics (below) with reward.route_by set, else none."""
        return route_metrics(routes, totals) if self.cfg.route_by else {}

    def extra_keys(self) -> dict[str, Optional[frozenset]]:
        """Source name -> the extra keys its scorers may return (`acc` of a source `rule` is the
        extra "rule/acc"), or None where user code scores it (any key): what a group filter's
        metric may name (rollout/group_filter.resolve_metric). A rule source is scored by its
        fallback scorer and by every route target."""
        out: dict[str, Optional[frozenset]] = {}
        for source in self.sources:
            if source.type != "rule":
                out[source.name] = None if source.type == "custom" else frozenset()
                continue
            keys: Optional[frozenset] = frozenset()
            routed = self._route_targets.values() if self.cfg.route_by else ()
            for target in (self._fallback_key, *routed):
                if target == "dispatch" or target.startswith("builtin:"):
                    keys = keys | EXTRAS
                elif target not in self._models and target not in self._scored_outside:
                    keys = None  # custom_fn / custom_cls / a custom source: user code
                    break
            out[source.name] = keys
        return out

    @property
    def needs_prompts(self) -> bool:
        """Whether score() needs the prompt texts: a batch class reads batch["prompts"]."""
        return bool(self._batch_keys)

    def check_dataset(self, dataset) -> None:
        """Fail before training if some sample would reach the built-in dispatch with a
        data_source it does not know (every such sample would silently get the fallback)."""
        if self._fallback_key != "dispatch":
            return
        columns = ["data_source"] + ([self.cfg.route_by] if self.cfg.route_by else [])
        unknown = set()
        for combo in dataset.distinct(columns):
            row = dict(zip(columns, combo))
            if any(self._target(s, row) == "dispatch" for s in self.sources if s.type == "rule"):
                if row["data_source"] not in SCORERS:
                    unknown.add(row["data_source"])
        if unknown:
            raise ValueError(
                f"no reward for data_source {sorted(unknown, key=str)} in {', '.join(dataset.files)}"
                f"{unknown_source_hint(unknown)}: the built-in scorers know {sorted(SCORERS)}; "
                f"set reward.custom_fn, or route these "
                f"rows with reward.route_by / reward.routes / reward.default_route")

    @staticmethod
    def scorer_args(response: str, row: Mapping[str, Any]) -> tuple:
        """(data_source, response, ground_truth, extra_info) for one sample."""
        reward_model = row.get("reward_model") or {}
        extra = dict(row.get("extra_info") or {})
        for name, value in row.items():
            if name not in _ROW_FIELDS and name not in extra:
                extra[name] = value
        return row.get("data_source"), response, reward_model.get("ground_truth"), extra

    def score(self, responses: Sequence[str], rows: Sequence[Mapping[str, Any]],
              prompt_ids: Optional[Sequence[Sequence[int]]] = None,
              response_ids: Optional[Sequence[Sequence[int]]] = None,
              indices: Optional[Sequence[int]] = None,
              prompts: Optional[Sequence[str]] = None,
              model_scores: Optional[Mapping[str, Sequence[float]]] = None) -> RewardOutput:
        """Score a batch: responses [batch] decoded texts, rows [batch] the samples' dataset rows
        (PromptBatch.rows, repeated per response); token ids are needed by reward-model sources
        given as objects, prompts [batch] (decoded texts) by batch classes (needs_prompts).
        indices [batch]: the samples' numbers in the step's batch, for messages (default 0..).
        model_scores: source name -> [batch] scores of the `scored_outside` sources."""
        n = len(responses)
        if len(rows) != n:
            raise ValueError(f"{n} responses but {len(rows)} rows")
        outcomes: dict[str, list[Optional[Outcome]]] = {s.name: [None] * n for s in self.sources}
        scorer_of: dict[tuple[str, int], str] = {}  # (source, sample) -> scorer key, for messages
        calls, call_slots = [], []  # pool items, and the (source, sample)s each one scores
        batched: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
        model_slots: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
        for i, (response, row) in enumerate(zip(responses, rows)):
            args = None
            for source in self.sources:
                target = scorer_of[(source.name, i)] = self._target(source, row)
                if target.startswith("model:"):
                    model_slots[target[len("model:"):]].append((source.name, i))
                elif target in self._batch_keys:
                    batched[target].append((source.name, i))
                else:
                    args = args or self.scorer_args(response, row)
                    calls.append((target, args))
                    call_slots.append([(source.name, i)])
        for key, slots in batched.items():
            calls.append((key, (self._batch(key, [i for _, i in slots], responses, rows, prompts),)))
            call_slots.append(slots)
        for slots, result in zip(call_slots, self._run(calls, [len(s) for s in call_slots])):
            # a batch call that timed out or killed its worker has one Outcome, for each sample
            for (name, i), outcome in zip(slots, result if isinstance(result, list)
                                          else [result] * len(slots)):
                outcomes[name][i] = outcome
        for model_name, slots in model_slots.items():
            self._score_model(model_name, slots, outcomes, prompt_ids, response_ids, model_scores, n)
        out = self._combine(outcomes, rows, scorer_of, list(indices or range(n)))
        out.routes = [self._route_value(row) for row in rows] if self.cfg.route_by else []
        return out

    def _batch(self, key: str, idx: list[int], responses, rows, prompts) -> custom.RewardBatch:
        if prompts is None or len(prompts) != len(responses):
            raise ValueError(f"{self._labels[key]} is a batch reward class: pass prompts (the "
                             f"{len(responses)} decoded prompt texts) to RewardManager.score")
        return custom.build_batch([prompts[i] for i in idx], [responses[i] for i in idx],
                                  [rows[i] for i in idx])

    def _run(self, calls: list[tuple[str, tuple]], sizes: list[int]) -> list:
        if self._pool is not None:  # a watchdog's stop names the user's code, not only the pool
            with doing(f"running {', '.join(sorted({self._labels[key] for key, _ in calls}))}"):
                return self._pool.map(calls, sizes)
        results = []
        with exit_raises_in_this_thread(_SCORER_EXIT):
            for key, args in calls:  # with no time limit here, a scorer that blocks is named
                with doing(f"running {self._labels[key]} in this process (reward.num_workers=0: "
                           "no reward.timeout_s)"):
                    results.append(run_item(self._fns[key], args))
        return results

    def _score_model(self, model_name, slots, outcomes, prompt_ids, response_ids, model_scores,
                     n) -> None:
        if model_name in self._scored_outside:  # the trainer's megatron reward models
            given = (model_scores or {}).get(model_name)
            if given is None or len(given) != n:
                raise ValueError(f"reward model {model_name!r} is scored outside the manager: "
                                 f"pass its {n} scores as model_scores[{model_name!r}]")
            for name, i in slots:
                outcomes[name][i] = (checked(given[i]) if given[i] is not None else Outcome(
                    "invalid", error=f"{model_name!r}: the sampling gave this trajectory no "
                    "reward (an agent loop whose run returned none, or that ended at its "
                    "limits before returning)"))
            return
        if prompt_ids is None or response_ids is None:
            raise ValueError(f"reward source {model_name!r} is a reward model: pass prompt_ids "
                             f"and response_ids to RewardManager.score")
        idx = [i for _, i in slots]
        got = list(self._models[model_name].score_batch([prompt_ids[i] for i in idx],
                                                        [response_ids[i] for i in idx]))
        if len(got) != len(idx):
            raise ValueError(f"reward model {model_name!r} returned {len(got)} scores for "
                             f"{len(idx)} sequences")
        for (name, i), value in zip(slots, got):
            outcomes[name][i] = checked(value)

    def _combine(self, outcomes, rows, scorer_of, indices) -> RewardOutput:
        n, fallback = len(rows), float(self.cfg.fallback_score)
        counts: collections.Counter = collections.Counter()
        first = first_error = None  # (sample, source name) in sample order
        source_scores, extras, failed = {}, {}, [False] * n
        for source in self.sources:
            scores = []
            for i, o in enumerate(outcomes[source.name]):
                counts[o.status] += 1
                if o.status != "ok":
                    failed[i] = True
                    first = min(first or (i, source.name), (i, source.name))
                    if o.status == "error":
                        first_error = min(first_error or (i, source.name), (i, source.name))
                scores.append(o.score if o.status == "ok" else fallback)
                for k, v in o.extras.items():
                    extras.setdefault(f"{source.name}/{k}", [None] * n)[i] = v
            source_scores[source.name] = scores

        def describe(i: int, name: str) -> str:
            o, key = outcomes[name][i], scorer_of[(name, i)]
            return (f"sample {indices[i]} (data_source={rows[i].get('data_source')!r}), source "
                    f"{name!r}, scorer {self._labels[key]}: {o.status}: {_last_line(o.error)}"
                    f"{_raised_at(o.error, self._files.get(key))}")

        # A dead worker is worth a line of its own (its sample, its exit code), a few per batch.
        crashed = [(i, s.name) for i in range(n) for s in self.sources
                   if outcomes[s.name][i].exit_code is not None]
        for i, name in crashed[:_CRASHES_LOGGED]:
            logger.warning("reward: %s", describe(i, name))
        if len(crashed) > _CRASHES_LOGGED:
            logger.warning("reward: %d more reward workers died in this batch",
                           len(crashed) - _CRASHES_LOGGED)
        first_failure = None
        if first is not None:
            first_failure = (indices[first[0]], describe(*first))
            logger.warning("reward: %d of %d samples failed in this batch (%d errors, %d timeouts, "
                           "%d invalid values), scored %s (reward.fallback_score); the first: %s",
                           sum(failed), n, counts["error"], counts["timeout"], counts["invalid"],
                           fallback, first_failure[1])
        if first_error is not None and not self._logged_first_error:
            self._logged_first_error = True
            i, name = first_error
            logger.error("reward: the first scorer error of the run (later ones are only counted "
                         "and named): %s\n%s", describe(i, name), outcomes[name][i].error)
        total = [sum(s.weight * source_scores[s.name][i] for s in self.sources) for i in range(n)]
        # COUNT_METRICS: counts of samples, summed where batches or slices of one are merged
        metrics = {"reward/score/mean": _mean(total), "reward/errors": float(counts["error"]),
                   "reward/timeouts": float(counts["timeout"]),
                   "reward/invalid": float(counts["invalid"])}
        for name, scores in source_scores.items():
            metrics[f"reward/{name}/mean"] = _mean(scores)
        for name, values in extras.items():
            metrics[f"reward/{name}/mean"] = _mean([v for v in values if v is not None])
        return RewardOutput(total, source_scores, extras, failed, metrics, first_failure)

    def check_failures(self, failed: int, total: int,
                       first_failure: Optional[tuple[int, str]]) -> None:
        """Stop the run (RewardFailureError) when more than reward.max_failed_fraction of a
        batch's `total` samples failed; the counts are the whole batch's, so every rank that
        calls this with the gathered counts stops together."""
        limit = self.cfg.max_failed_fraction
        if total and failed / total > limit:
            raise RewardFailureError(
                f"{failed} of {total} samples of this batch failed to score, more than "
                f"reward.max_failed_fraction={limit}; the first: "
                f"{first_failure[1] if first_failure else '?'}. Fix the reward function (the log "
                "above has its first traceback), or raise reward.timeout_s / "
                "reward.max_memory_mb if those are the cause, or reward.max_failed_fraction "
                "(1.0: never stop) if such failures are expected")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fallback_specs(cfg: RewardConfig, score_fn: Optional[Callable] = None) -> dict[str, ScorerSpec]:
    """The scorer of the rule source's samples that no route takes: reward.custom_fn (a
    function), reward.custom_cls (a class) or `score_fn` (a Python callable); none means the
    built-in dispatch."""
    fn, cls = cfg.custom_fn, cfg.custom_cls
    if score_fn is not None:
        if fn.path or fn.name or cls.path or cls.name:
            raise ValueError("a Python reward function and reward.custom_fn / reward.custom_cls "
                             "are both set: they are the same scorer; keep one")
        name = getattr(score_fn, "__qualname__", type(score_fn).__name__)
        where = getattr(getattr(score_fn, "__code__", None), "co_filename", "Python")
        return {"custom_fn": ScorerSpec("object", "reward_fn", function=name, path=where,
                                        obj=score_fn, accepts="function")}
    if (fn.path or fn.name) and (cls.path or cls.name or cls.kwargs):
        raise ValueError(f"reward.custom_fn ({fn.name} in {fn.path}) and reward.custom_cls "
                         f"({cls.name} in {cls.path}) are both set: they are the same scorer, "
                         "a function or a class; keep one")
    if fn.path or fn.name:
        return {"custom_fn": ScorerSpec("custom", "reward.custom_fn", path=fn.path,
                                        function=fn.name, kwargs=dict(cfg.custom_fn_kwargs),
                                        accepts="function")}
    if cls.path or cls.name or cls.kwargs:
        return {"custom_cls": ScorerSpec("custom", "reward.custom_cls", path=cls.path,
                                         function=cls.name, kwargs=dict(cls.kwargs),
                                         accepts="class")}
    return {}


NO_ROUTE = "<none>"  # the route bucket of samples whose row has no reward.route_by value


def route_metric_name(value: Optional[str]) -> str:
    """A route value as a metric-name fragment (utils/metric_names.name_fragment: itself when
    it is a safe name, else unique and safe); None (no value) -> NO_ROUTE."""
    return NO_ROUTE if value is None else name_fragment(value)


def route_metrics(routes: Sequence[Optional[str]], totals: Sequence[float]) -> dict[str, float]:
    """reward/route/<value>/mean (the mean total score of the samples with that reward.route_by
    value) and reward/route/<value>/count; routes [batch] and totals [batch] are the WHOLE
    batch's, gathered from every rank: means of per-rank means would weigh a rank's few samples
    of a value like another rank's many."""
    if len(routes) != len(totals):
        raise ValueError(f"route_metrics: {len(routes)} route values for {len(totals)} scores")
    by_route: dict[str, list[float]] = collections.defaultdict(list)
    for value, total in zip(routes, totals):
        by_route[route_metric_name(value)].append(float(total))
    metrics = {}
    for name, values in sorted(by_route.items()):
        metrics[f"reward/route/{name}/mean"] = _mean(values)
        metrics[f"reward/route/{name}/count"] = float(len(values))
    return metrics


# The reward metrics that count samples (RewardManager.score's, Scorer.score's reward/failed): the
# count of a batch is the sum of its slices' (ranks) or parts' (generation batches).
COUNT_METRICS = ("reward/errors", "reward/timeouts", "reward/invalid", "reward/failed")


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _raised_at(error: str, path: Optional[str]) -> str:
    """' (raised at line 7 of rewards.py, in boolean)': the innermost frame of the scorer's file
    in a traceback, or ''."""
    if not path:
        return ""
    frames = re.findall(r'File "(.*?)", line (\d+), in (\S+)', error)
    mine = [(line, fn) for file, line, fn in frames if file == path]
    if not mine:
        return ""
    line, fn = mine[-1]
    return f" (raised at line {line} of {os.path.basename(path)}, in {fn})"
