"""Which batch each step trains on, with which weights it was sampled, and when (rollout.mode).

Batch j is the j-th prompt batch of the loader and is trained on at step j; v_s are the actor's
weights after s steps (v_0 the initial ones). k = 0 in sync mode, rollout.max_staleness in
one_step_off.

    sync          step s: the engine receives v_{s-1}, samples B_s, every rank gets it, the
                  training ranks train on it. The engine runs on the actor's ranks (colocated,
                  time-shared with training) or on a rollout set of its own (placement.rollout).
    one_step_off  step s: the rollout set receives v_{s-1} and samples the batches up to
                  B_{s+k} (at step 1: B_1 .. B_{1+k}); meanwhile the training ranks train on B_s,
                  sampled during step s-k with v_{max(s-k-1, 0)}, and receive B_{s+k} at the end
                  of the step. A sample thus lags the weights it trains by at most k versions
                  (`rollout/staleness`); the actor recomputes its old log-probs (trainer), and
                  rollout.tis_cap weights each token by the truncated ratio against the engine's
                  own log-probs.

Every rank runs the same program: the ranks that hold the engine sample (`make`), the others
receive in the same order (Sampler.share_part shares each batch as tensors from the generating
set's first rank), so the exchanges meet without any rank waiting for a batch nobody sends. The
rollout set's ranks never join a training phase: their step is `take` and the metrics.

Checkpoints hold the batches sampled ahead (`state_dict`: their tokens, lengths, engine log-
probs and versions as tensors, with the loader's position before the first of them); a resumed
run draws those prompts again for their dataset rows and trains on the saved samples, so it
continues exactly as the run that was stopped (tests/e2e/test_rollout_set.py).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Optional

import torch

from verl_mcore.distributed.agree import decided_on_one_rank
from verl_mcore.reward.manager import COUNT_METRICS
from verl_mcore.rollout.batch import Rollout, response_pad
from verl_mcore.rollout.group_filter import (METRICS, FilterExhaustedError, GroupFilterError,
                                             GroupFilters)
from verl_mcore.rollout.prompt_group import groups_from_batch


class Producer:
    """The step's rollout batch: samples with `sampler` (sampler.py) the prompt batches `loader`
    draws, `ahead` of the batch trained on (rollout.max_staleness in one_step_off, else 0).
    `make_room()` frees the training state's memory for generation (the learner's offload);
    `scorer` scores the trained batches (scoring.py), `filters` the run's group filters. Every
    rank calls it alike."""

    def __init__(self, sampler, loader, place, cfg, make_room, ahead: int, scorer=None,
                 filters: Optional[GroupFilters] = None):
        self.sampler, self.loader, self.place, self.cfg = sampler, loader, place, cfg
        self.make_room = make_room
        # The scorer of the trained batches (scoring.py), and the group filters
        # (algorithm.filter_groups, rollout.group_filter): with a filter, each generation batch
        # is scored here and more are sampled until the step's batch is full.
        self.scorer, self.filters = scorer, filters or GroupFilters()
        self.generated = 0  # generation batches sampled so far (their sampling seeds)
        self.ahead = ahead  # k: batches sampled ahead of the one trained on
        self.queue: deque[Rollout] = deque()  # training ranks: sampled, not yet trained on
        self.count = 0  # batches sampled (generating ranks) or received (the others) so far
        self.prompts: deque = deque()  # drawn, not yet sampled: (loader state before, batch)
        self.loader_before: deque = deque()  # the loader's state before each queued batch
        # An error of this rank's part (the weights' way to the engine, a training phase) not
        # yet told to the others: the next hand-over of a batch carries it to every rank.
        self.failure: Optional[BaseException] = None

    @property
    def info(self):
        """The actor's ModelInfo (its tokenizer decodes the responses): the sampler's."""
        return self.sampler.info

    @property
    def device(self):
        """The training device, where the batches go: the scorer's."""
        return self.scorer.device

    # ------------------------------------------------------------------ the step

    def take(self, step: int, phase) -> tuple[Optional[Rollout], dict[str, float]]:
        """The batch step `step` trains on (None on the rollout set's ranks, which train nothing)
        after this rank's part of sampling: the weights of step - 1 to the engine, then every
        batch up to `step` (+ k ahead on the generating ranks)."""
        s = self.sampler
        metrics = dict(self.make_room())  # colocated: generation gets the memory
        generates = s.generates
        if generates or s.sends_weights:
            with phase("sync"):  # weights + the weight-sync check on the next batch's prompts
                first = self._peek_prompts() if generates else True
                try:
                    metrics.update(s.begin(step, first))
                except Exception as e:  # noqa: BLE001 - every rank raises it at the hand-over
                    self.failure = e
        metrics.update(self._advance(step + (self.ahead if generates else 0), step, phase))
        s.end()  # release the KV cache (and the weight buffer) before training
        metrics.update(s.stats())
        if not self.place.trains:
            return None, metrics
        sampled = self.queue.popleft()
        self.loader_before.popleft()
        assert sampled.index == step, f"batch {sampled.index} at step {step}"
        if self.ahead:  # versions the batch lags the weights it trains (0 in sync mode)
            metrics["rollout/staleness"] = float(step - 1 - sampled.version)
        return sampled, metrics

    def fill(self, step: int, phase, failure: Optional[BaseException] = None) -> dict[str, float]:
        """Training ranks, after the update: receive the batches sampled during this step (one
        ahead in one_step_off; nothing in sync). `failure`: the step's training failed here;
        the hand-over tells every rank (the rollout set is waiting in it)."""
        self.failure = failure or self.failure
        return self._advance(step + self.ahead, step, phase)

    def batch_of(self, sampled: Rollout):
        """(the batch to train on with the learner's view, on the training device; the learner's
        `score`: () -> (scores, reward metrics, ReMax baselines or None), None for a scored
        batch). A batch the producer scored to filter it brings its scores (its reward metrics
        came with the producer's); the others are scored when the learner asks (after its
        log-prob passes: placed, a reward set scores meanwhile)."""
        if sampled.scores is not None:
            return sampled, None
        baseline = None if sampled.greedy is None else sampled.greedy.for_learner(self.info)
        rollout = dataclasses.replace(sampled.for_learner(self.info), greedy=None).to(self.device)
        return rollout, self.scorer.scores_of(rollout, baseline, self.cfg.rollout.n)

    def _advance(self, until: int, step: int, phase) -> dict[str, float]:
        """Sample (or receive) batches until `until` of them exist; the weights are those the
        engine holds now, the version step - 1. Phases: `gen` is the engine's sampling;
        `wait_rollout` the time a rank waits for another set's batch (not busy time: the
        per-set utilisation leaves it out, RolePlacement.gather_metrics). The group filters'
        metrics, with a filter."""
        metrics: dict[str, float] = {}
        while self.count < until:
            index = self.count + 1
            if self.filters.enabled:  # sync mode only (config/validate.py)
                before, sampled, metrics = self._sample_filtered(index, step, phase)
            else:
                before, prompts = self._next_prompts()
                parts = [self._sample(prompts, sampling, phase) for sampling in self._samplings(index)]
                self.generated += 1
                sampled = dataclasses.replace(parts[0], index=index, version=step - 1,
                                              greedy=parts[1] if len(parts) > 1 else None)
            self.count = index
            if self.place.trains:
                self.queue.append(sampled)
                self.loader_before.append(before)
        return metrics

    def _sample(self, prompts, sampling, phase):
        """One prompt batch's samples on every rank (a flat Rollout), sampled by the generating set."""
        s = self.sampler
        # Handing the batch over is waiting on a rollout set of its own (its receivers are busy
        # training) and on every rank that receives; on the training ranks that sampled it, part
        # of generating.
        hand_over = "gen" if s.generates and self.place.trains else "wait_rollout"
        batch, failure, self.failure = None, self.failure, None
        if s.generates:  # after an earlier failure it only agrees it
            with phase("gen"):
                batch, failure = s.sample_part(prompts, sampling, failure)
        with phase(hand_over):
            return s.share_part(prompts, batch, failure)

    def _sample_filtered(self, index: int, step: int, phase):
        """DAPO's dynamic sampling (algorithm.filter_groups) and rollout.group_filter: sample
        and score generation batches, each of data.train_batch_size prompts drawn in turn, until
        that many prompt groups passed the filters (or algorithm.filter_groups.max_num_gen_batches
        were sampled), then train on the first of them (rollout/group_filter.py). Every rank
        scores the same gathered batches; the first training rank decides which groups pass, and
        every rank takes its decisions.
        (the loader's state before the step's first batch, the scored Rollout, its metrics)."""
        r = self.cfg.rollout
        kept = self.filters.accumulator(self.cfg.data.train_batch_size)
        batches, reward_metrics, before = [], [], None
        while not kept.done:
            drawn_before, prompts = self._next_prompts()
            before = drawn_before if before is None else before
            part = self._sample(prompts, self.sampler.sampling(r.n, r.temperature, self.generated),
                                phase)
            self.generated += 1
            rollout = dataclasses.replace(part, index=index, version=step - 1)
            rollout = rollout.for_learner(self.info).to(self.device)
            with phase("reward"):
                scores, metrics, extras = self.scorer.train_scores(rollout)
            # The responses' own lengths (the batch holds one masked token for an empty one).
            groups = groups_from_batch(rollout.group_ids, scores, rollout.responses, rollout.rows,
                                       rollout.finish, rollout.response_lens, extras,
                                       gen_batch=len(batches))
            # Decided on the first training rank, sent to the others (a user's filter may decide
            # or fail otherwise elsewhere: group_filter.py's docstring).
            reasons = decided_on_one_rank(
                lambda: kept.decide(groups), f"filtering the prompt groups of generation batch "
                f"{len(batches)} of step {step}", GroupFilterError, self.place.training)
            kept.add(groups, reasons)
            # Only the kept groups' samples stay, on the host: a step may take many generation
            # batches, and the engine's next one needs the device's memory. `where`: a kept
            # sample's place in the batch -> its place among them.
            idx = [i for g, reason in zip(groups, reasons) if reason is None for i in g.samples]
            where = {i: j for j, i in enumerate(idx)}
            batches.append((rollout.scored(scores, extras).select(idx).to("cpu"), where))
            reward_metrics.append((metrics, rollout.num_samples, extras))
            if not kept.kept and len(batches) >= self.loader.batches_per_epoch:
                # Without a limit (max_num_gen_batches=0) a filter that drops every group would
                # sample forever: a whole pass over the data kept nothing.
                raise FilterExhaustedError(
                    f"no prompt group passed the group filters in {len(batches)} generation "
                    f"batches, a whole pass over the training data (dropped: "
                    + ", ".join(f"{n} {why}" for why, n in kept.dropped.items() if n)
                    + "). Check the filters and the reward: a reward that gives every sample of "
                    "a prompt the same score leaves DAPO's filter nothing to keep")
        groups = self._whole_mini_batches(kept.take())
        pieces = []
        for b, (rollout, where) in enumerate(batches):  # the kept groups, in their order
            idx = [where[i] for g in groups if g.gen_batch == b for i in g.samples]
            if idx:
                pieces.append(rollout.select(idx))
        metrics = {**kept.metrics(), **_merged(reward_metrics)}
        metrics[METRICS + "trained_groups"] = float(len(groups))
        rollout = Rollout.concat(pieces, response_pad(self.info)).to(self.device)
        return before, rollout, metrics

    def _whole_mini_batches(self, groups: list) -> list:
        """`groups` cut to whole mini-batches of the actor's (and the critic's) updates, for a
        short batch (on_max_gen_batches=train); a full batch is whole already."""
        sizes = [self.cfg.actor.ppo_mini_batch_size]
        if self.cfg.uses_critic:  # null: the actor's
            sizes.append(self.cfg.critic.ppo_mini_batch_size or sizes[0])
        unit = math.lcm(*sizes)
        whole = len(groups) // unit * unit
        if whole == 0:
            raise FilterExhaustedError(
                f"{len(groups)} prompt groups kept, fewer than one mini-batch of {unit} "
                "(actor/critic ppo_mini_batch_size): nothing to train on. Raise "
                "algorithm.filter_groups.max_num_gen_batches (0: no limit) or check the filters "
                "(rollout/filter/dropped/* in metrics.jsonl)")
        return groups[:whole]

    def _samplings(self, index: int) -> list:
        """How batch `index` is sampled: its rollout.n responses per prompt, and ReMax's greedy
        baseline (one per prompt) where the algorithm has one. The seeds are those of the next
        generation batch (index - 1 in a run that never filtered; after filtered steps, a batch
        whose seeds no earlier batch drew)."""
        s, r = self.sampler, self.cfg.rollout
        out = [s.sampling(r.n, r.temperature, self.generated)]
        if self.cfg.algorithm.adv_estimator == "remax":
            out.append(s.sampling(1, 0.0, self.generated, seed_offset=1))
        return out

    def _next_prompts(self):
        if self.prompts:
            return self.prompts.popleft()
        before = self.loader.state_dict()
        return before, next(self.loader)

    def _peek_prompts(self):
        """The next batch's prompt ids, drawn now (the weight-sync check samples from them)."""
        if not self.prompts:
            before = self.loader.state_dict()
            self.prompts.append((before, next(self.loader)))
        return self.prompts[0][1].input_ids

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The loader's position before the first batch not yet trained on, and the batches
        sampled ahead (training ranks; the actor set's first rank writes it)."""
        loader = self.loader_before[0] if self.loader_before else self.loader.state_dict()
        return {"loader": loader, "queue": [s.state() for s in self.queue],
                "gen_batches": self.generated}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Continue after step `step`: the loader where the checkpoint had it, then the saved
        batches back in the queue with their prompts' rows drawn again (every rank draws them,
        the rollout set's to keep its loader in step)."""
        self.loader.load_state_dict(state["loader"])
        self.queue.clear(), self.loader_before.clear(), self.prompts.clear()
        for saved in state.get("queue", []):
            before = self.loader.state_dict()
            prompts = self.loader.next_global()  # the whole batch, whoever sampled which share
            if self.place.trains:
                self.queue.append(Rollout.from_state(saved, prompts.rows))
                self.loader_before.append(before)
        self.count = step + len(state.get("queue", []))
        # Older checkpoints (None): one generation batch a batch, as without a group filter.
        saved = state.get("gen_batches")
        self.generated = self.count if saved is None else int(saved)


def _merged(batches: list[tuple[dict, int, dict]]) -> dict[str, float]:
    """The reward metrics of a step's generation batches, each (its reward metrics, its samples,
    its scorers' extras "source/key" -> [samples] values or None), as those of all their
    samples: counts (COUNT_METRICS, `.../count`) summed, `.../min` and `.../max` over the
    batches, a reward model's `.../std` pooled with its `.../mean`, a mean weighed by what it is
    the mean of: a route's by its count, an extra's by its samples that have it, every other one
    (the total score, a source's, the overlong penalty) by the batch's samples."""
    out: dict[str, float] = {}
    weight: dict[str, float] = {}
    pooled: dict[str, list[tuple[float, float, float]]] = {}  # std key -> [(samples, mean, std)]
    for m, n, extras in batches:
        have = {f"reward/{k}/mean": sum(v is not None for v in values)
                for k, values in extras.items()}
        for k, v in m.items():
            v = float(v)
            if k in COUNT_METRICS or k.endswith("/count"):
                out[k] = out.get(k, 0.0) + v
            elif k.endswith("/min") or k.endswith("/max"):
                pick = min if k.endswith("/min") else max
                out[k] = pick(out[k], v) if k in out else v
            elif k.endswith("/std") and k[:-len("std")] + "mean" in m:
                pooled.setdefault(k, []).append((n, float(m[k[:-len("std")] + "mean"]), v))
            else:
                w = (m.get(k[:-len("mean")] + "count", n) if k.startswith("reward/route/")
                     else have.get(k, n))
                out[k] = out.get(k, 0.0) + v * w
                weight[k] = weight.get(k, 0.0) + w
    for k, w in weight.items():
        out[k] = out[k] / w if w else 0.0
    for k, parts in pooled.items():  # E[x^2] - E[x]^2 over every batch's samples
        total = sum(n for n, _, _ in parts)
        mean = sum(n * mu for n, mu, _ in parts) / total
        square = sum(n * (sd * sd + mu * mu) for n, mu, sd in parts) / total
        out[k] = math.sqrt(max(square - mean * mean, 0.0))
    return out
