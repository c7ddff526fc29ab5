"""Reward-model role: one scalar per sequence from a megatron model with a `score` head.

The model is an HF *ForSequenceClassification checkpoint (or its dist-checkpoint conversion)
built at the run's TP/PP like the other roles (models/gpt.py: a `ScalarHead` holding the HF
`score` weight); the engine returns one value per position, `[b, s, n_labels]`, and the score of
a sequence is label 0 of the output at its LAST token (prompt + response, the EOS included when
the response has one). That is the position verl's reward-model worker reads
(argmax of position_ids * attention_mask) and the one transformers' sequence classifier pools
when the padding token is not the sequence's last token.

Scoring is collective over the reward model's role set (every rank of the run when colocated):
each of its ranks calls `score` with the same global batch; the engine splits the sequences
over its data-parallel ranks (forward only, packed or padded micro-batches) and every rank of
the set gets all B scores back, as with the critic's values.

Tokens. When the reward model's tokenizer is the actor's (same vocabulary and chat template) the
rollout's token ids are scored as they are. Otherwise each sample is re-tokenised with the reward
model's tokenizer, as verl does: the dataset row's chat messages (data.prompt_key) plus the
response text as the assistant's turn, through the reward model's chat template
(`retokenize`). A sequence longer than the reward model's max_position_embeddings keeps its
last tokens (the scored position is the last one), counted in `truncated`.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from verl_mcore.engine.actor import micro_batching
from verl_mcore.engine.batch import TrainBatch
from verl_mcore.engine.engine import MegatronEngine

logger = logging.getLogger(__name__)


def last_token_scores(output: Tensor, mb) -> Tensor:
    """Model output `[b, s, k]` (or `[b, s]`) -> `[n]` float32: label 0 at each row's last token.

    The last token of row i sits one position after the logit that predicts its last response
    token (MicroBatch.gather_index), and every row has at least one response token."""
    flat = output.reshape(mb.input_ids.numel(), -1)[:, 0] if output.dim() == 3 else output.reshape(-1)
    if flat.numel() != mb.input_ids.numel():
        raise ValueError(f"reward model output {tuple(output.shape)} is not one value per token of "
                         f"input_ids {tuple(mb.input_ids.shape)}")
    if mb.num_samples == 0:
        return flat.new_zeros(0, dtype=torch.float32)
    last_col = mb.gather_valid.sum(dim=1) - 1
    index = mb.gather_index.gather(1, last_col[:, None]).squeeze(1) + 1
    return flat[index].float()


class RewardModelScorer:
    """A reward-model source (`reward.sources[i]` of type reward_model), forward only.

    name: the source's name; tokenizer: the reward model's own; retokenize: whether the ids
    must be rebuilt from text (the actor's tokenizer differs); prompt_key: the dataset column
    holding the chat messages; max_positions: the model's max_position_embeddings."""

    def __init__(self, engine: MegatronEngine, name: str, *, tokenizer: Any, retokenize: bool,
                 prompt_key: str, max_positions: int,
                 max_tokens_per_microbatch: Optional[int] = None,
                 micro_batch_size: Optional[int] = None):
        if engine.optimizer is not None:
            raise ValueError(f"reward model {name!r}: build its engine with optim=None (forward only)")
        self.engine = engine
        self.name = name
        self.tokenizer = tokenizer
        self.retokenize = retokenize
        self.prompt_key = prompt_key
        self.max_positions = max_positions
        self.mb_kwargs = micro_batching(max_tokens_per_microbatch, micro_batch_size)
        self.truncated = 0  # sequences cut to max_positions in the last `score` call

    def score(self, batch: TrainBatch, rows: Sequence[dict], responses: Sequence[str]) -> Tensor:
        """`[B]` float32 scores of the batch's sequences, the same on every rank (collective).
        rows / responses: the samples' dataset rows and decoded response texts (read only when
        the ids must be rebuilt with the reward model's tokenizer)."""
        if self.retokenize:
            batch = self.tokenized(rows, responses)
        parts = []

        def collect(out, mb):
            parts.append((mb.rows, last_token_scores(out, mb)[:, None]))
            return None, {}

        self.engine.forward_backward(self.engine.micro_batches(batch, **self.mb_kwargs), collect,
                                     forward_only=True)
        return self.engine.gather_rows(parts, batch.num_samples, 1)[:, 0]

    def tokenized(self, rows: Sequence[dict], responses: Sequence[str]) -> TrainBatch:
        """The samples as the reward model's tokenizer and chat template write them."""
        sequences = [retokenize(self.tokenizer, row, text, self.prompt_key)
                     for row, text in zip(rows, responses)]
        self.truncated = sum(len(s) > self.max_positions for s in sequences)
        if self.truncated:
            logger.warning("reward model %r: %d sequences longer than its %d positions keep their "
                           "last tokens", self.name, self.truncated, self.max_positions)
        sequences = [s[-self.max_positions:] for s in sequences]
        short = next((i for i, s in enumerate(sequences) if len(s) < 2), None)
        if short is not None:
            raise ValueError(f"reward model {self.name!r}: its tokenizer turned sample {short} into "
                             f"{len(sequences[short])} token(s)")
        # The split into prompt and response does not matter to a reward model (only the last
        # position is read); TrainBatch needs one response token.
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return TrainBatch.from_sequences([s[:-1] for s in sequences], [s[-1:] for s in sequences], pad)


def retokenize(tokenizer: Any, row: dict, response: str, prompt_key: str) -> list[int]:
    """Token ids of one sample in the reward model's own format: the row's chat messages with the
    response as the assistant's turn, through its chat template; a plain-text prompt (or a
    tokenizer without a template) is prompt text + response text."""
    prompt = row.get(prompt_key)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"reward model re-tokenisation: the row's {prompt_key!r} is neither chat "
                         f"messages nor text ({type(prompt).__name__})")
    messages.append({"role": "assistant", "content": response})
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding (transformers 5)
            ids = ids["input_ids"]
        return list(ids)
    text = "".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether token ids of `a` mean the same to `b`: the same vocabulary, special tokens and chat
    template (then the rollout's ids are scored without re-tokenising)."""
    return (a.get_vocab() == b.get_vocab()
            and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
            and a.all_special_tokens == b.all_special_tokens)
