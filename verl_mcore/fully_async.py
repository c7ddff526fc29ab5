"""Fully asynchronous training on a rollout set (rollout.mode=fully_async): one_step_off's overlap
of generation and training (rollouts.py) over partial rollouts' pool of in-flight prompt groups
(rollout/partial.py), which lives on the rollout set and is never restarted by a weight update.

The schedule, fixed by step counts (no clock decides anything, so a seeded run repeats itself
and the tests compare runs exactly). A_j is the j-th batch of data.train_batch_size finished
prompt groups the rollout set hands over; step s trains on A_s; v_s are the actor's weights
after s updates. Every replica's pool holds in_flight = ceil(max(B + 1, B x (1 +
rollout.partial.over_sampling)) / DP_g) groups before each production (whole loader batches
drawn, B = train_batch_size), and a production runs the pool (PartialPool.run) until B / DP_g of
its groups are finished, oldest first, aborting the rest with their tokens kept:

    step 1       the rollout set receives v_0 and produces A_1 (handed over before the update:
                 the training ranks wait for it) and A_2 (handed over after the update:
                 sampled while the training ranks train on A_1), both with v_0
    step s >= 2  the rollout set receives v_{s-1} (the update of step s - 1, the existing
                 cross-set transfer) and its in-flight samples continue with it where they
                 stopped; it produces A_{s+1}, handed over after step s's update; meanwhile the
                 training ranks train on A_s

So production i (of A_i) samples with v_{max(i-2, 0)}, and a token of A_j sampled at
production i <= j carries that version (`versions`). A_j trains at step j against v_{j-1}:
the pool drops (resamples from its prompt, same random stream) every sample holding a token
older than version(i) - (rollout.max_staleness - 1) when production i starts, so no trained
token is more than rollout.max_staleness versions old (`rollout/staleness`: the batch's oldest
token's age; rollout/token_age/* from the learner). max_staleness = 1 thus restarts what the
previous production left unfinished; 2 and more continue it across updates.

Who does what: the rollout set's ranks hold the pools (one per generation replica) and run the
productions; the training ranks run the same draws of the loader without sampling (whole global
batches, for the dataset rows of the prompts: their serials come with each batch) and receive
the batches. A batch crosses from the rollout set's first rank as tensors
(rollout/gather.py broadcast_part) with its prompts' serials; a failure on either set is agreed
in that hand-over and raised on every rank (a training failure waits for the next one, as in
one_step_off).

Checkpoints (`state_dict`, collective) hold every replica's pool (tokens, engine log-probs,
versions, finish reasons and serials, gathered on the rollout set and sent to every rank, so the
actor set's first rank writes them), the batch handed over for the next step with its serials,
and the loader's position before the oldest draw either holds. A resumed run draws those
batches again for the rows and continues exactly as the run that was stopped
(tests/e2e/test_fully_async.py).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from verl_mcore.config.placement import format_ranks
from verl_mcore.distributed.groups import collective_device
from verl_mcore.partial_rollouts import COUNTS, METRICS, PartialProducer
from verl_mcore.rollout.batch import Rollout
from verl_mcore.rollout.gather import (
    agreed_failure,
    broadcast_part,
    gather_integers,
    gather_rollout,
)
from verl_mcore.rollout.partial import PartialPool
from verl_mcore.rollouts import Producer

AHEAD = 1  # batches handed over ahead of the one trained on: one trains while the next is made
MODE = "fully_async"  # the checkpoint's pool state says which producer wrote it


def rollout_replicas(cfg, place) -> int:
    """The rollout set's generation replicas (DP_g), known on every rank from the config."""
    return len(place.placement.ranks("rollout")) // cfg.rollout.tensor_parallel_size


class FullyAsyncProducer(PartialProducer):
    """Producer's interface over a PartialPool per replica of the rollout set (module
    docstring). It is a PartialProducer for the pool's bookkeeping (prompt serials, random
    streams, gathering a pool, restoring it), but the pool lives on the rollout set only and
    the batches cross to the training ranks one step ahead."""

    def __init__(self, sampler, loader, place, cfg, make_room, scorer=None):
        # Not PartialProducer.__init__: its pool and groups are on every rank, here only on the
        # rollout set's.
        Producer.__init__(self, sampler, loader, place, cfg, make_room, AHEAD, scorer)
        r, d = cfg.rollout, cfg.data
        self.tb = d.train_batch_size
        self.replicas = rollout_replicas(cfg, place)
        self.share = self.tb // self.replicas  # groups each replica finishes a production
        wanted = max(self.tb + 1, math.ceil(self.tb * (1 + r.partial.over_sampling)))
        self.in_flight = math.ceil(wanted / self.replicas)
        self.held = 0  # groups each replica's pool holds (counted alike on every rank)
        self.drawn_before: dict[int, dict] = {}  # draw -> the loader's state before it
        self.rows: dict[int, object] = {}  # training ranks: serial -> row, drawn, not handed over
        self.serials: deque[list[int]] = deque()  # training ranks: each queued batch's serials
        self.src = place.placement.ranks("rollout")[0]  # hands the batches over
        self.groups, self.pool = None, None
        if sampler.generates:
            self.groups = sampler.generation.groups
            if self.groups.layout.dp_gen != self.replicas:
                raise RuntimeError(f"rank {self.groups.rank}: the rollout set has "
                                   f"{self.groups.layout.dp_gen} generation replicas, the config "
                                   f"says {self.replicas} (a bug)")
            logprobs = sampler.sampling(r.n, r.temperature, 0).logprobs
            # The pool's bound is at sampling; a batch trains AHEAD updates later.
            self.pool = PartialPool(r.n, d.max_response_length, r.max_staleness - AHEAD,
                                    self.in_flight, logprobs)

    # ------------------------------------------------------------------ the step

    def take(self, step: int, phase) -> tuple[Optional[Rollout], dict[str, float]]:
        """The batch step `step` trains on (None on the rollout set's ranks) after this rank's
        part of the step's sampling: the weights of step - 1 to the rollout set, then the
        productions up to A_{step+1} there, A_step received here."""
        s = self.sampler
        metrics = dict(self.make_room())
        with phase("sync"):  # weights + the cross-set check on the oldest in-flight prompts
            try:
                self._draw()
            except Exception as e:  # noqa: BLE001 - every rank raises it at the hand-over
                self.failure = e
            # The weights' way in is collective with the actor set: taken after a failed draw
            # too, so that no actor rank waits in it.
            prompts = [g.prompt for g in self.pool.groups] if self.pool is not None else True
            try:
                metrics.update(s.begin(step, prompts))
            except Exception as e:  # noqa: BLE001 - every rank raises it at the hand-over
                self.failure = self.failure or e
        metrics.update(self._advance(step + (0 if self.place.trains else AHEAD), step, phase))
        s.end()
        metrics.update(s.stats())
        if not self.place.trains:
            return None, metrics
        sampled = self.queue.popleft()
        self.serials.popleft()
        assert sampled.index == step, f"batch {sampled.index} at step {step}"
        versions = sampled.token_field("versions")
        if versions.numel():  # the oldest token's age when it trains
            metrics["rollout/staleness"] = float(step - 1 - int(versions.min()))
        return sampled, metrics

    def fill(self, step: int, phase, failure: Optional[BaseException] = None) -> dict[str, float]:
        """Training ranks, after the update: receive A_{step+1}, made meanwhile. `failure`: the
        step's training failed here; the hand-over tells every rank."""
        self.failure = failure or self.failure
        return self._advance(step + AHEAD, step, phase)

    def _advance(self, until: int, step: int, phase) -> dict[str, float]:
        """Produce (the rollout set) or receive (the training ranks) batches until `until`
        exist; the rollout set's pool counts (rollout/partial/*) summed over them."""
        counts = dict.fromkeys(COUNTS, 0.0)
        while self.count < until:
            index = self.count + 1
            batch, serials, made = self._produce(step, phase)
            for k, v in made.items():  # in flight: a size, not a count
                counts[k] = v if k == "in_flight" else counts[k] + v
            self.count = index
            if self.place.trains:
                batch = dataclasses.replace(batch, prompt_rows=[self.rows.pop(x) for x in serials],
                                            index=index, version=step - 1)
                self.queue.append(batch)
                self.serials.append(serials)
        return {METRICS + k: v for k, v in counts.items()} if self.pool is not None else {}

    def _produce(self, step: int, phase):
        """One batch on every rank: (the Rollout, its prompts' serials, the pool's counts)."""
        failure, self.failure = self.failure, None
        batch, serials, counts = None, None, {}
        if self.pool is not None:
            with phase("gen"):
                batch, serials, counts, failure = self._sample(step, failure)
        else:
            try:
                self._draw()  # the rollout set's draws, for the rows
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                failure = failure or e
        self.held -= self.share
        with phase("wait_rollout"):  # the rollout set waits for the trainers, and they for it
            batch = broadcast_part(batch, self.src, None, self.info.arch.vocab_size,
                                   failure=failure, with_rows=False,
                                   who=f"the rollout set ({format_ranks(self.place.placement.ranks('rollout'))})")
            serials = self._broadcast_serials(serials, len(batch.prompt_lens))
        return batch, serials, counts

    def _sample(self, step: int, failure: Optional[BaseException]):
        """The rollout set's production with the weights of step - 1: (the gathered batch, its
        serials, the counts over every replica, None), or (None, None, {}, the failure agreed
        over the rollout set)."""
        s, groups, r, pool = self.sampler, self.groups, self.cfg.rollout, self.pool
        mine = serials = None
        try:
            if failure is None:
                self._draw()
                sampling = s.sampling(r.n, r.temperature, self.generated)
                with s.generation.serving(sampling, max_len=pool.longest_prompt + pool.max_new_tokens,
                                          sessions=pool.in_flight * r.n) as (server, _):
                    done = pool.run(server, self.share, step - 1)
                if groups.gen_tp_rank == 0:  # every rank of a TP_g group holds the same samples
                    mine = self._part(done.taken)
                    serials = torch.tensor([g.serial for g in done.taken], dtype=torch.int64)
        except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
            failure = e
        failure = agreed_failure(failure, groups.whole, "gathering the fully async batch")
        if failure is not None:
            return None, None, {}, failure
        vocab = self.info.arch.vocab_size
        return (gather_rollout(mine, groups, vocab), torch.cat(gather_integers(serials, groups)),
                self._summed(done.counts), None)

    def _broadcast_serials(self, serials: Optional[torch.Tensor], prompts: int) -> list[int]:
        """The rollout set's first rank's `serials` ([prompts] int64) on every rank."""
        device = collective_device(None)
        buf = (serials.to(device) if dist.get_rank() == self.src
               else torch.empty(max(prompts, 1), dtype=torch.int64, device=device))
        if buf.numel() == 0:  # gloo refuses empty buffers
            buf = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(buf, src=self.src)
        return buf.cpu()[:prompts].tolist()

    def _draw(self) -> None:
        """Whole loader batches until each replica's pool holds its in-flight groups: into the
        pool on the rollout set, their rows kept on the training ranks (the same draws)."""
        while self.held < self.in_flight:
            d = self.generated
            self.drawn_before[d] = self.loader.state_dict()
            if self.pool is not None:
                batch = next(self.loader)  # this replica's share
                for i, (ids, row) in enumerate(zip(batch.input_ids, batch.rows)):
                    self.pool.add(self._serial(d, i), ids, row, self._keys(d, i))
            else:
                batch = self.loader.next_global()
                for i, row in enumerate(batch.rows):
                    self.rows[d * self.tb + i] = row
            self.generated += 1
            self.held += self.share
        if self.pool is not None and len(self.pool.groups) != self.held:
            raise RuntimeError(f"rank {self.groups.rank}: the pool holds {len(self.pool.groups)} "
                               f"groups, the draws count {self.held} (a bug)")

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Every replica's pool (sent from the rollout set to every rank), the batch handed over
        for the next step with its serials, and the loader's position before the oldest draw
        either holds. Collective: every rank calls it (the trainer's checkpoint save)."""
        vocab = self.info.arch.vocab_size
        pool = serials = None
        if self.pool is not None:
            lead = self.groups.gen_tp_rank == 0
            pool = gather_rollout(self._part(self.pool.groups) if lead else None, self.groups,
                                  vocab)
            serials = torch.cat(gather_integers(
                torch.tensor([g.serial for g in self.pool.groups], dtype=torch.int64)
                if lead else None, self.groups))
        pool = broadcast_part(pool, self.src, None, vocab, with_rows=False,
                              who="the rollout set's pool")
        pool_serials = self._broadcast_serials(serials, len(pool.prompt_lens))
        held = pool_serials + [x for batch in self.serials for x in batch]
        first = min(held) // self.tb if held else self.generated
        loader = self.drawn_before[first] if first < self.generated else self.loader.state_dict()
        for d in [d for d in self.drawn_before if d < first]:
            del self.drawn_before[d]  # no pool or queued batch holds a prompt of it any more
        return {"loader": loader, "queue": [q.state() for q in self.queue],
                "gen_batches": self.generated,
                "partial": {"mode": MODE, "pool": pool.state(),
                            "serials": torch.tensor(pool_serials, dtype=torch.int64),
                            "queue_serials": [torch.tensor(x, dtype=torch.int64)
                                              for x in self.serials],
                            "first_draw": first, "train_batch_size": self.tb,
                            "n": self.cfg.rollout.n}}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Continue after step `step`: the loader where the checkpoint had it, the draws since
        drawn again on every rank, the saved pools back on the rollout set (each replica its
        groups), the batch handed over back in the training ranks' queue. A checkpoint of
        another mode starts with empty pools at its loader position (batches it sampled ahead
        are sampled again)."""
        self.loader.load_state_dict(state["loader"])
        self.queue.clear(), self.serials.clear(), self.loader_before.clear()
        self.drawn_before, self.rows, self.held, self.count = {}, {}, 0, step
        if self.pool is not None:
            self.pool.groups = []
        saved = state.get("partial")
        if saved is None or saved.get("mode") != MODE:
            self.generated = int(state.get("gen_batches") or step)
            return
        self._check_sizes(saved)
        self.generated = int(state["gen_batches"])
        rows = self._redraw(int(saved["first_draw"]))
        pool_serials = saved["serials"].tolist()
        if len(pool_serials) % self.replicas:
            raise ValueError(f"the checkpoint's fully async pools hold {len(pool_serials)} "
                             f"groups, not a multiple of the rollout set's {self.replicas} "
                             "replicas: resume with the rollout set's layout of the saved run")
        self.held = len(pool_serials) // self.replicas
        self.count = step + len(state["queue"])
        if self.pool is not None:
            self._restore_pool(saved, rows)
            return
        self.rows = {x: rows[x][1] for x in pool_serials}
        for batch, serials in zip(state["queue"], saved["queue_serials"]):
            serials = serials.tolist()
            self.queue.append(Rollout.from_state(batch, [rows[x][1] for x in serials]))
            self.serials.append(serials)
