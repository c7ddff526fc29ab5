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

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_mcore.rollout.batch import Rollout, rollout_from_part
from verl_mcore.rollout.gather import _cut
from verl_mcore.rollout.token_fields import TOKEN_FIELDS


@dataclass
class Sampled:
    """One prompt batch's samples (rollout.gather.RolloutPart), the ReMax baseline's when the
    algorithm has one, and the weights they were sampled with (`version`: steps completed)."""

    index: int
    version: int
    part: Any
    baseline: Any = None

    def rollouts(self, info) -> tuple[Rollout, Optional[Rollout]]:
        """The batch and its ReMax baseline (None without one) as Rollouts, on the host; `info`:
        the actor's ModelInfo (its tokenizer decodes the responses)."""
        baseline = None
        if self.baseline is not None:
            baseline = rollout_from_part(self.baseline, self.baseline.prompt_of, info)
        return rollout_from_part(self.part, self.part.prompt_of, info), baseline


class Producer:
    """The step's rollout batch: samples with `sampler` (sampler.py) the prompt batches `loader`
    draws, `ahead` of the batch trained on (rollout.max_staleness in one_step_off, else 0).
    `make_room()` frees the training state's memory for generation (the learner's offload).
    Every rank calls it alike."""

    def __init__(self, sampler, loader, place, cfg, make_room, ahead: int):
        self.sampler, self.loader, self.place, self.cfg = sampler, loader, place, cfg
        self.make_room = make_room
        self.ahead = ahead  # k: batches sampled ahead of the one trained on
        self.queue: deque[Sampled] = deque()  # training ranks: sampled, not yet trained on
        self.count = 0  # batches sampled (generating ranks) or received (the others) so far
        self.prompts: deque = deque()  # drawn, not yet sampled: (loader state before, batch)
        self.loader_before: deque = deque()  # the loader's state before each queued batch
        # An error of this rank's part (the weights' way to the engine, a training phase) not
        # yet told to the others: the next hand-over of a batch carries it to every rank.
        self.failure: Optional[BaseException] = None

    # ------------------------------------------------------------------ the step

    def take(self, step: int, phase) -> tuple[Optional[Sampled], dict[str, float]]:
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
        self._advance(step + (self.ahead if generates else 0), step, phase)
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
        self._advance(step + self.ahead, step, phase)
        return {}

    def _advance(self, until: int, step: int, phase) -> None:
        """Sample (or receive) batches until `until` of them exist; the weights are those the
        engine holds now, the version step - 1. Phases: `gen` is the engine's sampling;
        `wait_rollout` the time a rank waits for another set's batch (not busy time: the
        per-set utilisation leaves it out, RolePlacement.gather_metrics)."""
        s = self.sampler
        # Handing the batch over is waiting on a rollout set of its own (its receivers are busy
        # training) and on every rank that receives; on the training ranks that sampled it, part
        # of generating.
        hand_over = "gen" if s.generates and self.place.trains else "wait_rollout"
        while self.count < until:
            before, prompts = self._next_prompts()
            index = self.count + 1
            parts = []
            for sampling in self._samplings(index):
                batch, failure, self.failure = None, self.failure, None
                if s.generates:  # after an earlier failure it only agrees it
                    with phase("gen"):
                        batch, failure = s.sample_part(prompts, sampling, failure)
                with phase(hand_over):
                    parts.append(s.share_part(prompts, batch, failure))
            self.count = index
            if self.place.trains:
                self.queue.append(Sampled(index, step - 1, *parts))
                self.loader_before.append(before)

    def _samplings(self, index: int) -> list:
        """How batch `index` is sampled: its rollout.n responses per prompt, and ReMax's greedy
        baseline (one per prompt) where the algorithm has one."""
        s, r = self.sampler, self.cfg.rollout
        out = [s.sampling(r.n, r.temperature, index - 1)]
        if self.cfg.algorithm.adv_estimator == "remax":
            out.append(s.sampling(1, 0.0, index - 1, seed_offset=1))
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
        return {"loader": loader, "queue": [_save(s) for s in self.queue]}

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
                self.queue.append(_load(saved, prompts.rows))
                self.loader_before.append(before)
        self.count = step + len(state.get("queue", []))


def _save(s: Sampled) -> dict:
    out = {"index": s.index, "version": s.version, "part": _part_tensors(s.part)}
    if s.baseline is not None:
        out["baseline"] = _part_tensors(s.baseline)
    return out


def _part_tensors(part) -> dict:
    """A RolloutPart without its dataset rows (they come from the loader), as plain tensors:
    each per-token field it carries under its declared name (rollout/token_fields.py)."""
    return {"integers": part.integers(), "tokens": part.tokens(),
            "sizes": torch.tensor([len(part.prompt_lens), part.num_samples,
                                   part.prompt_ids.numel()], dtype=torch.int64),
            "token_fields": {name: part.token_fields[name] for name in TOKEN_FIELDS
                             if name in part.token_fields}}


def _load(saved: dict, rows) -> Sampled:
    def part(d):
        prompts, samples, prompt_tokens = d["sizes"].tolist()
        fields = dict(d.get("token_fields", {}))
        if "logprobs" in d:  # a checkpoint from before the fields were declared
            fields["logprobs"] = d["logprobs"]
        try:
            return _cut(d["integers"], d["tokens"], list(rows[:prompts]), prompts, samples,
                        prompt_tokens, fields)
        except ValueError as e:
            index = int(saved["index"])
            raise ValueError(f"the checkpoint's batch {index} sampled ahead: {e}") from e

    return Sampled(int(saved["index"]), int(saved["version"]), part(saved["part"]),
                   part(saved["baseline"]) if "baseline" in saved else None)
