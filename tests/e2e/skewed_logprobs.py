"""A rollout.generate_fn for the off-policy correction tests (test_off_policy_corrections.py):
the engine's samples as they are, with their log-probs skewed by a fixed amount per token id,

    log pi_engine(t) + shift * ((t mod 5) - 2)       (t the token id)

as an engine whose numerics differ from the trainer's would give them (bf16 vLLM against an
fp32 actor), only larger and known: the ratio pi_old / pi_engine of a token is then
exp(-shift * ((t mod 5) - 2)) up to the engine's and the trainer's own tiny difference, so the
corrections act on a known share of the tokens in a 1-rank CPU run."""
from __future__ import annotations

import dataclasses


def skewed(engine, prompts, sampling, shift: float = 0.3):
    outputs = engine.generate(prompts.input_ids, sampling)
    if not sampling.logprobs:
        return outputs
    return [dataclasses.replace(o, logprobs=[lp + shift * ((t % 5) - 2)
                                             for lp, t in zip(o.logprobs, o.token_ids)])
            for o in outputs]
