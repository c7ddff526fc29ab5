"""One step's rollout batch as the learner reads it (`Rollout`), built from flat samples.

    part = gather_rollout(...)                       # rollout/gather.py: flat, over the wire
    rollout = rollout_from_part(part, part.prompt_of, info)   # TrainBatch + rows + texts
    rollout = make_rollout(samples, group_ids, info)          # from Python lists (tests, API)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from verl_mcore.engine.batch import TrainBatch, response_aligned
from verl_mcore.rollout.gather import RolloutPart, decode_responses


@dataclass
class Rollout:
    """Trajectories: a batch of sampled responses from the engine to the loss, identical on every
    rank. Its flat form, for the wire and the checkpoints of batches sampled ahead, is
    rollout.gather.RolloutPart (per-token fields declared in rollout/token_fields.py); `train`
    is its padded tensor view, which the engine's roles read.

    train       engine.batch.TrainBatch: prompt+response ids, lengths, and the loss mask as its
                response mask [B, R] (0 on tokens the model did not write, rollout.generate_fn)
    rows        [B] the dataset rows of each sample's prompt (reward functions read them)
    group_ids   [B] int64, one id per prompt: samples of the same prompt share it (GRPO, RLOO)
    responses   [B] decoded response texts
    finish      [B] "stop" | "length" | "aborted" (rollout/base.py FinishReason)
    engine_log_probs  [B, R] the engine's log-prob of each response token (0 elsewhere), or
                None when it was not asked for (Sampler.sampling)
    version     the policy version (optimizer updates of the actor) the samples were drawn with
    scores      [B] float32 training scores once scored (the weighted reward sources, DAPO's
                overlong penalty), else None
    extras      "source/key" -> [B] the scorers' numeric extras (None where absent)
    baseline    [B] ReMax's greedy-baseline score of each sample's prompt, or None
    """

    train: Any
    rows: list
    group_ids: torch.Tensor
    responses: list
    finish: list
    engine_log_probs: Optional[torch.Tensor] = None
    version: int = 0
    scores: Optional[torch.Tensor] = None
    extras: dict = dataclasses.field(default_factory=dict)
    baseline: Optional[torch.Tensor] = None

    def scored(self, scores: torch.Tensor, extras: dict, baseline=None) -> "Rollout":
        """This batch with its scores [B], the scorers' extras and ReMax's baselines [B]."""
        return dataclasses.replace(self, scores=scores, extras=extras, baseline=baseline)

    @property
    def num_samples(self) -> int:
        return len(self.responses)

    def select(self, rows) -> "Rollout":
        """The samples at `rows` (in that order; whole groups keep GRPO's statistics)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        rows = idx.tolist()

        def pick(t):  # a [B, ...] tensor's rows, or None
            return None if t is None else t[idx.to(t.device)]

        return dataclasses.replace(self, train=self.train.select(idx),
                                   rows=[self.rows[i] for i in rows],
                                   group_ids=pick(self.group_ids),
                                   responses=[self.responses[i] for i in rows],
                                   finish=[self.finish[i] for i in rows],
                                   engine_log_probs=pick(self.engine_log_probs),
                                   scores=pick(self.scores), baseline=pick(self.baseline),
                                   extras={k: [v[i] for i in rows] for k, v in self.extras.items()})

    @classmethod
    def concat(cls, parts: Sequence["Rollout"], pad_token_id: int) -> "Rollout":
        """The samples of `parts` one after another, their group ids renumbered 0.. in order of
        first appearance per part, so that groups of different parts stay apart. The tensors are
        widened as TrainBatch.concat widens them (`pad_token_id` in input_ids); scores and
        baselines must be set in every part or in none; the version is the oldest part's."""
        for name in ("scores", "baseline"):
            have = {getattr(p, name) is None for p in parts}
            if len(have) > 1:
                raise ValueError(f"Rollout.concat: {name} are set in some parts and not in others")
        ids, offset = [], 0
        for p in parts:  # each part's ids made distinct from the parts' before it
            local = torch.unique(p.group_ids)  # sorted
            ids.append(torch.searchsorted(local, p.group_ids) + offset)
            offset += len(local)
        train = TrainBatch.concat([p.train for p in parts], pad_token_id)
        engine = [p.engine_log_probs for p in parts]
        widened = None
        if all(e is not None for e in engine):  # widened like the batch
            widened = torch.cat([torch.nn.functional.pad(e, (0, train.response_width - e.shape[1]))
                                 for e in engine])
        names = list(dict.fromkeys(k for p in parts for k in p.extras))

        def joined(name):
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors)

        return cls(train=train, rows=[r for p in parts for r in p.rows], group_ids=torch.cat(ids),
                   responses=[r for p in parts for r in p.responses],
                   finish=[f for p in parts for f in p.finish], engine_log_probs=widened,
                   version=min(p.version for p in parts), scores=joined("scores"),
                   baseline=joined("baseline"),
                   extras={k: [v for p in parts for v in p.extras.get(k, [None] * p.num_samples)]
                           for k in names})

    def to(self, device) -> "Rollout":
        """The rollout with its tensors on `device` (the step's rule: engine/batch.py)."""
        def moved(t):
            return None if t is None else t.to(device)

        return dataclasses.replace(self, train=self.train.to(device),
                                   group_ids=self.group_ids.to(device),
                                   engine_log_probs=moved(self.engine_log_probs),
                                   scores=moved(self.scores), baseline=moved(self.baseline))



def token_ids(batch, rows) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) of `rows` of a TrainBatch, as lists (reward-model objects
    handed in from Python take them); an empty response is [] again, not its masked pad."""
    ids, prompt, seq = batch.input_ids.cpu(), batch.prompt_lens.tolist(), batch.seq_lens.tolist()
    empty = (batch.response_mask.sum(dim=1) == 0).tolist()
    prompts = [ids[i, :prompt[i]].tolist() for i in rows]
    responses = [[] if empty[i] and seq[i] - prompt[i] == 1 else ids[i, prompt[i]:seq[i]].tolist()
                 for i in rows]
    return prompts, responses


def prompt_texts(tokenizer, batch, rows) -> list[str]:
    """The decoded prompts of `rows` of a TrainBatch, as the model saw them (chat template
    included, special tokens left out)."""
    ids, lens = batch.input_ids[list(rows)].tolist(), batch.prompt_lens[list(rows)].tolist()
    return tokenizer.batch_decode([p[:k] for p, k in zip(ids, lens)], skip_special_tokens=True)


def make_rollout(samples, group_ids, info) -> Rollout:
    """samples: [(prompt ids, dataset row, response ids, finish reason)] -> Rollout."""
    part = RolloutPart.from_samples(samples, info.arch.vocab_size)
    return rollout_from_part(part, torch.as_tensor(group_ids, dtype=torch.int64), info)


def response_pad(info) -> int:
    """The token that fills a batch's rows past their end and stands for an empty response (the
    engine stopped at once), masked: the first EOS id, else the pad id (`info`: ModelInfo)."""
    return info.eos_token_ids[0] if info.eos_token_ids else info.pad_token_id


def rollout_from_part(part, group_ids: torch.Tensor, info, version: int = 0) -> Rollout:
    """A Rollout from flat samples (rollout.gather.RolloutPart) and their group ids [B], drawn
    with the policy of `version`; its response mask is the samples' loss mask
    (rollout/token_fields.py)."""
    pad = response_pad(info)
    train = TrainBatch.from_flat(part.prompt_ids, part.prompt_lens, part.response_ids,
                                 part.response_lens, pad, prompt_of=part.prompt_of,
                                 loss_mask=part.token_field("loss_mask"))
    engine_log_probs = None
    if part.logprobs is not None:  # response-aligned like the trainer's own log-probs
        engine_log_probs = response_aligned(part.logprobs, part.response_lens, train.response_width)
    return Rollout(train=train, rows=part.sample_rows(), group_ids=group_ids.to(torch.int64),
                   responses=decode_responses(info.tokenizer, part), finish=part.finish_reasons(),
                   engine_log_probs=engine_log_probs, version=version)
