"""The producer of partial (interruptible) rollouts, colocated (rollout.partial).

Step s, with the weights v_{s-1} in the engine, on every generation replica:

    draw       whole loader batches (this replica's share of each) until the pool holds at least
               its in-flight groups: ceil(max(train_batch_size + 1, train_batch_size x
               (1 + over_sampling)) / DP_g)
    sample     the pool's step (rollout/partial.py PartialPool.run): stale samples start over,
               the in-flight groups' unfinished samples run until train_batch_size / DP_g
               groups are finished, the rest are aborted with their tokens and versions
    gather     the replicas' finished groups into the step's batch (rollout/gather.py): every
               token carries the version that sampled it (`versions`), so the learner reports
               their age (rollout/token_age/*) and treats the batch as off-policy (learner.py)

Sample j of the prompt at place i of draw d's share on replica r draws from stream
stream_key(seed(d, r), i, j), seed(d, r) being the seed sync mode gives that batch: a group
that runs to its end within one step samples what sync mode would have sampled for it.

Every decision counts finished groups, none reads a clock: a seeded run is reproducible, and
the ranks of a generation TP group, running the same program on the same tokens, make the same
engine calls. The replicas each take the same number of groups a step, so their pools stay the
same size and they draw the loader in step.

Checkpoints (`state_dict`) hold every replica's pool, gathered (each sample's tokens, engine
log-probs, versions, finish reason, and its prompt's serial), and the loader's position before
the oldest draw a pool still holds; a resume draws those batches again for the prompts' rows
and continues exactly as the run that was stopped (tests/e2e/test_partial_rollouts.py).
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from verl_mcore.distributed.groups import collective_device
from verl_mcore.rollout.batch import Rollout
from verl_mcore.rollout.gather import agreed_failure, gather_integers, gather_rollout
from verl_mcore.rollout.partial import PartialPool
from verl_mcore.rollout.serving import stream_key
from verl_mcore.rollouts import Producer

METRICS = "rollout/partial/"
COUNTS = ("resampled", "continued", "aborted", "waiting", "in_flight")


class PartialProducer(Producer):
    """Producer's interface (take / fill / batch_of / state_dict / load_state_dict) over a
    PartialPool per generation replica (module docstring). Colocated only (config/validate.py):
    every rank holds an engine and trains."""

    def __init__(self, sampler, loader, place, cfg, make_room, scorer=None):
        super().__init__(sampler, loader, place, cfg, make_room, 0, scorer)
        r, d = cfg.rollout, cfg.data
        self.groups = sampler.generation.groups
        self.replicas = self.groups.layout.dp_gen
        self.share = d.train_batch_size // self.replicas  # groups each replica finishes a step
        wanted = max(d.train_batch_size + 1,
                     math.ceil(d.train_batch_size * (1 + r.partial.over_sampling)))
        logprobs = sampler.sampling(r.n, r.temperature, 0).logprobs  # the learner weighs them
        self.pool = PartialPool(r.n, d.max_response_length, r.partial.max_staleness,
                                math.ceil(wanted / self.replicas), logprobs)
        self.drawn_before: dict[int, dict] = {}  # draw -> the loader's state before it

    # ------------------------------------------------------------------ the step

    def take(self, step: int, phase) -> tuple[Optional[Rollout], dict[str, float]]:
        """The batch step `step` trains on: train_batch_size finished groups, sampled over this
        and earlier steps (module docstring)."""
        s = self.sampler
        metrics = dict(self.make_room())  # colocated: generation gets the memory
        with phase("sync"):
            try:
                metrics.update(s.begin(step, True))  # the weight-sync check on this step's samples
            except Exception as e:  # noqa: BLE001 - every rank raises it after the agreement
                self.failure = e
        with phase("gen"):
            batch, counts, failure = self._sample(step)
            batch = s.share_part(None, batch, failure)  # colocated: raises a failure everywhere
        s.end()  # release the KV cache before training
        metrics.update(s.stats())
        metrics.update({METRICS + k: v for k, v in counts.items()})
        return dataclasses.replace(batch, index=step, version=step - 1), metrics

    def fill(self, step: int, phase, failure: Optional[BaseException] = None) -> dict[str, float]:
        """Nothing is sampled after the update: the next step's `take` continues the pool."""
        self.failure = failure or self.failure
        return {}

    def _sample(self, step: int):
        """(the gathered batch or None, the step's counts over every replica, the failure
        agreed over the generating ranks or None)."""
        s, groups, r = self.sampler, self.groups, self.cfg.rollout
        gen = s.generation
        mine, counts = None, dict.fromkeys(COUNTS, 0.0)
        failure, self.failure = self.failure, None
        try:
            if failure is None:
                self._draw()
                pool = self.pool
                sampling = s.sampling(r.n, r.temperature, self.generated)
                sessions = pool.in_flight * r.n
                with gen.serving(sampling, max_len=pool.longest_prompt + pool.max_new_tokens,
                                 sessions=sessions) as (server, _):
                    done = pool.run(server, self.share, step - 1)
                counts.update(done.counts)
                if done.fresh:  # the weight-sync check reads samples of these weights alone
                    prompts = [p for p, _ in done.fresh]
                    gen.keep_for_check(prompts, [dataclasses.replace(o, prompt_index=i)
                                                 for i, (_, o) in enumerate(done.fresh)],
                                       r.temperature)
                if groups.gen_tp_rank == 0:  # every rank of a TP_g group holds the same samples
                    mine = self._part(done.taken)
        except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
            failure = e
        failure = agreed_failure(failure, groups.whole, "gathering the partial rollouts")
        if failure is None:
            try:
                gen.check_samples()
            except Exception as e:  # noqa: BLE001 - WeightSyncError comes on every rank alike
                failure = e
        if failure is not None:
            return None, counts, failure
        return gather_rollout(mine, groups, self.info.arch.vocab_size), self._summed(counts), None

    def _part(self, taken) -> Rollout:
        prompts = SimpleNamespace(input_ids=[g.prompt for g in taken], rows=[g.row for g in taken])
        return Rollout.from_outputs(prompts, PartialPool.outputs(taken), self.info.arch.vocab_size)

    def _summed(self, counts: dict[str, float]) -> dict[str, float]:
        """The replicas' counts added up (each rank of a replica holds the same ones)."""
        if self.replicas == 1:
            return counts
        t = torch.tensor([counts[k] for k in COUNTS], dtype=torch.float64,
                         device=collective_device(self.groups.gen_dp))
        dist.all_reduce(t, group=self.groups.gen_dp)
        return dict(zip(COUNTS, t.cpu().tolist()))

    def _draw(self) -> None:
        """Whole loader batches into the pool until it holds its in-flight groups."""
        while len(self.pool.groups) < self.pool.in_flight:
            d = self.generated
            self.drawn_before[d] = self.loader.state_dict()
            batch = next(self.loader)
            for i, (ids, row) in enumerate(zip(batch.input_ids, batch.rows)):
                self.pool.add(self._serial(d, i), ids, row, self._keys(d, i))
            self.generated += 1

    def _serial(self, draw: int, place: int, replica: Optional[int] = None) -> int:
        """The prompt at `place` of `replica`'s share of draw `draw`: its place in the stream of
        global batches."""
        replica = self.groups.gen_dp_rank if replica is None else replica
        return draw * self.cfg.data.train_batch_size + replica * self.share + place

    def _keys(self, draw: int, place: int) -> list[int]:
        r = self.cfg.rollout
        seed = self.sampler.sampling(r.n, r.temperature, draw).seed
        return [stream_key(seed, place, j) for j in range(r.n)]

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Every replica's pool and the loader's position before the oldest draw one holds.
        Collective: every rank calls it (the trainer's checkpoint save)."""
        tb = self.cfg.data.train_batch_size
        oldest = min((g.serial // tb for g in self.pool.groups), default=self.generated)
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([oldest], dtype=torch.int64, device=collective_device(None))
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            oldest = int(t.item())
        loader = self.drawn_before[oldest] if oldest < self.generated else self.loader.state_dict()
        for d in [d for d in self.drawn_before if d < oldest]:
            del self.drawn_before[d]  # no pool holds a prompt of it any more
        lead = self.groups.gen_tp_rank == 0
        vocab = self.info.arch.vocab_size
        pool = gather_rollout(self._part(self.pool.groups) if lead else None, self.groups, vocab)
        serials = gather_integers(torch.tensor([g.serial for g in self.pool.groups],
                                               dtype=torch.int64) if lead else None, self.groups)
        return {"loader": loader, "queue": [], "gen_batches": self.generated,
                "partial": {"pool": pool.state(), "serials": torch.cat(serials),
                            "first_draw": oldest, "train_batch_size": tb, "n": self.cfg.rollout.n}}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Continue after step `step`: the loader where the checkpoint had it, the draws since
        drawn again (whole global batches: every replica's prompts' rows), then this replica's
        groups of the saved pools back in its pool. A checkpoint of a run without partial
        rollouts starts with an empty pool."""
        self.loader.load_state_dict(state["loader"])
        self.count = step
        saved = state.get("partial")
        self.pool.groups, self.drawn_before = [], {}
        if saved is None:
            self.generated = int(state.get("gen_batches") or step)
            return
        self._check_sizes(saved)
        self.generated = int(state["gen_batches"])
        rows = self._redraw(int(saved["first_draw"]))
        self._restore_pool(saved, rows)

    def _check_sizes(self, saved: dict) -> None:
        """The checkpoint's pool was sampled with this run's batch size and samples per prompt
        (its serials count prompts in batches of that size)."""
        tb, n = self.cfg.data.train_batch_size, self.cfg.rollout.n
        if (int(saved["train_batch_size"]), int(saved["n"])) != (tb, n):
            raise ValueError(
                f"the checkpoint's partial rollouts were sampled with data.train_batch_size="
                f"{saved['train_batch_size']} and rollout.n={saved['n']}, this run has {tb} and "
                f"{n}: resume with the same values")

    def _redraw(self, first: int) -> dict[int, tuple[list[int], dict]]:
        """The draws from `first` on drawn again, whole global batches (the loader at the
        checkpoint's position): {serial: (prompt ids, dataset row)}."""
        tb = self.cfg.data.train_batch_size
        rows: dict[int, tuple[list[int], dict]] = {}
        for d in range(first, self.generated):
            self.drawn_before[d] = self.loader.state_dict()
            batch = self.loader.next_global()
            for i, (ids, row) in enumerate(zip(batch.input_ids, batch.rows)):
                rows[d * tb + i] = (list(ids), row)
        return rows

    def _restore_pool(self, saved: dict, rows: dict) -> None:
        """This replica's groups of the saved pools (`saved`: state_dict's "partial") back in
        its pool; `rows`: _redraw's."""
        tb, n = self.cfg.data.train_batch_size, self.cfg.rollout.n
        serials = saved["serials"].tolist()
        missing = [x for x in serials if x not in rows]
        if missing:
            raise ValueError(f"the checkpoint's partial rollouts hold prompts {missing[:4]} that "
                             f"its loader position does not reach (a damaged checkpoint)")
        pool = Rollout.from_state(saved["pool"], [rows[x][1] for x in serials])
        mine = [p for p, x in enumerate(serials) if (x % tb) // self.share == self.groups.gen_dp_rank]
        samples = [p * n + j for p in mine for j in range(n)]
        groups = [(serials[p], rows[serials[p]][0], rows[serials[p]][1],
                   self._keys(serials[p] // tb, serials[p] % tb % self.share)) for p in mine]
        self.pool.restore(groups, pool.select(samples) if samples else pool.select([]))
