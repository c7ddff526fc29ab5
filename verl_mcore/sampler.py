"""Sampling a prompt batch: the actor's weights into the generation layout, the engine's
responses for this replica's prompts, the global batch on every rank.

    sampler.begin(step, next_prompt_ids)    # weights in (the engine's ranks; a rollout set's
                                            # from the actor's ranks), the sync check armed
    part, failure = sampler.sample_part(prompts, sampling)   # the generating set's ranks
    batch = sampler.share_part(prompts, part, failure)       # every rank, or raise everywhere
    sampler.end()                           # the KV cache goes back before training

Where no engine runs (a training rank of a rollout set of its own) `sample_part` returns
(None, None) and `share_part` receives; `begin` sends the weights from the actor's ranks.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from verl_mcore.agent.runtime import AgentRuntime
from verl_mcore.config.seeds import rollout_seed
from verl_mcore.rollout.base import SamplingParams
from verl_mcore.rollout.batch import Rollout
from verl_mcore.rollout.gather import agreed_failure, gather_rollout, share_rollout
from verl_mcore.rollout.generate_fn import GenerateHandle, UserGenerateFn

# The step's phases of sampling (timed by the producer); the others are the training's.
GENERATING = ("sync", "gen", "wait_rollout")


class Sampler:
    """cfg: the run's Config; info: the actor's ModelInfo (tokenizer, EOS ids, vocabulary);
    place: the run's RolePlacement; generation: this rank's GenerationPhase (None where no engine
    runs); sender: the WeightSender of an actor rank of a rollout set of its own, else None;
    generate_fn: rollout.generate_fn's function (rollout/generate_fn.py), which samples each
    batch in place of one engine call, or None; agent_loop: rollout.agent_loop's runtime
    (agent/runtime.py), which runs each batch's trajectories over the engine instead, or None."""

    def __init__(self, cfg, info, place, generation=None, sender=None,
                 generate_fn: Optional[UserGenerateFn] = None, agent_loop: Optional[AgentRuntime] = None):
        self.cfg, self.info, self.place = cfg, info, place
        self.generation, self.sender, self.generate_fn = generation, sender, generate_fn
        self.agent_loop = agent_loop

    @property
    def generates(self) -> bool:
        """Whether an engine runs on this rank."""
        return self.generation is not None

    @property
    def sends_weights(self) -> bool:
        """Whether this rank sends the actor's weights to a rollout set of its own."""
        return self.sender is not None

    def begin(self, step: int, prompt_ids=None) -> dict[str, float]:
        """The actor's weights into the generation layout (the engine's ranks receive them, a
        rollout set's from the actor's ranks), and with `prompt_ids` (the next batch's, on the
        engine's ranks; True on the sending ones) the weight-sync check on a few of them;
        nothing elsewhere."""
        if self.sender is not None:
            return self.sender.begin(step, prompt_ids)
        if self.generation is None:
            return {}
        return self.generation.begin(step, prompt_ids)

    def end(self) -> None:
        if self.generation is not None:
            self.generation.end()

    def stats(self) -> dict[str, float]:
        """The engine's stats of the calls since the last look (preemptions, peak live
        sequences, slot occupancy, shared prompt blocks) and the weight-sync check's metrics;
        nothing where no engine runs."""
        return {} if self.generation is None else self.generation.take_stats()

    def sampling(self, n: int, temperature: float, batch: int, seed_offset: int = 0):
        """How to sample batch number `batch` + 1; the seed depends on the batch, the offset
        and the replica, not on when it is sampled. The engine's log-probs come along where the
        trainer reads them (a rollout set of its own, rollout.tis_cap, rollout.correction)."""
        r = self.cfg.rollout
        greedy = temperature == 0
        return SamplingParams(
            n=n, temperature=temperature, top_p=1.0 if greedy else r.top_p,
            top_k=-1 if greedy else r.top_k, max_new_tokens=self.cfg.data.max_response_length,
            stop_token_ids=self.info.eos_token_ids,
            seed=rollout_seed(self.cfg) + 1000003 * (batch + seed_offset) + self._gen_replica(),
            logprobs=self.cfg.placement.rollout is not None or r.weighs_engine_log_probs,
        )

    def generate(self, prompts, sampling) -> Rollout:
        """Sample responses for this replica's prompts; the global rollout batch on every
        rank (sample_part, then share_part)."""
        batch = self.share_part(prompts, *self.sample_part(prompts, sampling))
        return batch.for_learner(self.info)

    def sample_part(self, prompts, sampling, failure: Optional[BaseException] = None):
        """(the generating set's batch, None) on its ranks, (None, the error) where its
        sampling failed, or this rank's earlier `failure` (then it does not sample), on any of
        them, (None, None) on the ranks that only receive.

        Global order: generation replica, then prompt, then sample, so the n samples of a prompt
        are consecutive (mini-batches keep GRPO groups together) and group ids count prompts.
        The batch crosses ranks as tensors, token ids in one flat buffer (rollout/gather.py).
        """
        if self.generation is None:
            return None, None
        vocab, groups = self.info.arch.vocab_size, self.generation.groups
        mine = None
        try:
            if failure is None:
                outputs = self._outputs(prompts, sampling)
                if groups.gen_tp_rank == 0:  # every rank of a TP_g group holds the same samples
                    mine = Rollout.from_outputs(prompts, outputs, vocab)
        except Exception as e:  # noqa: BLE001 - raised on every rank by share_part
            failure = e
        # A replica that failed would leave the others waiting in the gather: agree first.
        failure = agreed_failure(failure, groups.whole, "gathering the samples")
        if failure is None:
            try:  # after a weight update, on a few of these samples (generation.py)
                self.generation.check_samples()
            except Exception as e:  # noqa: BLE001 - WeightSyncError comes on every rank alike
                failure = e
        if failure is not None:
            return None, failure
        return gather_rollout(mine, groups, vocab), None

    def _outputs(self, prompts, sampling):
        """The engine's samples of this replica's prompts: one engine call, rollout.generate_fn's,
        or rollout.agent_loop's trajectories (their output checked before it enters the batch)."""
        if self.agent_loop is not None:
            return self.agent_loop(self.generation, prompts, sampling)
        if self.generate_fn is None:
            return self.generation.generate(prompts.input_ids, sampling)
        engine = GenerateHandle(self.generation, self.info.tokenizer, self.info.eos_token_ids,
                                self.cfg.data.max_response_length)
        return self.generate_fn(engine, prompts, sampling, self.info.arch.vocab_size)

    def share_part(self, prompts, batch, failure=None):
        """The generating set's batch on every rank (a failure there raises on every rank)."""
        return share_rollout(self.place, batch, prompts, self.info.arch.vocab_size, failure)

    def _gen_replica(self) -> int:
        """This rank's generation replica (0 where no engine runs, which samples nothing)."""
        return self.generation.groups.gen_dp_rank if self.generation is not None else 0

    def close(self) -> None:
        """Stop what the sampling started beside the engine: the agent tools' sandbox."""
        if self.agent_loop is not None:
            self.agent_loop.close()

    def release_cache(self) -> None:
        """Free the KV cache the engine keeps through training (before a checkpoint save,
        whose memory the step's budget did not see)."""
        if self.generation is not None:
            self.generation.release_cache()

    def leave_cache_room(self, timer) -> None:
        """How much KV cache the colocated engine may keep through the next steps' training (its
        cache and CUDA graphs then stay, NativeEngine.sleep): a quarter of the GPU memory this
        step's training phases left free (timer: the step's StageTimer), their peak less what the
        engine kept through them. The same on every rank (the least), so the ranks of a
        generation TP group keep or free together. Nothing on CPU: there the engine frees its
        cache after each call."""
        if not timer.cuda:
            return
        kept = self.generation.kept_bytes if self.generation is not None else 0
        training = [peak for name, peak in timer.peak_bytes.items() if name not in GENERATING]
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        free = (total - max(training) + kept) // 4 if training else 0
        room = torch.tensor([free], dtype=torch.int64, device="cuda")
        if dist.is_initialized():
            dist.all_reduce(room, op=dist.ReduceOp.MIN)
        if self.generation is not None:
            self.generation.cache_budget(int(room.item()))
