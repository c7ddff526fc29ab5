"""rollout.generate_fn: a user's generation function in place of the engine's one call per batch.

    def generate(engine, prompts, sampling, **kwargs) -> list[SampleOutput]

engine    a GenerateHandle: `engine.generate(prompt_ids, sampling)` -> [SampleOutput] runs the
          configured engine (as many calls as the function likes: a second pass, tool turns);
          `engine.tokenizer`, `engine.eos_token_ids`, `engine.max_new_tokens`.
prompts   this generation replica's prompt batch: `prompts.input_ids` [P] token-id lists (the
          chat template applied), `prompts.rows` [P] their dataset rows.
sampling  the batch's SamplingParams (n, temperature, top_p, top_k, max_new_tokens,
          stop_token_ids, seed; logprobs when the trainer reads the engine's log-probs).
returns   rollout/base.py SampleOutputs, n per prompt: prompt_index, sample_index (0..n-1),
          token_ids (the response: every token after the prompt, at most max_new_tokens),
          finish_reason, logprobs (one per token; required when sampling.logprobs), loss_mask (1
          where the token trains, 0 on tokens the model did not write or that must not train,
          e.g. a tool's output or a second pass; None: all 1).

Where it runs. On every rank of each generation replica (its TP_g group), with that replica's
prompts: the engine's calls are collective over the group, so the function must make the same
calls on each of its ranks (no unseeded randomness, nothing rank-dependent); replicas may make
different calls. The weight-sync check (rollout.logprob_check) reads the first engine call after
a weight update (a replica that made none takes part without samples).

What it returns is checked before it enters the batch: a missing or doubled sample, a token id
outside the vocabulary, a response over max_new_tokens, a loss mask, log-probs or versions of the
wrong length, a log-prob that is not a finite number, a replica's batch whose loss mask is 0 on
every token (nothing would train) stop the run naming the file, the function and the sample. Its file is imported at
start-up in a probe process and its signature checked, before any model is built.
"""
from __future__ import annotations

import math
import numbers
import typing
from typing import Any, Callable, Mapping, Optional, Sequence

from verl_mcore.rollout.base import FinishReason, SampleOutput, SamplingParams
from verl_mcore.user_code import UserFunction, load_user_function

_KEY = "rollout.generate_fn"
SIGNATURE = "fn(engine, prompts, sampling, **kwargs) -> list[SampleOutput]"
_FINISH = frozenset(typing.get_args(FinishReason))


class GenerateFnError(RuntimeError):
    """rollout.generate_fn raised, or returned samples the batch cannot take."""


class GenerateHandle:
    """What a generate function may use of the engine (module docstring)."""

    def __init__(self, generation, tokenizer, eos_token_ids: Sequence[int], max_new_tokens: int):
        self._generation = generation
        self.tokenizer, self.eos_token_ids = tokenizer, list(eos_token_ids)
        self.max_new_tokens = max_new_tokens

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[SampleOutput]:
        """The engine's samples of `prompt_ids` (a collective call over the replica's ranks)."""
        return self._generation.generate(prompt_ids, sampling)


class UserGenerateFn(UserFunction):
    """rollout.generate_fn's function, called as fn(engine, prompts, sampling, **kwargs)."""

    def __init__(self, fn: Callable, kwargs: Mapping[str, Any], path: str, name: str):
        super().__init__(_KEY, fn, kwargs, path, name)

    def __call__(self, engine: GenerateHandle, prompts, sampling: SamplingParams,
                 vocab_size: int) -> list[SampleOutput]:
        outputs = self.call(engine, prompts, sampling,
                            doing_what=f"on {len(prompts.input_ids)} prompts",
                            returns="return samples", error=GenerateFnError)
        check_outputs(outputs, len(prompts.input_ids), sampling, vocab_size, self.label)
        return outputs


def check_outputs(outputs: Any, prompts: int, sampling: SamplingParams, vocab_size: int,
                  label: str) -> None:
    """What a generate function returned can enter the batch (module docstring); raises
    GenerateFnError naming `label` and the first bad sample."""
    if not isinstance(outputs, (list, tuple)):
        raise GenerateFnError(f"{label} returned {type(outputs).__name__}; it returns a list of "
                              "rollout.base.SampleOutput, n per prompt")
    seen: set[tuple[int, int]] = set()
    trained = tokens_total = 0  # tokens with loss_mask 1, tokens in all
    for i, o in enumerate(outputs):
        where = f"{label}: sample {i} of its output"
        if not isinstance(o, SampleOutput):
            raise GenerateFnError(f"{where} is a {type(o).__name__}, not a rollout.base.SampleOutput")
        key = (o.prompt_index, o.sample_index)
        where += f" (prompt_index {o.prompt_index}, sample_index {o.sample_index})"
        if not (_is_int(o.prompt_index) and _is_int(o.sample_index)):
            raise GenerateFnError(f"{where}: prompt_index {o.prompt_index!r} and sample_index "
                                  f"{o.sample_index!r} must be ints")
        if not (0 <= o.prompt_index < prompts and 0 <= o.sample_index < sampling.n):
            raise GenerateFnError(f"{where}: out of range ({prompts} prompts, n={sampling.n})")
        if key in seen:
            raise GenerateFnError(f"{where}: returned twice")
        seen.add(key)
        tokens = o.token_ids
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
            raise GenerateFnError(f"{where}: token_ids is a {type(tokens).__name__}, not a list "
                                  "of token ids")
        if len(tokens) > sampling.max_new_tokens:
            raise GenerateFnError(f"{where}: {len(tokens)} response tokens, more than "
                                  f"max_new_tokens={sampling.max_new_tokens} "
                                  "(data.max_response_length): the batch cannot hold it")
        bad = next((t for t in tokens if not _is_int(t) or not 0 <= t < vocab_size), _NONE)
        if bad is not _NONE:
            raise GenerateFnError(f"{where}: token id {bad!r} is not an int in [0, {vocab_size})")
        if o.finish_reason not in _FINISH:
            raise GenerateFnError(f"{where}: finish_reason {o.finish_reason!r} is none of "
                                  f"{sorted(_FINISH)}")
        for field in ("loss_mask", "logprobs", "versions"):
            values = getattr(o, field)
            if values is not None and len(values) != len(tokens):
                raise GenerateFnError(f"{where}: {len(values)} {field} values for "
                                      f"{len(tokens)} response tokens")
        if o.loss_mask is not None and any(v not in (0, 1) for v in o.loss_mask):
            raise GenerateFnError(f"{where}: loss_mask holds values other than 0 and 1")
        if sampling.logprobs and o.logprobs is None:
            raise GenerateFnError(f"{where}: no logprobs, but the trainer reads the engine's "
                                  "log-probs (placement.rollout, rollout.tis_cap or "
                                  "rollout.correction): keep the engine's (0.0 for tokens it "
                                  "did not sample)")
        # NaN or a string here would end far away (a non-finite loss, a torch error)
        bad = next((v for v in o.logprobs or () if not _is_finite(v)), _NONE)
        if bad is not _NONE:
            raise GenerateFnError(f"{where}: logprobs value {bad!r} is not a finite number (the "
                                  "engine's log-prob, 0.0 for a token it did not sample)")
        bad = next((v for v in o.versions or () if not _is_int(v)), _NONE)
        if bad is not _NONE:
            raise GenerateFnError(f"{where}: versions value {bad!r} is not an int (the policy "
                                  "version that sampled the token)")
        tokens_total += len(tokens)
        trained += len(tokens) if o.loss_mask is None else sum(int(v) for v in o.loss_mask)
    if len(seen) != prompts * sampling.n:
        missing = next((p, s) for p in range(prompts) for s in range(sampling.n) if (p, s) not in seen)
        raise GenerateFnError(f"{label} returned {len(seen)} samples for {prompts} prompts x "
                              f"n={sampling.n}; missing prompt_index {missing[0]}, sample_index "
                              f"{missing[1]}")
    if tokens_total and not trained:  # an inverted mask, most likely: refuse a no-op update
        raise GenerateFnError(f"{label}: loss_mask is 0 on every token of all {len(seen)} samples "
                              "of the batch, so none would train: 1 marks the tokens the model "
                              "wrote (train), 0 those it did not (a tool's output)")


_NONE = object()  # no bad value found


def _is_int(value: Any) -> bool:
    """An int (numpy's too), not a bool, whose True / False would hide a mistake."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def load_generate_fn(cfg) -> Optional[UserGenerateFn]:
    """rollout.generate_fn's function (cfg: its UserFunctionConfig), or None when none is
    configured. Its file is imported first in a fresh interpreter under import_timeout_s, where
    the signature is checked, so a file that blocks, exits or fails, a missing name or a wrong
    signature fail before any model is built, naming the file and the function."""
    loaded = load_user_function(cfg, _KEY, ("engine", "prompts", "sampling"), SIGNATURE)
    if loaded is None:
        return None
    fn, path = loaded
    return UserGenerateFn(fn, cfg.kwargs, path, cfg.name)