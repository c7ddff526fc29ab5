"""Scoring a rollout batch: rule, custom and reward-model scores of every sample, on every rank.

The reward models score the whole batch on their set (every rank of it together); the rule and
custom scorers split the batch over the training ranks, each a slice, then all-gather, so every
rank holds the same [B] scores, the scorers' extras and the metrics. A rollout set of its own
(placement.rollout) scores nothing: it samples the next batch meanwhile.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.distributed as dist

from verl_mcore.algo.overlong import overlong_scores
from verl_mcore.reward.manager import COUNT_METRICS
from verl_mcore.rollout.batch import Rollout
from verl_mcore.tracking import MetricAccumulator

log = logging.getLogger("verl_mcore.scoring")


class Scorer:
    """cfg: the run's Config (reward.overlong_buffer shapes training scores); rewards: the
    RewardManager (rule / custom sources); reward_models: name -> the reward model built on this
    rank (empty where the reward models' set does not run); names: every reward model's name, on
    every rank (the exchanges of their scores); place: the run's RolePlacement; tokenizer:
    decodes the prompts a batch reward class reads."""

    def __init__(self, cfg, rewards, reward_models: dict, names: list, place, tokenizer, device,
                 rank: int):
        self.cfg, self.rewards, self.reward_models, self.names = cfg, rewards, reward_models, names
        self.place, self.tokenizer, self.device, self.rank = place, tokenizer, device, rank

    def score(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float], dict[str, list]]:
        """Rule / custom / model scores [B] on the training device: the reward models score the
        whole batch on every rank together; each rank scores a slice with the other sources,
        then all-gather. Also the metrics, and the scorers' extras of the whole batch
        ("source/key" -> [B] float or None, RewardOutput.extras) on every rank."""
        n = len(rollout.responses)
        # Split over the training ranks (a rollout set of its own samples meanwhile).
        scorers = self.place.training_ranks
        mine = list(range(scorers.index(self.rank), n, len(scorers)))
        model_scores = {  # on the reward models' set, then on every rank
            name: self.place.on("reward_model", lambda name=name: self.reward_models[name].score(
                rollout.train, rollout.rows, rollout.responses), [n]).cpu()
            for name in self.names}
        outside = {k: v[mine].tolist() for k, v in model_scores.items()}
        if self.rewards.environment_sources:  # the rewards the sampling gave (None: none)
            sampled = [None if math.isnan(v) else v for v in rollout.sampled_rewards.tolist()]
            outside.update({name: [sampled[i] for i in mine]
                            for name in self.rewards.environment_sources})
        ids = rollout.token_ids(mine) if self.rewards.needs_token_ids else (None, None)
        prompts = None
        if self.rewards.needs_prompts:  # a batch reward class reads the prompts the model saw
            prompts = rollout.prompt_texts(self.tokenizer, mine)
        out = self.rewards.score([rollout.responses[i] for i in mine], [rollout.rows[i] for i in mine],
                                 *ids, indices=mine, prompts=prompts,
                                 model_scores=outside)
        part = (mine, out.scores, out.source_scores, out.failed, out.first_failure, out.routes,
                out.extras, out.metrics)
        gathered: list = [None] * len(scorers)
        dist.all_gather_object(gathered, part, group=self.place.training)
        scores = torch.zeros(n)
        per_source: dict[str, torch.Tensor] = {}
        failed, firsts, routes, extras = 0, [], [None] * n, {}
        for idx, s, sources, f, first, r, extra, _ in gathered:
            scores[idx] = torch.tensor(s, dtype=torch.float32)
            for i, value in zip(idx, r):
                routes[i] = value
            for name, values in extra.items():
                for i, value in zip(idx, values):
                    extras.setdefault(name, [None] * n)[i] = value
            for name, values in sources.items():
                per_source.setdefault(name, torch.zeros(n))[idx] = torch.tensor(values, dtype=torch.float32)
            failed += sum(f)
            firsts += [first] if first else []
        # The whole batch's count on every rank: all stop together (reward.max_failed_fraction).
        self.rewards.check_failures(failed, n, min(firsts, default=None))
        # The whole batch's metrics from the slices': counts summed; a mean weighed by the
        # slices' samples, over the slices that have it (a slice without a sample that has some
        # extra has no metric of it: every rank adds every slice's names); an extra's mean then
        # recomputed over the samples that have it, from the gathered values.
        acc = MetricAccumulator()
        for name in dict.fromkeys(k for p in gathered for k in p[-1]):
            if name not in COUNT_METRICS:
                have = name in out.metrics
                acc.add_mean(name, out.metrics[name] if have else 0.0,
                             weight=max(1, len(mine)) if have else 0.0)
        metrics = dict(acc.reduce(group=self.place.training))
        for name in COUNT_METRICS:
            if any(name in p[-1] for p in gathered):
                metrics[name] = float(sum(p[-1].get(name, 0.0) for p in gathered))
        for name, values in per_source.items():
            metrics[f"reward/{name}/mean"] = float(values.mean())
        for name, values in extras.items():
            have = [float(v) for v in values if v is not None]
            metrics[f"reward/{name}/mean"] = sum(have) / len(have) if have else 0.0
        for name, values in model_scores.items():  # the whole batch's, on every rank
            stats = {"mean": values.mean(), "std": values.std(unbiased=False), "min": values.min(),
                     "max": values.max()}
            metrics.update({f"reward/{name}/{k}": float(v) for k, v in stats.items()})
            if self.rank == 0:
                log.info("reward model %s: %s", name, " ".join(f"{k} {float(v):.4g}" for k, v in stats.items()))
        metrics["reward/failed"] = float(failed)
        # From the gathered per-sample values: exact over the whole batch, however it was split.
        metrics.update(self.rewards.route_metrics(routes, scores.tolist()))
        return scores.to(self.device), metrics, extras

    def train_scores(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float], dict[str, list]]:
        """`score` of a batch to train on: with reward.overlong_buffer, DAPO's soft overlong
        penalty added to each sample's score (algo/overlong.py; validation scores stay
        unshaped)."""
        scores, metrics, extras = self.score(rollout)
        scores, overlong_metrics = overlong_scores(self.cfg, rollout, scores)
        metrics.update(overlong_metrics)
        return scores, metrics, extras

    def scores_of(self, rollout: Rollout, baseline: Optional[Rollout] = None, n: int = 1):
        """The learner's `score` of `rollout`: () -> (scores [B], metrics, ReMax baselines [B] or
        None): the greedy `baseline` response of each prompt scored (shaped alike) and repeated
        for its n samples."""
        def score():
            scores, metrics, _ = self.train_scores(rollout)
            if baseline is None:
                return scores, metrics, None
            return scores, metrics, self.train_scores(baseline)[0].repeat_interleave(n)
        return score
