"""GenerationPhase's weight-sync check on the step's own samples (generation.py), without ranks:
a stub engine and a stub trainer side."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.rollout.test_vllm_engine import FakeVllmSampling
from verl_mcore.config.schema import RolloutConfig
from verl_mcore.generation import GenerationPhase
from verl_mcore.rollout.base import SampleOutput, SamplingParams
from verl_mcore.rollout.vllm_engine import VLLMEngine, to_vllm_sampling

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


class _FakeVllm(VLLMEngine):
    """The vLLM engine up to the vLLM call: the sampling goes through the real translation
    (which refuses log-probs of a truncated distribution); every token has log-prob -0.5."""

    def __init__(self):
        self.calls: list[SamplingParams] = []

    def load_weights(self):
        return {}

    def wake(self):
        pass

    def sleep(self):
        pass

    def generate(self, prompt_token_ids, sampling):
        to_vllm_sampling(sampling, FakeVllmSampling, len(prompt_token_ids))
        self.calls.append(sampling)
        return [SampleOutput(i, j, [10, 11, 12], [-0.5] * 3 if sampling.logprobs else None, "length")
                for i in range(len(prompt_token_ids)) for j in range(sampling.n)]


@pytest.mark.parametrize("top_p, top_k", [(0.9, -1), (1.0, 20)])
def test_vllm_with_top_p_or_top_k_still_checks_the_weights(top_p, top_k):
    """vLLM's log-probs come after top-k / top-p, so it refuses them for truncated sampling: the
    check must not turn every step of such a run into that error, and must still check."""
    engine = _FakeVllm()
    cfg = RolloutConfig(top_p=top_p, top_k=top_k)
    cfg.logprob_check.max_abs_diff = 1e-3
    phase = GenerationPhase(engine, None, SimpleNamespace(whole=None), cfg, (2,), 8, 0)
    seen = []

    def trainer(prompts, responses, temperature):
        seen.append(responses)
        return [[-0.5] * len(r) for r in responses]

    phase.actor_logprobs = trainer
    phase.begin(1, PROMPTS)
    sp = SamplingParams(n=2, temperature=1.0, top_p=top_p, top_k=top_k, max_new_tokens=8, seed=1)
    outputs = phase.generate(PROMPTS, sp)
    assert len(outputs) == 6 and all(o.logprobs is None for o in outputs)  # the step's, as asked
    metrics = phase.check_samples()
    assert metrics["rollout/logprob_diff_max"] == 0.0 and seen, metrics
    assert len(seen[0]) == min(cfg.logprob_check.num_sequences, len(PROMPTS))
    own = engine.calls[-1]  # the check's few sequences, from the whole distribution
    assert (own.n, own.top_p, own.top_k, own.logprobs) == (1, 1.0, -1, True), own
    phase.end()


class _KeepingEngine:
    """What GenerationPhase reads of NativeEngine's kept cache: sleep keeps it within budget."""

    logprobs_when_truncated = True

    def __init__(self, cache_bytes: int):
        self.cache_bytes, self.keep_cache_bytes, self.kept_bytes, self.held = cache_bytes, 0, 0, True

    def wake(self):
        self.held = True

    def load_weights(self):
        return {}

    def sleep(self):
        self.kept_bytes = self.cache_bytes if self.cache_bytes <= self.keep_cache_bytes else 0
        self.held = bool(self.kept_bytes)


def test_a_checkpoint_save_frees_the_kept_cache_and_keeps_the_budget():
    engine = _KeepingEngine(100)
    phase = GenerationPhase(engine, None, SimpleNamespace(whole=None), RolloutConfig(), (2,), 8, 0)
    phase.cache_budget(1000)
    phase.begin(1)
    phase.end()
    assert engine.held and phase.kept_bytes == 100
    assert phase.take_stats()["rollout/kept_cache_gb"] == 100 / 2**30
    phase.release_cache()
    assert not engine.held and phase.kept_bytes == 0 and engine.keep_cache_bytes == 1000
    phase.cache_budget(99)  # a smaller budget than the cache: freed at the next sleep
    phase.begin(2)
    phase.end()
    assert not engine.held and phase.kept_bytes == 0
