"""rollout.generate_fn's output is checked before it enters the batch (rollout/generate_fn.py
check_outputs): what the batch could not take, or would train on wrongly, stops the run naming
the function and the sample, instead of a torch error far from it or a silent no-op update.
CPU only, no model; well under a second."""
from __future__ import annotations

import dataclasses

import pytest

from verl_mcore.rollout.base import SampleOutput, SamplingParams
from verl_mcore.rollout.generate_fn import GenerateFnError, check_outputs

LABEL = "rollout.generate_fn gen.py:answer"
VOCAB = 10


def sampling(logprobs=False, n=2):
    return SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4,
                          stop_token_ids=[0], seed=1, logprobs=logprobs)


def outputs(with_logprobs=False, **first):
    """2 prompts x 2 samples of 2 tokens; the first sample's fields replaced by `first`."""
    out = [SampleOutput(p, s, [1, 2], [-0.5, -1.0] if with_logprobs else None, "stop")
           for p in range(2) for s in range(2)]
    out[0] = dataclasses.replace(out[0], **first)
    return out


def test_good_outputs_pass():
    check_outputs(outputs(), 2, sampling(), VOCAB, LABEL)
    check_outputs(outputs(True), 2, sampling(True), VOCAB, LABEL)
    # an empty response, a hole in a mask, tuples: all fine
    check_outputs(outputs(token_ids=[], loss_mask=[]), 2, sampling(), VOCAB, LABEL)
    check_outputs(outputs(token_ids=(1, 2), loss_mask=(1, 0)), 2, sampling(), VOCAB, LABEL)


@pytest.mark.parametrize("first, logprobs, message", [
    ({"token_ids": None}, False, "token_ids is a NoneType, not a list of token ids"),
    ({"token_ids": [None, 1]}, False, "token id None is not an int in [0, 10)"),
    ({"prompt_index": 0.0}, False, "prompt_index 0.0 and sample_index 0 must be ints"),
    ({"sample_index": True}, False, "must be ints"),
    ({"logprobs": [float("nan"), -1.0]}, True, "logprobs value nan is not a finite number"),
    ({"logprobs": ["a", -1.0]}, True, "logprobs value 'a' is not a finite number"),
    ({"logprobs": [None, -1.0]}, True, "logprobs value None is not a finite number"),
    ({"versions": [3]}, False, "1 versions values for 2 response tokens"),
    ({"versions": [3, 2.5]}, False, "versions value 2.5 is not an int"),
], ids=["tokens-none", "token-none", "float-index", "bool-index", "nan-logprob", "str-logprob",
        "none-logprob", "versions-length", "float-version"])
def test_bad_outputs_are_named(first, logprobs, message):
    with pytest.raises(GenerateFnError) as e:
        check_outputs(outputs(logprobs, **first), 2, sampling(logprobs), VOCAB, LABEL)
    assert LABEL in str(e.value) and message in str(e.value), str(e.value)
    assert "prompt_index 0" in str(e.value) or "sample 0" in str(e.value)


def test_a_batch_that_would_train_on_no_token_is_refused():
    """Every sample's loss mask all 0 (an inverted mask): the update would train nothing."""
    zero = [dataclasses.replace(o, loss_mask=[0, 0]) for o in outputs()]
    with pytest.raises(GenerateFnError, match="loss_mask is 0 on every token of all 4 samples"):
        check_outputs(zero, 2, sampling(), VOCAB, LABEL)
    some = [dataclasses.replace(o, loss_mask=[0, 0]) if i else o for i, o in enumerate(outputs())]
    check_outputs(some, 2, sampling(), VOCAB, LABEL)  # samples left out: fine
    empty = [dataclasses.replace(o, token_ids=[], loss_mask=[]) for o in outputs()]
    check_outputs(empty, 2, sampling(), VOCAB, LABEL)  # no token at all: nothing to mask


def test_the_examples_second_pass_draws_no_stream_of_another_replica_or_batch():
    """examples/self_check_generate.py seeds its check pass off the batch's seed. The native
    engine's random stream of a sequence is a function of (seed, prompt index, sample index)
    alone, and replica r of batch b samples with rollout_seed + 1000003 b + r (Sampler.sampling):
    seed + 1 would give replica r's check of its i-th answer the very uniforms of replica r + 1's
    i-th prompt."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    from verl_mcore.config import Config
    from verl_mcore.sampler import Sampler

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("self_check", root / "examples/self_check_generate.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cfg = Config.load(str(root / "configs/quickstart.yaml"), ["rollout.seed=5"])
    info = SimpleNamespace(eos_token_ids=[0])

    def sampler(replica):
        groups = SimpleNamespace(gen_dp_rank=replica)
        return Sampler(cfg, info, None, generation=SimpleNamespace(groups=groups))

    lattice = {sampler(r).sampling(2, 1.0, b).seed for r in range(64) for b in range(200)}
    seeds = []

    class Engine:
        tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [3, 4])
        eos_token_ids, max_new_tokens = [0], 8

        def generate(self, prompt_ids, sp):
            seeds.append(sp.seed)
            return [SampleOutput(p, s, [1], None, "stop") for p in range(len(prompt_ids))
                    for s in range(sp.n)]

    for replica in (0, 3):
        for batch in (0, 7):
            seeds.clear()
            prompts = SimpleNamespace(input_ids=[[5, 6]], rows=[{}])
            example.answer_then_check(Engine(), prompts, sampler(replica).sampling(2, 1.0, batch))
            answer, check = seeds
            assert answer in lattice and check not in lattice, (replica, batch, answer, check)
