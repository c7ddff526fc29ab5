"""The generation phase of a step: wake the engine, bring it the actor's weights, check them,
generate, and put the engine back to sleep so training gets its memory.

    phase.begin(step, prompts)   # wake + repartition/push weights + (optional) weight-sync check
    phase.generate(prompt_ids, sampling)      # as often as the step needs (samples, baselines)
    phase.end()                  # release the KV cache and the generation weight buffer

The weight-sync check compares the engine's log-probs of a few freshly sampled sequences with the
actor's own (training-layout, any PP) log-probs of the same tokens; a broken repartition stops
the run with `rollout/logprob_diff_max` in the message instead of training on another model.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

from verl_mcore.rollout.base import SamplingParams


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

    def begin(self, step: int, prompts: Optional[Sequence[Sequence[int]]] = None) -> dict[str, float]:
        self.engine.wake()
        self.awake = True
        metrics = dict(self.engine.load_weights())
        check = self.cfg.logprob_check
        if check.enable and prompts is not None:
            from verl_mcore.rollout.sync_check import check_weight_sync

            length = min(self.max_new_tokens, check.max_new_tokens or self.max_new_tokens)
            sampling = SamplingParams(n=1, temperature=self.cfg.temperature, top_p=1.0, top_k=-1,
                                      max_new_tokens=length, stop_token_ids=self.eos,
                                      seed=self.cfg.seed + 7919 * step + self.groups.gen_dp_rank,
                                      logprobs=True)
            metrics.update(check_weight_sync(self.engine, self.actor_logprobs,
                                             list(prompts)[:check.num_sequences], sampling,
                                             check.max_abs_diff, group=self._set_group()))
        return metrics

    def generate(self, prompt_ids, sampling: SamplingParams):
        assert self.awake, "GenerationPhase.generate outside begin()/end()"
        return self.engine.generate(prompt_ids, sampling)

    def end(self) -> None:
        self.engine.sleep()
        self.awake = False

    def _set_group(self):
        """The actor set's ranks (the world when colocated): the check's collectives stay there,
        while ranks of other roles run their own phases."""
        return getattr(self.groups, "whole", None)

    def actor_logprobs(self, prompts, responses, temperature):
        """The trainer side of the sync check: every replica's sequences go through the actor
        together (its roles take the global batch), and each replica gets its own rows back."""
        from verl_mcore.engine.batch import TrainBatch

        lead = self.groups.gen_tp_rank == 0
        mine = list(zip(map(list, prompts), map(list, responses))) if lead else None
        group = self._set_group()
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (self.groups.gen_dp_rank, mine), group=group)
        parts = sorted((g for g in gathered if g[1] is not None), key=lambda g: g[0])
        seqs = [pr for _, part in parts for pr in part]
        if not seqs:
            return []
        offset = sum(len(part) for r, part in parts if r < self.groups.gen_dp_rank)
        batch = TrainBatch.from_sequences([p for p, _ in seqs], [r for _, r in seqs], self.pad)
        logp, _ = self.actor.compute_log_prob(batch)
        return [logp[offset + i, :len(r)].cpu() for i, r in enumerate(responses)]


def build_generation_phase(cfg, groups, info, actor) -> GenerationPhase:
    """The engine named by rollout.engine, over the actor's weights in the generation layout."""
    from verl_mcore.build import build_generation_model

    r = cfg.rollout
    model, repartitioner = build_generation_model(cfg, groups, info, actor)
    if r.engine == "vllm":
        from verl_mcore.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine.from_config(cfg, groups, info, model, repartitioner)
    else:
        from verl_mcore.rollout.native import NativeEngine

        engine = NativeEngine(model, vocab_size=info.arch.vocab_size,
                              tp_group=groups.gen_tp if r.tensor_parallel_size > 1 else None,
                              repartitioner=repartitioner,
                              keep_weights_buffer=r.keep_weights_buffer,
                              max_num_seqs=r.max_num_seqs,
                              gpu_memory_utilization=r.gpu_memory_utilization)
    return GenerationPhase(engine, actor, groups, r, info.eos_token_ids,
                           cfg.data.max_response_length, info.pad_token_id)
