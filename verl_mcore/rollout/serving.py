"""Step-wise serving: sequences that join and leave between decode rounds (continuous batching).

An engine's `generate` knows all its prompts up front. An agent loop does not: a trajectory asks
for a turn, waits for a tool, and asks again, while the others go on decoding. The engine then
serves requests one round at a time:

    with engine.serving(sampling, max_len=..., sessions=...) as server:
        rid = server.submit(Request(token_ids, key=stream_key(seed, p, j), max_new_tokens=...))
        while server.busy:
            for rid, out in server.step():   # one round: admit, decode, retire
                ...                          # out: a SampleOutput of the request's new tokens
        server.release(session)              # the KV a session kept is no longer needed
        aborted = server.abort()             # stop the rest: (rid, tokens so far, "aborted")

`sampling` fixes what a round's decode step is compiled for (temperature, top_p, top_k, logprobs;
its stop ids and max_new_tokens are the defaults of requests that give none); each request
brings its context, its random stream, its token budget and stop ids.

Random streams. A request draws its t-th token with the uniform number (key, draws + t)
(rollout/sampling.py `uniforms`), whatever the batch, the slot, the arrival time or a preemption.
`generate` gives sample j of prompt i the key `stream_key(seed, i, j)` and draws from 0; a
multi-turn trajectory keeps its sample's key and continues the counter from the tokens it has
sampled so far (agent/runtime.py), so one seeded trajectory is the same however the others are
timed, and a one-turn trajectory is exactly `generate`'s sample.

Sessions. A request naming a `session` leaves its KV in the cache when it finishes (its context
and every sampled token but the last, which was never fed). The session's next request whose
tokens extend that prefix reuses those blocks and prefills only the rest. Kept KV is freed by
`release`, and evicted (oldest first) when live sequences need the blocks; the next request then
recomputes its prefix. The server's `stats()` count prefilled and reused tokens.

TP_g > 1: every rank of a generation TP group must call submit / step / release with the same
arguments in the same order (the decode step's collectives pair up across the group);
agent/runtime.py makes the group's first rank the only one that decides.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Hashable, Optional

import numpy as np

from verl_mcore.rollout.base import SampleOutput
from verl_mcore.rollout.sampling import sequence_keys


def stream_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The random-stream key `generate` gives sample `sample_index` of prompt `prompt_index`
    under `seed` (the uint64 bits as a signed int64, as the engine's tensors hold them)."""
    keys = sequence_keys(seed, np.array([prompt_index]), np.array([sample_index]))
    return int(keys.view(np.int64)[0])


@dataclasses.dataclass(frozen=True)
class Request:
    """One continuation of a token sequence.

    token_ids: the whole context (the prompt, and for a later turn every token since).
    key: the random stream (`stream_key`); draws: the stream's counter for the first token this
        request samples (the tokens its trajectory sampled before).
    max_new_tokens: tokens this request samples at most; stop_token_ids: a sampled one ends it
        (kept as its last token); None: the server's sampling defaults.
    session: keep the KV when it finishes, for the session's next request (module docstring).
    share: requests of one share group with the same token_ids, admitted together, prefill the
        tokens once and share their full KV blocks (the n samples of a prompt).
    prompt_index, sample_index: copied to the output.
    """

    token_ids: tuple[int, ...]
    key: int = 0
    draws: int = 0
    max_new_tokens: Optional[int] = None
    stop_token_ids: Optional[tuple[int, ...]] = None
    session: Optional[Hashable] = None
    share: Optional[Hashable] = None
    prompt_index: int = 0
    sample_index: int = 0

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.draws < 0:
            raise ValueError(f"Request.draws must be >= 0, got {self.draws}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens must be >= 1, got {self.max_new_tokens}")


class Server(abc.ABC):
    """An open serving session of an engine (module docstring)."""

    @abc.abstractmethod
    def submit(self, request: Request) -> int:
        """Queue a request; returns its id (ids count up from 0 in submission order)."""

    @abc.abstractmethod
    def step(self) -> list[tuple[int, SampleOutput]]:
        """One round: admit waiting requests into free slots (prefill), decode the live ones,
        retire the finished; returns (id, output) of the requests finished in it, in the order
        they finished. Nothing to do: returns []."""

    @property
    @abc.abstractmethod
    def busy(self) -> bool:
        """Whether a request waits or decodes."""

    @abc.abstractmethod
    def release(self, session: Hashable) -> None:
        """Free the KV `session` kept (nothing when it kept none)."""

    @abc.abstractmethod
    def abort(self) -> list[tuple[int, SampleOutput]]:
        """End every waiting and live request now: (id, output) of each, in id order, with the
        tokens (and log-probs) it sampled so far and finish reason "aborted"; their slots and KV
        go back (a session keeps nothing of an aborted request). Partial rollouts stop a step's
        generation with it and continue the samples later from their tokens."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """The engine's counters since the session opened (rollout/* metrics)."""


def check_request(request: Request, vocab_size: int, max_len: int, where: str) -> None:
    """A request the server can take: tokens in the vocabulary, room for its new tokens."""
    ids = request.token_ids
    if not ids:
        raise ValueError(f"{where}: the request's token_ids are empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) + request.max_new_tokens > max_len:
        raise ValueError(f"{where}: {len(ids)} context tokens + max_new_tokens "
                         f"{request.max_new_tokens} exceed the session's max_len {max_len}")

