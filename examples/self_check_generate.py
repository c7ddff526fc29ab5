"""A custom generation function (rollout.generate_fn): answer, then check the answer in a second
pass whose tokens do not train.

    rollout:
      generate_fn:
        path: examples/self_check_generate.py
        name: answer_then_check
        kwargs: {check: "\\nCheck the answer above.", check_tokens: 8}

Each response is the model's answer, then the check instruction, then the model's check of its
answer; the loss mask is 1 on the answer only, so the update trains the answer and nothing of
the second pass. The reward reads what the loss mask keeps (rollout/batch.py decode_responses:
the answer alone, neither the instruction nor the check), so a scorer cannot reward the check.
"""
from __future__ import annotations

import dataclasses

from verl_mcore.rollout.base import SampleOutput

SECOND_PASS_SEED_OFFSET = 500_001


def answer_then_check(engine, prompts, sampling, check: str = "\nCheck the answer above.",
                      check_tokens: int = 8):
    answers = engine.generate(prompts.input_ids, sampling)  # n per prompt
    instruction = engine.tokenizer.encode(check, add_special_tokens=False)
    # What the second pass may add: the response as a whole fits max_new_tokens.
    room = [sampling.max_new_tokens - len(a.token_ids) - len(instruction) for a in answers]
    second = [i for i, r in enumerate(answers) if room[i] > 0]
    checks = {}
    if second:
        budget = min(check_tokens, min(room[i] for i in second))
        prompt_ids = [prompts.input_ids[answers[i].prompt_index] + answers[i].token_ids + instruction
                      for i in second]
        # A stream of its own: the engine's randomness is a function of (seed, prompt index,
        # sample index), and the trainer seeds replica r of batch b with base + 1000003 b + r, so
        # seed + 1 would replay the next replica's draws. Half the batch stride is no replica's.
        seed = None if sampling.seed is None else sampling.seed + SECOND_PASS_SEED_OFFSET
        outputs = engine.generate(prompt_ids, dataclasses.replace(
            sampling, n=1, max_new_tokens=budget, seed=seed))
        checks = {second[o.prompt_index]: o for o in outputs}
    out = []
    for i, a in enumerate(answers):
        c = checks.get(i)
        added = instruction + c.token_ids if c is not None else []
        logprobs = None
        if a.logprobs is not None:  # the engine's for the answer; 0.0 where it sampled nothing
            logprobs = list(a.logprobs) + [0.0] * len(added)
        out.append(SampleOutput(a.prompt_index, a.sample_index, a.token_ids + added, logprobs,
                                a.finish_reason, loss_mask=[1] * len(a.token_ids) + [0] * len(added)))
    return out
