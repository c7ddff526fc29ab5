"""The rollout engine contract: sampling parameters, outputs, and the engine interface.

Every rank of a generation TP group calls the engine with the same prompts and the same
`SamplingParams`, and gets the same outputs back (the engines guarantee identical tokens across the
ranks of a group). Different generation DP replicas pass different prompts.

Per step the trainer does:

    engine.wake()                 # re-acquire weights / KV-cache memory
    engine.load_weights()         # pull the actor's current weights (repartition / stream)
    outputs = engine.generate(prompt_token_ids, SamplingParams(...))
    engine.sleep()                # release the KV cache (and the weight copy) before training

Log-probabilities: `SampleOutput.logprobs[t]` is log softmax(logits_t / T)[token_t] over the real
vocabulary (padded rows excluded), with T the sampling temperature (T = 1 for greedy), *before*
top-k / top-p filtering. That is the quantity the trainer recomputes as the "old" log-prob, so the
weight-sync check compares like with like. It is not the log-prob under the truncated
distribution the token was actually drawn from.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Literal, Optional, Sequence

# Why a sequence ended. "aborted": the engine stopped it before a stop token or the length limit
# (a partial rollout interrupted for a weight update, a cancelled request); its tokens so far are
# kept. New reasons go at the end: a reason's code is its index here (rollout/gather.py), and
# checkpoints of batches sampled ahead hold the codes.
FinishReason = Literal["stop", "length", "aborted"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` is greedy (top_p / top_k / seed are then ignored).

    n: samples per prompt. top_k: -1 (or 0) is off. max_new_tokens: response tokens at most.
    stop_token_ids: a sampled token from this set ends the sequence and is kept as its last token
        (finish reason "stop"); usually the tokenizer's eos id(s).
    seed: base of the per-sequence random streams: sample j of prompt i at step t always draws the
        same number, whatever the batching, so a seeded call is reproducible. Give each step and
        each generation DP replica its own seed (replicas with the same seed and different prompts
        would share random numbers). None: drawn from torch's default generator.
    logprobs: also return per-token log-probs (see the module docstring for which).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = None
    logprobs: bool = False

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass
class SampleOutput:
    """One generated sequence: sample `sample_index` (0..n-1) of prompt `prompt_index`.

    token_ids: the response only (no prompt), including the stop token when finish_reason is
        "stop"; in a multi-turn trajectory also the tokens put in between (tool output).
    finish_reason: "stop" (a stop token was sampled), "length" (max_new_tokens) or "aborted"
        (stopped by the engine's caller before either; see FinishReason).

    Per-token fields (rollout/token_fields.py), one value per response token, or None:
    logprobs: the engine's (see the module docstring); None when not requested.
    loss_mask: 1 where the model wrote the token, 0 where it did not (tool output inserted into
        the response): those count in no loss. None: every token 1.
    versions: the policy version (steps completed) that sampled each token, for a trajectory
        sampled over weight updates. None: every token the batch's version.
    extras: values of the other declared per-token fields by name (MoE routing...).
    turns: the model's turns in the response (an agent loop's; 1 for one continuation).
    reward: a reward the sampling itself gave the whole response (an agent loop's environment,
        agent/loop.py); None: only the configured reward sources score it.
    info: what the sampling reported about the response beside its tokens (an agent loop's
        run result's other keys), by name.
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: FinishReason
    loss_mask: Optional[Sequence[int]] = None
    versions: Optional[Sequence[int]] = None
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    turns: int = 1
    reward: Optional[float] = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        own = sorted(set(self.extras) & set(OWN_TOKEN_FIELDS))
        if own:
            raise ValueError(f"SampleOutput.extras {own}: set them as SampleOutput.{own[0]}")

    def token_values(self, name: str) -> Optional[Any]:
        """The values of per-token field `name` (an attribute above, or one of the extras), or
        None when this sample does not carry it."""
        if name in OWN_TOKEN_FIELDS:
            return getattr(self, name)
        return self.extras.get(name)


OWN_TOKEN_FIELDS = ("logprobs", "loss_mask", "versions")


class RolloutEngine(abc.ABC):
    """A generation engine living inside the training ranks (SPMD: every rank calls every method)."""

    # Whether `generate` returns log-probs (the module docstring's) for sampling that top-k /
    # top-p truncate; vLLM's would be the truncated distribution's, so it refuses them there.
    logprobs_when_truncated = True

    @abc.abstractmethod
    def load_weights(self) -> dict[str, float]:
        """Make the engine generate with the actor's current weights; returns metrics (bytes moved,
        seconds). Call after `wake()`."""

    @abc.abstractmethod
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams
                 ) -> list[SampleOutput]:
        """Sample `sampling.n` responses per prompt; outputs ordered by (prompt_index,
        sample_index). Every rank of a generation TP group must pass the same prompts."""

    def serving(self, sampling: SamplingParams, *, max_len: int, sessions: int):
        """A step-wise serving session (rollout/serving.py): a context manager giving a
        `serving.Server`, whose requests join and leave between decode rounds. max_len: the
        longest context + new tokens of a request; sessions: sequences held at once."""
        raise NotImplementedError(f"{type(self).__name__} has no step-wise serving (agent loops "
                                  "need it): use rollout.engine=native")

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release the KV cache and, where the engine owns a separate copy, the weights memory."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Re-acquire what `sleep()` released (weights must be reloaded with `load_weights()`)."""
