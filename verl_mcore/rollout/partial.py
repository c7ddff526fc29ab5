"""Partial (interruptible) rollouts on one generation replica: prompt groups that stay in flight
across weight updates (rollout.partial; the producer is partial_rollouts.py).

    pool = PartialPool(n, max_new_tokens, max_staleness, in_flight, logprobs)
    pool.add(serial, prompt_ids, row, keys)      # drawn prompts, oldest first
    with phase.serving(sampling, ...) as (server, _):
        step = pool.run(server, need, version)   # this step's sampling over the engine
    step.taken                                   # the `need` oldest finished groups: trained

One step of `run`, with the weights of policy version `version`:

1. Staleness. A sample whose oldest token is more than `max_staleness` versions older than
   `version` loses its tokens and starts again from its prompt (fresh tokens, same random
   key, draws 0): every token that trains is at most `max_staleness` versions old, a finished
   sample waiting for its group included.
2. The `in_flight` oldest groups are active; every unfinished sample of theirs is submitted,
   oldest group first: its prompt and tokens so far as the context (the engine recomputes their
   KV), its random stream continued where it stopped (key, draws = tokens so far), the rest of
   the token budget.
3. The engine runs round after round until `need` active groups are finished (every sample
   stopped or hit the length limit). The decision counts groups, never clocks: a seeded run
   makes the same decisions every time, and every rank of a TP_g group makes the same calls.
4. The rest is aborted (Server.abort): each sample keeps its tokens, each token the version
   that sampled it, and continues at the next step with the next weights.
5. The `need` oldest finished groups leave the pool (`taken`); finished groups beyond them
   wait for the next step, whose staleness check sees them too.

The pool belongs to one replica; the producer draws its prompts (whole loader batches, in step
on every replica) and gathers the replicas' taken groups into the step's batch.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from verl_mcore.rollout.base import OWN_TOKEN_FIELDS, SampleOutput
from verl_mcore.rollout.serving import Request, Server


@dataclasses.dataclass
class PartialSample:
    """One sample of a group: its random stream's key, the tokens it has (their engine log-probs
    when asked for, the policy version of each, the engine's other per-token fields: extras,
    chunks [n, *shape] by name), and why it finished (None: not yet)."""

    key: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: Optional[list[float]] = None
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: Optional[str] = None
    extras: dict = dataclasses.field(default_factory=dict)

    def reset(self, logprobs: bool) -> None:
        self.tokens, self.versions, self.finish, self.extras = [], [], None, {}
        self.logprobs = [] if logprobs else None


@dataclasses.dataclass
class PartialGroup:
    """A prompt's n samples. serial: the prompt's place in the run's stream of drawn prompts
    (loader batch x train_batch_size + its place in the global batch): the age order, and how a
    resumed run finds its dataset row again."""

    serial: int
    prompt: list[int]
    row: Any
    samples: list[PartialSample]

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.samples)


@dataclasses.dataclass
class PartialStep:
    """What a step's `run` did: the groups it hands to training (oldest first), its counts
    (rollout/partial/* metrics of this replica), and the samples that ran from their prompt
    to the end within this step with the engine's log-probs, as (prompt ids, SampleOutput) for
    the weight-sync check."""

    taken: list[PartialGroup]
    counts: dict[str, float]
    fresh: list[tuple[list[int], SampleOutput]]


class PartialPool:
    """The prompt groups of one replica not yet trained on, oldest first (module docstring).

    n: samples per prompt; max_new_tokens: the response budget of a sample over all its steps;
    max_staleness: versions a trained token may lag the weights that sample next; in_flight:
    groups sampled at once; logprobs: keep the engine's log-probs (the learner weighs them)."""

    def __init__(self, n: int, max_new_tokens: int, max_staleness: int, in_flight: int,
                 logprobs: bool):
        if in_flight < 1 or max_staleness < 0:
            raise ValueError(f"PartialPool: in_flight={in_flight} (>= 1), "
                             f"max_staleness={max_staleness} (>= 0)")
        self.n, self.max_new_tokens = n, max_new_tokens
        self.max_staleness, self.in_flight, self.logprobs = max_staleness, in_flight, logprobs
        self.groups: list[PartialGroup] = []

    def add(self, serial: int, prompt: Sequence[int], row, keys: Sequence[int]) -> None:
        """A drawn prompt, after every group already held; `keys`: its n samples' streams."""
        if len(keys) != self.n:
            raise ValueError(f"PartialPool.add: {len(keys)} keys for n={self.n} samples")
        if self.groups and serial <= self.groups[-1].serial:
            raise ValueError(f"PartialPool.add: prompt {serial} drawn after {self.groups[-1].serial}")
        samples = [PartialSample(key=int(k)) for k in keys]
        for s in samples:
            s.reset(self.logprobs)
        self.groups.append(PartialGroup(serial, list(map(int, prompt)), row, samples))

    @property
    def longest_prompt(self) -> int:
        return max((len(g.prompt) for g in self.groups[:self.in_flight]), default=1)

    def run(self, server: Server, need: int, version: int) -> PartialStep:
        """One step's sampling over `server` with the weights of `version` (module docstring)."""
        if need > self.in_flight or need > len(self.groups):
            raise ValueError(f"PartialPool.run: {need} groups needed, {len(self.groups)} held, "
                             f"{self.in_flight} in flight at most")
        counts = dict.fromkeys(("resampled", "continued", "aborted", "waiting"), 0.0)
        oldest = version - self.max_staleness
        for group in self.groups:
            for s in group.samples:
                if s.versions and min(s.versions) < oldest:
                    s.reset(self.logprobs)
                    counts["resampled"] += 1
        active = self.groups[:self.in_flight]
        # finished at an earlier step, beyond what that step took
        counts["waiting"] = float(sum(g.finished for g in active))
        finished = sum(g.finished for g in active)
        running: dict[int, tuple[PartialGroup, int, bool]] = {}
        for group in active if finished < need else ():  # enough waiting: nothing to sample
            for j, s in enumerate(group.samples):
                if s.finish is not None:
                    continue
                fresh = not s.tokens
                counts["continued"] += not fresh
                rid = server.submit(Request(
                    group.prompt + s.tokens, key=s.key, draws=len(s.tokens),
                    max_new_tokens=self.max_new_tokens - len(s.tokens),
                    share=group.serial if fresh else None, prompt_index=group.serial,
                    sample_index=j))
                running[rid] = (group, j, fresh)
        fresh_outputs: list[tuple[list[int], SampleOutput]] = []
        while finished < need:
            if not server.busy:
                raise RuntimeError(f"PartialPool.run: the engine finished every request with "
                                   f"{finished} of the {need} groups needed done (a bug)")
            for rid, out in server.step():
                group, j, fresh = running.pop(rid)
                was = group.finished
                self._record(group.samples[j], out, version)
                finished += group.finished and not was
                if fresh and out.logprobs is not None:
                    fresh_outputs.append((group.prompt, out))
        for rid, out in server.abort():
            group, j, _ = running.pop(rid)
            self._record(group.samples[j], out, version)
            counts["aborted"] += 1
        done = [g for g in active if g.finished][:need]
        taken_ids = {id(g) for g in done}
        self.groups = [g for g in self.groups if id(g) not in taken_ids]
        counts["in_flight"] = float(len(active))
        return PartialStep(done, counts, fresh_outputs)

    def _record(self, sample: PartialSample, out: SampleOutput, version: int) -> None:
        """A request's new tokens, sampled with the weights of `version`."""
        sample.tokens += list(out.token_ids)
        sample.versions += [version] * len(out.token_ids)
        for name, values in out.extras.items():  # every request of an engine gives the same ones
            sample.extras.setdefault(name, []).append(torch.as_tensor(values))
        if self.logprobs:
            if out.logprobs is None or len(out.logprobs) != len(out.token_ids):
                raise RuntimeError("PartialPool: the engine returned no log-probs for a request "
                                   "that asked for them")
            sample.logprobs += list(out.logprobs)
        sample.finish = None if out.finish_reason == "aborted" else out.finish_reason

    # ------------------------------------------------------------------ as trajectories

    @staticmethod
    def outputs(groups: Sequence[PartialGroup]) -> list[SampleOutput]:
        """The samples of `groups` as SampleOutputs (prompt_index: the group's place in
        `groups`), each token with its version; an unfinished sample's finish is "aborted"."""
        return [SampleOutput(prompt_index=p, sample_index=j, token_ids=list(s.tokens),
                             logprobs=None if s.logprobs is None else list(s.logprobs),
                             finish_reason=s.finish or "aborted", versions=list(s.versions),
                             extras={k: torch.cat(v) for k, v in s.extras.items()})
                for p, g in enumerate(groups) for j, s in enumerate(g.samples)]

    def restore(self, groups: Sequence[tuple[int, list[int], Any, list[int]]], rollout) -> None:
        """The pool a checkpoint held: `groups` [(serial, prompt ids, row, keys)] oldest first,
        and `rollout` (rollout/batch.py Rollout) their samples as `outputs` laid them out."""
        self.groups = []
        ends = rollout.response_lens.cumsum(0).tolist()
        starts = [0] + ends[:-1]
        finish = rollout.finish
        versions = rollout.token_field("versions").tolist()
        logprobs = rollout.logprobs.tolist() if rollout.logprobs is not None else None
        tokens = rollout.response_ids.tolist()
        extras = {k: v for k, v in rollout.token_fields.items() if k not in OWN_TOKEN_FIELDS}
        if rollout.num_samples != len(groups) * self.n:
            raise ValueError(f"a checkpoint's partial rollouts hold {rollout.num_samples} samples "
                             f"for {len(groups)} prompts of rollout.n={self.n}")
        i = 0
        for serial, prompt, row, keys in groups:
            self.add(serial, prompt, row, keys)
            for s in self.groups[-1].samples:
                a, b = starts[i], ends[i]
                s.tokens, s.versions = tokens[a:b], versions[a:b]
                s.extras = {k: [v[a:b]] for k, v in extras.items()} if b > a else {}
                if self.logprobs:
                    if logprobs is None:
                        raise ValueError("a checkpoint's partial rollouts carry no engine "
                                         "log-probs, which this run weighs (rollout.tis_cap / "
                                         "rollout.correction)")
                    s.logprobs = logprobs[a:b]
                s.finish = None if finish[i] == "aborted" else finish[i]
                i += 1
