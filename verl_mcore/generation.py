"""The generation phase of a step: wake the engine, bring it the actor's weights, check them,
generate, and put the engine back to sleep so training gets its memory.

    phase.begin(step, prompts)   # wake + repartition/push weights; arms the weight-sync check
    phase.generate(prompt_ids, sampling)      # as often as the step needs (samples, baselines)
    with phase.serving(sampling, max_len=..., sessions=...) as (server, sp):   # agent loops
        ...                      # then phase.keep_for_check(prompts, first turns), phase.note(metrics)
    phase.check_samples()        # the check on a few of the first batch's samples (collective)
    phase.end()                  # release the KV cache and the generation weight buffer

The weight-sync check compares the engine's log-probs of a few of the step's own samples with the
actor's own (training-layout, any PP) log-probs of the same tokens; a broken repartition stops
the run, before any rank trains on the batch, with `rollout/logprob_diff_max` in the message
instead of training on another model.

With a rollout set of its own (placement.rollout) the phase is split over two sets: the rollout
ranks hold the engine (`RolloutSetPhase`: its weights arrive through rollout/cross_set.py), the
actor ranks send them (`WeightSender`), and the weight-sync check runs across the two
(rollout/sync_check.check_across_sets). Both sides call begin / end together. build.py picks
the engine and builds either side (build_generation_phase, build_rollout_set_phase).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from verl_mcore.config.schema import logprob_check_bound
from verl_mcore.config.seeds import rollout_config
from verl_mcore.engine.batch import TrainBatch, response_aligned
from verl_mcore.rollout.base import SamplingParams
from verl_mcore.rollout.sync_check import check_across_sets, check_weight_sync, checked_outputs

log = logging.getLogger("verl_mcore.generation")


def rollout_as_run(cfg):
    """cfg.rollout as the run uses it: its seed as the run draws it and the weight-sync check's
    bound for the actor's dtype (the engines and the check read these)."""
    r = rollout_config(cfg)
    return dataclasses.replace(r, logprob_check=dataclasses.replace(
        r.logprob_check, max_abs_diff=logprob_check_bound(cfg)))


class EngineStats:
    """What the engine says of its calls (`last_stats`: NativeEngine's, none for vLLM), summed over
    a step's calls: sequences preempted for KV memory, the most live at once, slot occupancy (the
    share of the slot-steps stepped that advanced a live sequence), prompt blocks shared, tails
    compacted, whether every call decoded in CUDA graphs."""

    def __init__(self):
        self.calls: list[dict] = []

    def add(self, stats: Optional[dict]) -> None:
        if stats:
            self.calls.append(dict(stats))

    def take(self) -> dict[str, float]:
        calls, self.calls = self.calls, []
        if not calls:
            return {}

        def total(key: str) -> float:
            return sum(c.get(key, 0.0) for c in calls)

        out = {"rollout/preemptions": total("rollout/preemptions"),
               "rollout/peak_live_sequences": max(c.get("rollout/peak_live_sequences", 0.0) for c in calls),
               "rollout/kv_shared_prefix_blocks": total("rollout/kv_shared_prefix_blocks"),
               "rollout/compactions": total("rollout/compactions")}
        # the slots the engine stepped (fewer than it has once a call's tail is compacted)
        if total("rollout/stepped_slot_steps"):
            out["rollout/slot_occupancy"] = total("rollout/live_slot_steps") / total("rollout/stepped_slot_steps")
        graphs = [c["rollout/cuda_graphs"] for c in calls if "rollout/cuda_graphs" in c]
        if graphs:  # 0 once any call decoded eagerly
            out["rollout/cuda_graphs"] = min(graphs)
        return out


class GenerationPhase:
    def __init__(self, engine, actor, groups, rollout_cfg, eos_token_ids: Sequence[int],
                 max_new_tokens: int, pad_token_id: int):
        self.engine = engine
        self.actor = actor
        self.groups = groups
        self.cfg = rollout_cfg
        self.eos = tuple(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.pad = pad_token_id
        self.awake = False
        self.stats = EngineStats()
        self.check_due = False  # the next generate keeps samples for the weight-sync check
        self.to_check: Optional[tuple] = None  # (prompt ids, temperature, outputs) to check
        self.check_metrics: dict[str, float] = {}
        self.noted: dict[str, float] = {}  # a caller's own metrics of the calls (agent loops)

    def begin(self, step: int, prompts: Optional[Sequence[Sequence[int]]] = None) -> dict[str, float]:
        """Wake the engine and bring it the actor's weights; with `prompts` (the step's own, or
        True), the weight-sync check on the step's first sampled batch (`check_samples`)."""
        self.engine.wake()
        self.awake = True
        metrics = dict(self.engine.load_weights())
        if self.cfg.logprob_check.enable and prompts is not None:
            metrics.update(self.arm_check(step, prompts))
        return metrics

    def arm_check(self, step: int, prompts) -> dict[str, float]:
        """The engine's ranks check the weights on the step's own samples: the next `generate`
        returns the engine's log-probs, and `check_samples` compares a few of them with the
        actor's. Nothing is sampled for the check alone (at a 135M model's 20-token responses
        that sampling cost as much as the step's generation, bench/RESULTS.md 2026-12-07)."""
        self.check_due = True
        return {}

    def generate(self, prompt_ids, sampling: SamplingParams):
        assert self.awake, "GenerationPhase.generate outside begin()/end()"
        check, self.check_due = self.check_due, False
        count = self.cfg.logprob_check.num_sequences
        # An engine whose log-probs of top-k / top-p sampling would be the truncated
        # distribution's (vLLM) samples the check's few sequences apart, untruncated.
        apart = check and not sampling.greedy and (sampling.top_p < 1.0 or sampling.top_k > 0) \
            and not self.engine.logprobs_when_truncated
        if check and not apart:
            sampling = dataclasses.replace(sampling, logprobs=True)
        outputs = self.engine.generate(prompt_ids, sampling)
        self.stats.add(getattr(self.engine, "last_stats", None))
        checked = outputs
        if apart:
            checked = self.engine.generate(list(prompt_ids)[:count], dataclasses.replace(
                sampling, n=1, top_p=1.0, top_k=-1, max_new_tokens=self.check_length,
                logprobs=True))
        if check:
            self.to_check = (list(prompt_ids), sampling.temperature,
                             checked_outputs(checked, count, self.check_length))
        return outputs

    @contextlib.contextmanager
    def serving(self, sampling: SamplingParams, *, max_len: int, sessions: int):
        """The engine's step-wise serving session (rollout/serving.py) for agent loops: yields
        (server, the sampling it serves: with the engine's log-probs when the weight-sync check
        is due, unless the engine's would be the truncated distribution's, vLLM's). The
        session's engine stats join the step's. The caller hands the first turns of its
        trajectories to `keep_for_check`."""
        assert self.awake, "GenerationPhase.serving outside begin()/end()"
        truncated = not sampling.greedy and (sampling.top_p < 1.0 or sampling.top_k > 0)
        if self.check_due and (self.engine.logprobs_when_truncated or not truncated):
            sampling = dataclasses.replace(sampling, logprobs=True)
        with self.engine.serving(sampling, max_len=max_len, sessions=sessions) as server:
            yield server, sampling
            self.stats.add(server.stats())

    def keep_for_check(self, prompt_ids, first_turns, temperature: float) -> None:
        """After a weight update, the weight-sync check reads these samples (each trajectory's
        first turn: `prompt_index` into `prompt_ids`, the model's tokens alone) where they carry
        the engine's log-probs; otherwise this replica takes part in the check without samples."""
        if not self.check_due or not first_turns or any(o.logprobs is None for o in first_turns):
            return
        self.check_due = False
        self.to_check = (list(prompt_ids), temperature,
                         checked_outputs(first_turns, self.cfg.logprob_check.num_sequences, self.check_length))

    def note(self, metrics: dict[str, float], summed: Optional[dict[str, float]] = None) -> None:
        """A caller's metrics of its calls (an agent loop's turns, observation tokens...), taken
        with the engine's (the last call's value of each); `summed`: counts, added to those of
        the earlier calls since the last look (a step of dynamic sampling makes several)."""
        self.noted.update(metrics)
        for k, v in (summed or {}).items():
            self.noted[k] = self.noted.get(k, 0.0) + v

    @property
    def check_length(self) -> int:
        """Response tokens the check reads of each sequence (rollout.logprob_check.max_new_tokens,
        at most the rollout's)."""
        return min(self.max_new_tokens, self.cfg.logprob_check.max_new_tokens or self.max_new_tokens)

    def check_samples(self) -> dict[str, float]:
        """The weight-sync check on the samples `generate` kept since `begin` (rollout/
        sync_check.py); nothing when no check was armed. Collective over the actor set: its ranks
        call it together, after agreeing that every replica's sampling succeeded. A replica that
        made no engine call since `begin` armed the check (a rollout.generate_fn answering from a
        cache) takes part without samples, so the set's ranks meet in the check's collectives."""
        if self.to_check is None and not self.check_due:
            return {}
        prompts, temperature, outputs = self.to_check or ([], self.cfg.temperature, [])
        self.to_check, self.check_due = None, False
        metrics = check_weight_sync(outputs, prompts, self.actor_logprobs, temperature,
                                    self.cfg.logprob_check.max_abs_diff, group=self._set_group())
        self.check_metrics.update(metrics)
        return metrics

    def take_stats(self) -> dict[str, float]:
        """The engine's stats of the calls since the last look (EngineStats.take), the
        weight-sync check's metrics of that time, and the KV cache the engine keeps through
        training (`rollout/kept_cache_gb`, NativeEngine.sleep)."""
        out = {**self.stats.take(), **self.noted, **self.check_metrics}
        self.noted = {}
        if hasattr(self.engine, "kept_bytes") and not self.awake:
            out["rollout/kept_cache_gb"] = self.kept_bytes / 2**30
        self.check_metrics = {}
        return out

    def end(self) -> None:
        self.engine.sleep()
        self.awake = False
        self.check_due, self.to_check = False, None

    def cache_budget(self, free_bytes: int) -> None:
        """The KV cache (and its CUDA graphs) the engine may keep through training from now on:
        at most `free_bytes` (NativeEngine.keep_cache_bytes; other engines free theirs)."""
        if hasattr(self.engine, "keep_cache_bytes"):
            self.engine.keep_cache_bytes = int(free_bytes)

    def release_cache(self) -> None:
        """Free what the engine kept through training now (before work the training phases'
        memory did not measure, such as a checkpoint save that brings every role's optimizer
        state back); the budget stays for the next generation."""
        if self.kept_bytes and not self.awake:
            budget, self.engine.keep_cache_bytes = self.engine.keep_cache_bytes, 0
            self.engine.sleep()
            self.engine.keep_cache_bytes = budget

    @property
    def kept_bytes(self) -> int:
        """What the engine kept through the training since its last sleep."""
        return int(getattr(self.engine, "kept_bytes", 0))

    def _set_group(self):
        """The actor set's ranks (the world when colocated): the check's collectives stay there,
        while ranks of other roles run their own phases."""
        return getattr(self.groups, "whole", None)

    def actor_logprobs(self, prompts, responses, temperature, routing=None):
        """The trainer side of the sync check: every replica's sequences go through the actor
        together (its roles take the global batch), and each replica gets its own rows back.
        routing: the engine's per sequence ([tokens, layers, k], or None), replayed."""
        lead = self.groups.gen_tp_rank == 0
        routing = routing or [None] * len(prompts)
        mine = list(zip(map(list, prompts), map(list, responses), routing)) if lead else None
        group = self._set_group()
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (self.groups.gen_dp_rank, mine), group=group)
        parts = sorted((g for g in gathered if g[1] is not None), key=lambda g: g[0])
        seqs = [pr for _, part in parts for pr in part]
        if not seqs:
            return []
        offset = sum(len(part) for r, part in parts if r < self.groups.gen_dp_rank)
        batch = TrainBatch.from_sequences([p for p, _, _ in seqs], [r for _, r, _ in seqs], self.pad)
        given = [torch.as_tensor(x, dtype=torch.int32) for _, _, x in seqs if x is not None]
        if given:  # a replica without routing: its routers choose (-1)
            flat = torch.cat([torch.full((len(r), *given[0].shape[1:]), -1, dtype=torch.int32)
                              if x is None else torch.as_tensor(x, dtype=torch.int32)
                              for _, r, x in seqs])
            lens = torch.tensor([len(r) for _, r, _ in seqs])
            batch = dataclasses.replace(batch, routed_experts=response_aligned(
                flat, lens, batch.response_width, fill=-1))
        logp, _ = self.actor.compute_log_prob(batch, measure_replay=False)
        return [logp[offset + i, :len(r)].cpu() for i, r in enumerate(responses)]


class CrossSetCheck:
    """check_across_sets' arguments that do not change from step to step."""

    def __init__(self, cfg, place, info):
        self.max_abs_diff = logprob_check_bound(cfg)
        self.kwargs = dict(link=place.link, rollout_groups=place.groups["rollout"],
                           rollout_leader=place.placement.leader("rollout"),
                           actor_leader=place.placement.leader("actor"),
                           vocab_size=info.arch.vocab_size, pad_token_id=info.pad_token_id)

    def __call__(self, engine, actor, prompts, sampling) -> dict[str, float]:
        return check_across_sets(engine, actor, prompts, sampling, self.max_abs_diff,
                                 **self.kwargs)


class RolloutSetPhase(GenerationPhase):
    """The generation phase on a rollout set's rank: the engine's weights come from the actor
    set (the engine's repartitioner is the receiving CrossSetTransfer), and the weight-sync
    check runs across the two sets."""

    def __init__(self, engine, groups, rollout_cfg, eos_token_ids, max_new_tokens, pad_token_id,
                 cross_check: CrossSetCheck):
        super().__init__(engine, None, groups, rollout_cfg, eos_token_ids, max_new_tokens,
                         pad_token_id)
        self.cross_check = cross_check

    def check_sampling(self, step: int) -> SamplingParams:
        """How the check samples: short responses, every token's log-prob."""
        return SamplingParams(n=1, temperature=self.cfg.temperature, top_p=1.0, top_k=-1,
                              max_new_tokens=self.check_length, stop_token_ids=self.eos,
                              seed=self.cfg.seed + 7919 * step + self.groups.gen_dp_rank,
                              logprobs=True)

    def arm_check(self, step: int, prompts) -> dict[str, float]:
        """Across the two sets, now: the check samples a few sequences of the next batch's first
        prompts and the actor set recomputes them (rollout/sync_check.check_across_sets)."""
        prompts = list(prompts)[:self.cfg.logprob_check.num_sequences]
        return self.cross_check(self.engine, None, prompts, self.check_sampling(step))

    def end(self) -> None:
        """No training shares these GPUs: the engine keeps its weights, KV cache and captured
        graphs for the next batch (the transfer refills the weights in place)."""
        self.awake = False


class WeightSender:
    """The actor ranks' side of a rollout set's generation phase: `begin` sends this rank's
    training shards to the rollout set (rollout/cross_set.py) and, when the rollout set checks
    the weights, recomputes the checked sequences' log-probs with the actor."""

    def __init__(self, transfer, actor, rollout_cfg, cross_check: CrossSetCheck):
        self.transfer, self.actor, self.cfg = transfer, actor, rollout_cfg
        self.cross_check = cross_check

    def begin(self, step: int, prompts=None) -> dict[str, float]:
        stats = self.transfer.run()
        metrics = {"rollout/transfer_seconds": stats.seconds,
                   "rollout/transfer_bytes_sent": float(stats.bytes_sent)}
        if self.cfg.logprob_check.enable and prompts is not None:  # as the rollout set decides
            metrics.update(self.cross_check(None, self.actor, None, None))
        return metrics

    def end(self) -> None:
        pass
