"""Partial rollouts' pool (rollout/partial.py) over a scripted server, against schedules worked
out by hand: which groups finish and are taken, which samples are aborted with how many tokens,
which continue with which versions, which start over as too stale; and the native engine's
abort (rollout/native.py NativeServer.abort): tokens so far, slots and blocks back, and a
continuation from them that samples what the uninterrupted sample did."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_mcore.rollout import token_fields
from verl_mcore.rollout.base import SampleOutput
from verl_mcore.rollout.batch import Rollout
from verl_mcore.rollout.partial import PartialPool
from verl_mcore.rollout.serving import Request, Server

STOP = 0


def token(key: int, draw: int, length: int) -> int:
    """The scripted stream: draw `draw` of stream `key`; the stream stops at its `length`-th."""
    return STOP if draw == length - 1 else 1 + (key * 31 + draw) % 7


class ScriptedServer(Server):
    """Every live request samples one token a round (its stream's, `token`), `slots` at a
    time, admitted in submission order; stream `key` stops after lengths[key] tokens."""

    def __init__(self, lengths: dict[int, int], slots: int = 1000):
        self.lengths, self.slots = lengths, slots
        self.requests: list[Request] = []
        self.tokens: dict[int, list[int]] = {}
        self.open: list[int] = []
        self.rounds = 0

    def submit(self, request: Request) -> int:
        rid = len(self.requests)
        self.requests.append(request)
        self.tokens[rid] = []
        self.open.append(rid)
        return rid

    def _out(self, rid: int, finish: str) -> SampleOutput:
        r = self.requests[rid]
        return SampleOutput(r.prompt_index, r.sample_index, list(self.tokens[rid]),
                            [-0.5] * len(self.tokens[rid]), finish)

    def step(self):
        self.rounds += 1
        done = []
        for rid in list(self.open[:self.slots]):
            r, toks = self.requests[rid], self.tokens[rid]
            t = token(r.key, r.draws + len(toks), self.lengths[r.key])
            toks.append(t)
            if t == STOP or len(toks) >= r.max_new_tokens:
                self.open.remove(rid)
                done.append((rid, self._out(rid, "stop" if t == STOP else "length")))
        return done

    @property
    def busy(self) -> bool:
        return bool(self.open)

    def release(self, session) -> None:
        pass

    def abort(self):
        out = [(rid, self._out(rid, "aborted")) for rid in sorted(self.open)]
        self.open = []
        return out

    def stats(self):
        return {}


def stream(key: int, lengths: dict[int, int], max_new: int) -> list[int]:
    """The sample stream `key` gives when nothing interrupts it."""
    return [token(key, d, lengths[key]) for d in range(min(lengths[key], max_new))]


def _pool(in_flight=3, max_staleness=1, max_new=10, logprobs=True):
    return PartialPool(n=2, max_new_tokens=max_new, max_staleness=max_staleness,
                       in_flight=in_flight, logprobs=logprobs)


def _add(pool, serial, keys):
    pool.add(serial, [100 + serial, 101 + serial], {"row": serial}, keys)


# Keys are the streams; group g holds keys 10g and 10g + 1.
LENGTHS = {0: 3, 1: 4, 10: 8, 11: 2, 20: 5, 21: 5, 30: 2, 31: 9, 40: 1, 41: 3, 50: 2, 51: 2}


def test_a_step_stops_at_the_needed_groups_and_keeps_the_rest_with_their_versions():
    pool = _pool()
    for g in range(3):
        _add(pool, g, [10 * g, 10 * g + 1])
    server = ScriptedServer(LENGTHS)
    step = pool.run(server, need=2, version=0)
    # Rounds: g1's second sample stops at 2, g0 is done at 4 (lengths 3, 4), g2 at 5: stop.
    assert server.rounds == 5
    assert [g.serial for g in step.taken] == [0, 2]
    assert step.counts == {"resampled": 0, "continued": 0, "aborted": 1, "waiting": 0,
                           "in_flight": 3}
    [g1] = pool.groups
    long, short = g1.samples
    assert (long.tokens, long.versions, long.finish) == (stream(10, LENGTHS, 10)[:5], [0] * 5, None)
    assert (short.tokens, short.finish) == (stream(11, LENGTHS, 10), "stop")
    for g in step.taken:
        for j, s in enumerate(g.samples):
            assert s.tokens == stream(10 * g.serial + j, LENGTHS, 10) and s.versions == [0] * len(s.tokens)
            assert s.logprobs == [-0.5] * len(s.tokens)
    # The fresh samples (every one but the aborted) are offered to the weight-sync check.
    assert len(step.fresh) == 5

    # Step 2 with version 1: g1's long sample continues its stream where it stopped (draws 5)
    # and finishes after 3 more tokens; g3 (lengths 2, 9) is still running then.
    for g in (3, 4):
        _add(pool, g, [10 * g, 10 * g + 1])
    server = ScriptedServer(LENGTHS)
    step = pool.run(server, need=2, version=1)
    # g4 done at round 3 (lengths 1, 3), g1 at round 3: both in the same round.
    assert [g.serial for g in step.taken] == [1, 4]
    g1 = step.taken[0]
    assert g1.samples[0].tokens == stream(10, LENGTHS, 10)
    assert g1.samples[0].versions == [0] * 5 + [1] * 3
    assert server.requests[0].draws == 5 and server.requests[0].max_new_tokens == 5
    assert server.requests[0].token_ids == (101, 102, *stream(10, LENGTHS, 10)[:5])
    assert step.counts["continued"] == 1 and step.counts["aborted"] == 1  # g3's long sample
    [g3] = pool.groups
    assert g3.samples[0].finish == "stop" and g3.samples[1].versions == [1] * 3


def test_a_sample_older_than_max_staleness_starts_over_and_no_trained_token_is_older():
    pool = _pool(max_staleness=1)
    for g in range(3):
        _add(pool, g, [10 * g, 10 * g + 1])
    pool.run(ScriptedServer(LENGTHS), need=2, version=0)  # g1's long sample: 5 tokens of v0
    for g in (3, 4):
        _add(pool, g, [10 * g, 10 * g + 1])
    # The weights jump to version 2: g1's tokens of version 0 are 2 versions old. Both of its
    # samples start over: the finished short one too (it would train at age 2).
    server = ScriptedServer(LENGTHS)
    step = pool.run(server, need=2, version=2)
    assert step.counts["resampled"] == 2 and step.counts["continued"] == 0
    first = {r.key: r for r in server.requests}
    assert first[10].draws == 0 and first[10].token_ids == (101, 102) and first[10].share == 1
    for g in step.taken:
        for s in g.samples:
            assert min(s.versions) >= 2 - 1


def test_finished_groups_beyond_the_need_wait_and_are_taken_first_next_step():
    lengths = {0: 2, 1: 2, 10: 2, 11: 2, 20: 2, 21: 2, 30: 9, 31: 9}
    pool = _pool(in_flight=3)
    for g in range(3):
        _add(pool, g, [10 * g, 10 * g + 1])
    step = pool.run(ScriptedServer(lengths), need=2, version=0)
    assert [g.serial for g in step.taken] == [0, 1]
    assert pool.groups[0].finished  # g2 finished in the same round: it waits
    _add(pool, 3, [30, 31])
    server = ScriptedServer(lengths)
    step = pool.run(server, need=1, version=1)
    assert [g.serial for g in step.taken] == [2] and server.requests == []  # nothing sampled
    assert step.counts["waiting"] == 1


def test_the_oldest_groups_are_in_flight_and_a_restored_pool_continues_alike():
    pool = _pool(in_flight=2)
    for g in range(4):
        _add(pool, g, [10 * g, 10 * g + 1])
    server = ScriptedServer(LENGTHS)
    pool.run(server, need=1, version=0)
    assert {r.prompt_index for r in server.requests} == {0, 1}  # g2, g3 wait: not in flight
    # As a checkpoint keeps it: the samples as a Rollout, restored into a fresh pool.
    Prompts = SimpleNamespace(input_ids=[g.prompt for g in pool.groups],
                              rows=[g.row for g in pool.groups])
    saved = Rollout.from_state(Rollout.from_outputs(Prompts, PartialPool.outputs(pool.groups),
                                                    1000).state(), Prompts.rows)
    other = _pool(in_flight=2)
    other.restore([(g.serial, g.prompt, g.row, [s.key for s in g.samples]) for g in pool.groups],
                  saved)
    assert [(g.serial, [(s.tokens, s.versions, s.logprobs, s.finish) for s in g.samples])
            for g in other.groups] == [
        (g.serial, [(s.tokens, s.versions, s.logprobs, s.finish) for s in g.samples])
        for g in pool.groups]
    a, b = (p.run(ScriptedServer(LENGTHS), need=1, version=1) for p in (pool, other))
    assert [(g.serial, [s.tokens for s in g.samples]) for g in a.taken] == \
        [(g.serial, [s.tokens for s in g.samples]) for g in b.taken]


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="in_flight=0"):
        _pool(in_flight=0)
    pool = _pool(in_flight=2)
    _add(pool, 1, [1, 2])
    with pytest.raises(ValueError, match="prompt 0 drawn after 1"):
        _add(pool, 0, [1, 2])
    with pytest.raises(ValueError, match="3 groups needed"):
        pool.run(ScriptedServer({}), need=3, version=0)


class RoutedServer(ScriptedServer):
    """A ScriptedServer whose outputs carry each token's routing (as a recording engine's):
    key * 100 + the token's draw, in every slot."""

    def _out(self, rid: int, finish: str) -> SampleOutput:
        out, r = super()._out(rid, finish), self.requests[rid]
        draws = torch.arange(r.draws, r.draws + len(out.token_ids), dtype=torch.int32)
        out.extras["routed_experts"] = (r.key * 100 + draws).view(-1, 1, 1).expand(-1, 2, 2)
        return out


def test_a_continued_sample_keeps_its_routing_through_a_checkpoint():
    """Routing replay with partial rollouts: an aborted sample's recorded routing joins its
    continuation's (draws in order), and a checkpointed pool restores it."""
    token_fields.declare(token_fields.routing_field(2, 2))
    try:
        pool = _pool()
        for g in range(3):
            _add(pool, g, [10 * g, 10 * g + 1])
        pool.run(RoutedServer(LENGTHS), need=2, version=0)  # g1's long sample: aborted at 5
        Prompts = SimpleNamespace(input_ids=[g.prompt for g in pool.groups],
                                  rows=[g.row for g in pool.groups])
        saved = Rollout.from_state(Rollout.from_outputs(Prompts, PartialPool.outputs(pool.groups),
                                                        1000).state(), Prompts.rows)
        other = _pool()
        other.restore([(g.serial, g.prompt, g.row, [s.key for s in g.samples])
                       for g in pool.groups], saved)
        for p in (pool, other):
            for g in (3, 4):
                _add(p, g, [10 * g, 10 * g + 1])
            step = p.run(RoutedServer(LENGTHS), need=2, version=1)
            g1 = step.taken[0]
            [out] = [o for o in PartialPool.outputs([g1]) if o.sample_index == 0]
            assert g1.serial == 1 and len(out.token_ids) == 8
            assert out.extras["routed_experts"][:, 0, 0].tolist() == [1000 + d for d in range(8)]
    finally:
        token_fields.retract("routed_experts")
