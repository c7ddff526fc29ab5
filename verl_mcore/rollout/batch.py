"""The trajectory type: a batch of sampled responses, from the engine's outputs to the loss.

    part = Rollout.from_outputs(prompts, outputs, vocab_size)  # one replica's engine outputs
    batch = gather_rollout(part, groups, vocab_size)            # rollout/gather.py: every rank
    batch = dataclasses.replace(batch, index=j, version=v)      # the producer: which, with what
    batch = batch.for_learner(info)                              # the learner's padded view
    batch = batch.scored(scores, extras, baseline)               # the scorer's

One type the whole way (there is no second container that copies its fields): what the engine
sampled is held flat, as the wire and the checkpoints of batches sampled ahead carry it, and the
learner's padded [B, S] / [B, R] tensors (`train`, an engine/batch.TrainBatch, and
`engine_log_probs`) are views laid out from it once, when a batch is handed to the learner
(`for_learner`), together with the decoded response texts the rewards read. A new per-token field
is one line in rollout/token_fields.py; the gather, the broadcast, select, concat and the
checkpoints iterate the declaration.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from verl_mcore.engine.batch import TrainBatch, flatten_token_ids, response_aligned
from verl_mcore.rollout import token_fields
from verl_mcore.rollout.base import FinishReason, SampleOutput
from verl_mcore.rollout.token_fields import BATCH_VERSION, TOKEN_FIELDS

FINISH_REASONS: tuple[str, ...] = typing.get_args(FinishReason)  # code = index


def token_dtype(vocab_size: int) -> torch.dtype:
    """int32 when every token id fits, as it does for every real vocabulary (32k-256k ids): half
    the bytes of int64 on the wire and in the gathered buffers."""
    return torch.int32 if vocab_size <= 2**31 else torch.int64


@dataclass
class Rollout:
    """B sampled trajectories of P prompts (one replica's, or the global batch, identical on
    every rank once gathered).

    What was sampled, flat (what crosses ranks and goes into checkpoints):
    prompt_ids     [sum(prompt_lens)]  int32|int64  the prompts' tokens, one after another
    prompt_lens    [P] int64
    response_ids   [T = sum(response_lens)]  int32|int64  the responses' tokens, sample after
                   sample: every token after the prompt, the model's and, in a multi-turn
                   trajectory, the ones put in between (tool output: loss mask 0)
    response_lens  [B] int64
    prompt_of      [B] int64   each sample's prompt (an index into the P prompts)
    finish_codes   [B] int64   why each ended: an index into FINISH_REASONS (`finish`)
    prompt_rows    [P] dicts   each prompt's dataset row (`rows`: each sample's)
    token_fields   name -> [T, *shape]: the per-token fields it carries (rollout/token_fields.py:
                   the engine's log-probs, the loss mask, the policy versions, extras); one not
                   carried has its default on every token (`token_field`)
    turns          [B] int64   the model's turns in each response (an agent loop's; 1 otherwise)
    sampled_rewards [B] float64 the reward the sampling itself gave each response (an agent
                   loop's environment: SampleOutput.reward), NaN where it gave none; a reward
                   source of type `environment` reads it
    group_ids      [B] int64   one id per prompt: samples of the same prompt share it (GRPO,
                   RLOO); the global prompt index once gathered

    Which batch, and with which weights:
    index          the prompt batch it was drawn for (the step that trains on it)
    version        the policy version (optimizer updates of the actor) it was sampled with: the
                   default of every token's `versions`
    greedy         ReMax's greedy baseline samples of the same prompts (one each) until scored

    Added on the way to the loss:
    train, engine_log_probs, responses   the learner's view (`for_learner`): the padded batch
                   (its response mask is the loss mask), the engine's log-probs [B, R] (None when
                   not asked for), the decoded response texts [B]: what the model wrote (the
                   tokens of loss mask 1: decode_responses)
    scores         [B] float32 training scores once scored (the weighted reward sources, DAPO's
                   overlong penalty), else None
    extras         "source/key" -> [B] the scorers' numeric extras (None where absent)
    baseline       [B] ReMax's greedy-baseline score of each sample's prompt, or None
    """

    prompt_ids: Tensor
    prompt_lens: Tensor
    response_ids: Tensor
    response_lens: Tensor
    prompt_of: Tensor
    finish_codes: Tensor
    prompt_rows: list
    token_fields: dict[str, Tensor] = field(default_factory=dict)
    turns: Optional[Tensor] = None
    sampled_rewards: Optional[Tensor] = None
    group_ids: Optional[Tensor] = None
    index: int = 0
    version: int = 0
    greedy: Optional["Rollout"] = None
    train: Optional[TrainBatch] = field(default=None, repr=False)
    engine_log_probs: Optional[Tensor] = field(default=None, repr=False)
    responses: Optional[list] = field(default=None, repr=False)
    scores: Optional[Tensor] = None
    extras: dict = field(default_factory=dict)
    baseline: Optional[Tensor] = None

    def __post_init__(self):
        b = self.response_lens.numel()
        self.token_fields = token_fields.check(self.token_fields, self.response_ids.numel(),
                                               "Rollout")
        if self.turns is None:
            self.turns = torch.ones(b, dtype=torch.int64)
        if self.sampled_rewards is None:
            self.sampled_rewards = torch.full((b,), math.nan, dtype=torch.float64)
        # float64: integers() carries their bits as int64, one value each
        self.sampled_rewards = self.sampled_rewards.to(torch.float64)
        if self.group_ids is None:
            self.group_ids = self.prompt_of.to(torch.int64)
        for name in ("prompt_of", "finish_codes", "turns", "sampled_rewards", "group_ids"):
            t = getattr(self, name)
            if t.shape != (b,):
                raise ValueError(f"Rollout.{name} must be [B]=[{b}] (one per sample), got "
                                 f"{tuple(t.shape)}")
        if len(self.prompt_rows) != len(self.prompt_lens):
            raise ValueError(f"Rollout: {len(self.prompt_lens)} prompts, but "
                             f"{len(self.prompt_rows)} dataset rows (prompt_rows: one per prompt)")

    # ------------------------------------------------------------------ made from

    @classmethod
    def from_outputs(cls, prompts, outputs: Sequence[SampleOutput], vocab_size: int) -> "Rollout":
        """One replica's engine outputs for `prompts` (a PromptBatch: input_ids, rows), ordered
        by (prompt, sample). Its prompts are those up to the last one with a sample (the
        group-id count)."""
        outputs = sorted(outputs, key=lambda o: (o.prompt_index, o.sample_index))
        count = 1 + max((o.prompt_index for o in outputs), default=-1)
        dtype = token_dtype(vocab_size)
        prompt_ids, prompt_lens = flatten_token_ids(prompts.input_ids[:count], dtype)
        response_ids, response_lens = flatten_token_ids([o.token_ids for o in outputs], dtype)
        return cls(prompt_ids, prompt_lens, response_ids, response_lens,
                   prompt_of=torch.tensor([o.prompt_index for o in outputs], dtype=torch.int64),
                   finish_codes=finish_codes([o.finish_reason for o in outputs]),
                   prompt_rows=list(prompts.rows[:count]), token_fields=_fields_of(outputs),
                   turns=_turns_of(outputs), sampled_rewards=_rewards_of(outputs))

    @classmethod
    def from_samples(cls, samples, vocab_size: int, group_ids=None) -> "Rollout":
        """[(prompt ids, dataset row, response ids, finish reason)], each sample its own prompt;
        `group_ids` [B] (None: each sample its own group)."""
        dtype = token_dtype(vocab_size)
        prompt_ids, prompt_lens = flatten_token_ids([s[0] for s in samples], dtype)
        response_ids, response_lens = flatten_token_ids([s[2] for s in samples], dtype)
        return cls(prompt_ids, prompt_lens, response_ids, response_lens,
                   prompt_of=torch.arange(len(samples)),
                   finish_codes=finish_codes([s[3] for s in samples]),
                   prompt_rows=[s[1] for s in samples],
                   group_ids=None if group_ids is None else torch.as_tensor(group_ids,
                                                                            dtype=torch.int64))

    # ------------------------------------------------------------------ reading it

    @property
    def num_samples(self) -> int:
        return self.response_lens.numel()

    @property
    def num_tokens(self) -> int:
        """Response tokens, all of them (the loss mask's zeros included)."""
        return self.response_ids.numel()

    @property
    def rows(self) -> list:
        """[B] each sample's dataset row: its prompt's dict itself, shared by its samples."""
        return [self.prompt_rows[p] for p in self.prompt_of.tolist()]

    @property
    def finish(self) -> list[str]:
        """[B] "stop" | "length" | "aborted" (rollout/base.py FinishReason)."""
        return [FINISH_REASONS[c] for c in self.finish_codes.tolist()]

    @property
    def logprobs(self) -> Optional[Tensor]:
        """[T] float32 the engine's log-prob of each response token, or None when not asked for."""
        return self.token_fields.get("logprobs")

    def token_field(self, name: str) -> Optional[Tensor]:
        """[T, *shape] per-token field `name`: carried, or its default on every token (the
        batch's version for `versions`), or None (the engine's log-probs when not asked for)."""
        return token_fields.filled(self.token_fields, name, self.num_tokens, self.version)

    def token_ids(self, samples: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt ids, response ids) of `samples`, as lists (reward-model objects handed in
        from Python take them)."""
        prompt_ends = self.prompt_lens.cumsum(0).tolist()
        ends = self.response_lens.cumsum(0).tolist()
        of = self.prompt_of.tolist()
        prompts, responses = [], []
        for i in samples:
            p = of[i]
            prompts.append(self.prompt_ids[prompt_ends[p] - int(self.prompt_lens[p]):
                                           prompt_ends[p]].tolist())
            responses.append(self.response_ids[ends[i] - int(self.response_lens[i]):
                                               ends[i]].tolist())
        return prompts, responses

    def prompt_texts(self, tokenizer, samples: Sequence[int]) -> list[str]:
        """The decoded prompts of `samples`, as the model saw them (chat template included,
        special tokens left out)."""
        return tokenizer.batch_decode(self.token_ids(samples)[0], skip_special_tokens=True)

    def trajectory_metrics(self, version_now: int) -> dict[str, float]:
        """What is special about these trajectories, only where it is: the age of the tokens
        that train (`version_now` less the version that sampled each; a batch whose tokens carry
        their own versions: partial rollouts, agent loops over weight updates), the model's
        turns per trajectory (multi-turn), the share of response tokens out of the loss (a
        loss mask: tool output, masked passes)."""
        m: dict[str, float] = {}
        trains = self.token_field("loss_mask").bool()
        if "versions" in self.token_fields and bool(trains.any()):
            versions = self.token_fields["versions"][trains].long()
            age = (version_now - versions).double()
            m.update({"rollout/token_age/mean": float(age.mean()),
                      "rollout/token_age/max": float(age.max()),
                      "rollout/token_version/min": float(versions.min())})
        if self.num_samples and int(self.turns.max()) > 1:
            m.update({"rollout/turns/mean": float(self.turns.double().mean()),
                      "rollout/turns/max": float(self.turns.max())})
        if "loss_mask" in self.token_fields and self.num_tokens:
            m["rollout/masked_token_share"] = float(1.0 - trains.double().mean())
        return m

    # ------------------------------------------------------------------ the learner's view

    def for_learner(self, info) -> "Rollout":
        """This batch with the learner's view laid out (on the host): `train` (its response mask
        the loss mask, the engine's routing when it was recorded), `engine_log_probs` [B, R] response-aligned like the trainer's own, the
        decoded `responses`; `info`: the actor's ModelInfo (pad token, tokenizer)."""
        if self.train is not None:
            return self
        train = TrainBatch.from_flat(self.prompt_ids, self.prompt_lens, self.response_ids,
                                     self.response_lens, response_pad(info),
                                     prompt_of=self.prompt_of,
                                     loss_mask=self.token_fields.get("loss_mask"))
        engine = None
        if self.logprobs is not None:
            engine = response_aligned(self.logprobs, self.response_lens, train.response_width)
        routed = self.token_fields.get(token_fields.ROUTED_EXPERTS)
        if routed is not None:  # the engine's routing, replayed by the actor (-1 past the end)
            train = dataclasses.replace(train, routed_experts=response_aligned(
                routed, self.response_lens, train.response_width, fill=-1))
        return dataclasses.replace(self, train=train, engine_log_probs=engine,
                                   responses=decode_responses(info.tokenizer, self))

    def scored(self, scores: Tensor, extras: dict, baseline=None) -> "Rollout":
        """This batch with its scores [B], the scorers' extras and ReMax's baselines [B]."""
        return dataclasses.replace(self, scores=scores, extras=extras, baseline=baseline)

    def to(self, device) -> "Rollout":
        """The learner's tensors on `device` (the step's rule: engine/batch.py); what was sampled
        stays on the host, where the wire and the checkpoints read it."""
        def moved(t):
            return None if t is None else t.to(device)

        return dataclasses.replace(self, train=None if self.train is None else self.train.to(device),
                                   group_ids=self.group_ids.to(device),
                                   engine_log_probs=moved(self.engine_log_probs),
                                   scores=moved(self.scores), baseline=moved(self.baseline))

    # ------------------------------------------------------------------ picking and joining

    def select(self, samples) -> "Rollout":
        """The samples at `samples` (in that order; whole groups keep GRPO's statistics), with
        only the prompts they use."""
        if self.greedy is not None:
            raise ValueError("Rollout.select: the batch still carries ReMax's unscored greedy "
                             "samples; score it first")
        idx = torch.as_tensor(samples).cpu()
        if idx.dtype == torch.bool:  # as long it would be indices 0 and 1, silently
            raise ValueError("Rollout.select takes sample indices, not a mask: pass "
                             "mask.nonzero().flatten()")
        idx = idx.long()
        rows = idx.tolist()
        used, prompt_of = torch.unique(self.prompt_of[idx], return_inverse=True)
        tokens = _runs(self.response_lens, idx)

        def pick(t):  # a [B, ...] tensor's rows, or None
            return None if t is None else t[idx.to(t.device)]

        return dataclasses.replace(
            self, prompt_ids=self.prompt_ids[_runs(self.prompt_lens, used)],
            prompt_lens=self.prompt_lens[used], response_ids=self.response_ids[tokens],
            response_lens=self.response_lens[idx], prompt_of=prompt_of.reshape(-1),
            finish_codes=self.finish_codes[idx],
            prompt_rows=[self.prompt_rows[p] for p in used.tolist()],
            token_fields={k: v[tokens] for k, v in self.token_fields.items()},
            turns=self.turns[idx], sampled_rewards=self.sampled_rewards[idx],
            group_ids=pick(self.group_ids),
            train=None if self.train is None else self.train.select(idx),
            engine_log_probs=pick(self.engine_log_probs),
            responses=None if self.responses is None else [self.responses[i] for i in rows],
            scores=pick(self.scores), baseline=pick(self.baseline),
            extras={k: [v[i] for i in rows] for k, v in self.extras.items()})

    @classmethod
    def concat(cls, parts: Sequence["Rollout"], pad_token_id: int) -> "Rollout":
        """The samples of `parts` one after another, each part's group ids renumbered 0.. (in
        the order of the ids) after the parts' before it, so that groups of different parts stay
        apart. The learner's views, scores and baselines must be set in every part or in none;
        the views are joined (widened as TrainBatch.concat widens them, `pad_token_id` in
        input_ids).
        A per-token field some parts lack gets its default there (a part's own version for
        `versions`), or is dropped where it has none (the engine's log-probs); a part without
        response tokens has no say. The batch's version is the oldest part's; parts of other
        versions carry theirs on their tokens (`versions`)."""
        if not parts:
            raise ValueError("Rollout.concat: no parts")
        for name, what in (("scores", ""), ("baseline", ""),
                           ("train", " (the learner's view: Rollout.for_learner)")):
            have = [i for i, p in enumerate(parts) if getattr(p, name) is not None]
            if 0 < len(have) < len(parts):
                raise ValueError(f"Rollout.concat: {name}{what} is set in parts {have[:8]} and "
                                 f"not in the others: set it in every part or in none")
        if any(p.greedy is not None for p in parts):
            raise ValueError("Rollout.concat: a part still carries ReMax's unscored greedy samples")
        ids, offset = [], 0
        for p in parts:  # each part's ids made distinct from the parts' before it
            local = torch.unique(p.group_ids)  # sorted
            ids.append(torch.searchsorted(local, p.group_ids) + offset)
            offset += len(local)
        joined_parts = joined(parts)
        train, engine, responses = None, None, None
        if parts[0].train is not None:
            train = TrainBatch.concat([p.train for p in parts], pad_token_id)
            responses = [r for p in parts for r in p.responses]
            # A part without response tokens has none to give: zeros (its rows are masked).
            engines = [p.engine_log_probs if p.engine_log_probs is not None or p.num_tokens
                       else torch.zeros(p.train.response_mask.shape,
                                        device=p.train.response_mask.device) for p in parts]
            if (all(e is not None for e in engines)  # widened like the batch
                    and any(p.engine_log_probs is not None for p in parts)):
                engine = torch.cat([torch.nn.functional.pad(e, (0, train.response_width
                                                               - e.shape[1])) for e in engines])
        names = list(dict.fromkeys(k for p in parts for k in p.extras))

        def cat(name):
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors)

        return dataclasses.replace(
            joined_parts, group_ids=torch.cat(ids), index=parts[0].index,
            version=min(p.version for p in parts), train=train, engine_log_probs=engine,
            responses=responses, scores=cat("scores"), baseline=cat("baseline"),
            extras={k: [v for p in parts for v in p.extras.get(k, [None] * p.num_samples)]
                    for k in names})

    # ------------------------------------------------------------------ the wire, checkpoints

    def integers(self) -> Tensor:
        """[P + 5B] int64: prompt_lens | response_lens | prompt_of | finish codes | turns |
        sampled rewards (their float64 bits: one buffer, one collective, exact)."""
        return torch.cat([self.prompt_lens, self.response_lens, self.prompt_of,
                          self.finish_codes, self.turns, self.sampled_rewards.view(torch.int64)])

    def tokens(self) -> Tensor:
        """[prompt tokens + response tokens]: prompt_ids | response_ids."""
        return torch.cat([self.prompt_ids, self.response_ids])

    def field_buffer(self, names: Sequence[str], dtype: torch.dtype) -> Tensor:
        """The per-token fields `names` of `dtype` in one flat buffer (token_fields.pack), the
        default where this part lacks one that another part of the batch carries."""
        return token_fields.pack(self.token_fields, names, self.num_tokens, dtype)

    @classmethod
    def cut(cls, integers: Tensor, tokens: Tensor, rows: list, prompts: int, samples: int,
            prompt_tokens: int, fields: Optional[dict[str, Tensor]] = None) -> "Rollout":
        """A batch from its `integers` and `tokens` buffers and per-token fields (views, no
        copies). Integers of P + 3B (no turns, no sampled rewards) and P + 4B (turns, no sampled
        rewards) are those of checkpoints from before they were carried."""
        lens = integers[:prompts]
        rest = integers[prompts:]
        per_sample = rest.numel() // samples if samples else _PER_SAMPLE
        if per_sample not in (3, 4, _PER_SAMPLE) or rest.numel() != per_sample * samples:
            raise ValueError(f"a rollout batch's integers hold {integers.numel()} values, not "
                             f"{prompts} prompts + {_PER_SAMPLE} x {samples} samples")
        columns = rest.view(per_sample, samples)
        return cls(tokens[:prompt_tokens], lens, tokens[prompt_tokens:], columns[0], columns[1],
                   columns[2], rows, fields or {},
                   turns=columns[3] if per_sample >= 4 else None,
                   sampled_rewards=columns[4].view(torch.float64) if per_sample == _PER_SAMPLE
                   else None)

    def state(self) -> dict:
        """What a checkpoint keeps of a batch sampled ahead, as plain tensors: everything but the
        dataset rows (they come from the loader again): each per-token field it carries under
        its declared name, the group ids, the greedy baseline's samples."""
        out = {"index": self.index, "version": self.version,
               "part": {"integers": self.integers(), "tokens": self.tokens(),
                        "group_ids": _own(self.group_ids.cpu()),
                        "sizes": torch.tensor([len(self.prompt_lens), self.num_samples,
                                               self.prompt_ids.numel()], dtype=torch.int64),
                        "token_fields": {name: _own(self.token_fields[name])
                                         for name in TOKEN_FIELDS if name in self.token_fields}}}
        if self.greedy is not None:
            out["baseline"] = self.greedy.state()["part"]
        return out

    @classmethod
    def from_state(cls, saved: dict, rows) -> "Rollout":
        """A batch saved by `state`, its prompts' dataset rows `rows` (at least as many)."""
        index, version = int(saved["index"]), int(saved["version"])

        def part(d):
            prompts, samples, prompt_tokens = d["sizes"].tolist()
            fields = dict(d.get("token_fields", {}))
            if "logprobs" in d:  # a checkpoint from before the fields were declared
                fields["logprobs"] = d["logprobs"]
            try:
                # Older checkpoints have no group ids: one group per prompt (prompt_of).
                return dataclasses.replace(
                    cls.cut(d["integers"], d["tokens"], list(rows[:prompts]), prompts, samples,
                            prompt_tokens, fields), index=index, version=version,
                    group_ids=d.get("group_ids"))
            except ValueError as e:
                raise ValueError(f"the checkpoint's batch {index} sampled ahead: {e}") from e

        greedy = part(saved["baseline"]) if "baseline" in saved else None
        return dataclasses.replace(part(saved["part"]), greedy=greedy)


# Integers per sample on the wire and in checkpoints (Rollout.integers).
_PER_SAMPLE = 5


def _own(t: Tensor) -> Tensor:
    """`t` with a storage of its own: torch.save writes a view's whole storage, and a batch
    received over the wire holds its fields and group ids as views of shared buffers (one per
    dtype: the versions beside an extra such as MoE routing)."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def _runs(lens: Tensor, which: Tensor) -> Tensor:
    """Indices into a flat buffer of runs of `lens` of the runs `which`, one after another."""
    lens = lens.long()
    starts = lens.cumsum(0) - lens
    picked = lens[which]
    if not picked.numel() or not int(picked.sum()):
        return torch.zeros(0, dtype=torch.long)
    within = torch.arange(int(picked.sum())) - torch.repeat_interleave(picked.cumsum(0) - picked,
                                                                       picked)
    return torch.repeat_interleave(starts[which], picked) + within


def joined(parts: Sequence[Rollout]) -> Rollout:
    """Parts one after another as one batch: prompt indices shifted by the prompts before each
    part; a per-token field some parts lack gets its default there (Rollout.concat). A part
    without response tokens has no say (token_fields.merged), and parts sampled with other
    weights carry their versions on their tokens (the batch's version is one number)."""
    base = np.cumsum([0] + [len(p.prompt_lens) for p in parts[:-1]]).tolist()
    fields = {}
    speaking = [p for p in parts if p.num_tokens]
    for name, f in TOKEN_FIELDS.items():
        carried = [name in p.token_fields for p in speaking]
        versions_differ = (f.default == BATCH_VERSION
                           and len({p.version for p in speaking}) > 1)
        if not (any(carried) or versions_differ) or (not all(carried) and f.default is None):
            continue
        fields[name] = torch.cat([token_fields.filled(p.token_fields, name, p.num_tokens,
                                                      p.version) if p.num_tokens
                                  else f.fill(0) for p in parts])
    return Rollout(
        prompt_ids=torch.cat([p.prompt_ids for p in parts]),
        prompt_lens=torch.cat([p.prompt_lens for p in parts]),
        response_ids=torch.cat([p.response_ids for p in parts]),
        response_lens=torch.cat([p.response_lens for p in parts]),
        prompt_of=torch.cat([p.prompt_of + b for p, b in zip(parts, base)]),
        finish_codes=torch.cat([p.finish_codes for p in parts]),
        prompt_rows=[row for p in parts for row in p.prompt_rows], token_fields=fields,
        turns=torch.cat([p.turns for p in parts]),
        sampled_rewards=torch.cat([p.sampled_rewards for p in parts]), version=parts[0].version)


def _fields_of(outputs: Sequence[SampleOutput]) -> dict[str, Tensor]:
    """The declared per-token fields the samples carry (token_fields.merged: a sample without
    one gets its default), each [T, *shape], sample after sample."""
    undeclared = sorted({k for o in outputs for k in o.extras} - set(TOKEN_FIELDS))
    if undeclared:
        raise ValueError(f"SampleOutput.extras {undeclared}: not declared per-token fields "
                         f"(add them to rollout/token_fields.py TOKEN_FIELDS)")
    out = {}
    for name, f in TOKEN_FIELDS.items():
        values = [o.token_values(name) for o in outputs]
        if not token_fields.merged(name, [v is not None for v in values],
                                   tokens=[len(o.token_ids) for o in outputs]):
            continue
        chunks = []
        for o, v in zip(outputs, values):
            n = len(o.token_ids)
            t = f.fill(n) if v is None else torch.as_tensor(v, dtype=f.dtype)
            if t.numel() != n * f.width or (n and t.shape[0] != n):
                raise ValueError(f"prompt {o.prompt_index} sample {o.sample_index}: per-token "
                                 f"field {name!r} has shape {tuple(t.shape)}, its {n} response "
                                 f"tokens need {(n, *f.shape)}")
            chunks.append(t.reshape(n, *f.shape))
        out[name] = torch.cat(chunks)
    return out


def _turns_of(outputs: Sequence[SampleOutput]) -> Tensor:
    turns = [o.turns for o in outputs]
    bad = [(o.prompt_index, o.sample_index) for o, t in zip(outputs, turns)
           if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or t < 0]
    if bad:
        raise ValueError(f"SampleOutput.turns of (prompt, sample) {bad[:4]} is not a whole "
                         f"number >= 0")
    return torch.tensor(turns, dtype=torch.int64)


def _rewards_of(outputs: Sequence[SampleOutput]) -> Tensor:
    values = []
    for o in outputs:
        r = o.reward
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float, np.number))
                              or not math.isfinite(r)):
            raise ValueError(f"SampleOutput.reward of prompt {o.prompt_index} sample "
                             f"{o.sample_index} is {r!r}: a finite number or None")
        values.append(math.nan if r is None else float(r))
    return torch.tensor(values, dtype=torch.float64)


def finish_codes(reasons: Sequence[str]) -> Tensor:
    code = {r: i for i, r in enumerate(FINISH_REASONS)}
    try:
        return torch.tensor([code[r] for r in reasons], dtype=torch.int64)
    except KeyError as e:
        raise ValueError(f"finish reason {e.args[0]!r} of a rollout sample is none of "
                         f"{FINISH_REASONS} (rollout/base.py FinishReason)") from None


def decode_responses(tokenizer, batch: Rollout, chunk: int = 1024) -> list[str]:
    """[B] response texts: what the model wrote. In a batch with a loss mask that is the tokens
    of mask 1 only (a tool's output, an environment's feedback, a masked pass are not the
    model's text: a reward that reads the response cannot be earned by an observation that
    quotes the answer). batch_decode takes Python lists of ints; building them a chunk of
    samples at a time keeps at most `chunk` responses of them alive (the whole batch's would
    be ~36 bytes per token)."""
    ends = batch.response_lens.cumsum(0).tolist()
    starts = [0] + ends[:-1]
    mask = batch.token_fields.get("loss_mask")
    texts: list[str] = []
    for lo in range(0, batch.num_samples, chunk):
        hi = min(lo + chunk, batch.num_samples)
        base = starts[lo]
        flat = batch.response_ids[base:ends[hi - 1]].tolist()
        lists = [flat[s - base:e - base] for s, e in zip(starts[lo:hi], ends[lo:hi])]
        if mask is not None:
            keep = mask[base:ends[hi - 1]].tolist()
            lists = [[t for t, k in zip(ids, keep[s - base:e - base]) if k]
                     for ids, s, e in zip(lists, starts[lo:hi], ends[lo:hi])]
        texts += tokenizer.batch_decode(lists, skip_special_tokens=True)
    return texts


def make_rollout(samples, group_ids, info) -> Rollout:
    """samples: [(prompt ids, dataset row, response ids, finish reason)] -> the learner's batch."""
    return Rollout.from_samples(samples, info.arch.vocab_size, group_ids).for_learner(info)


def response_pad(info) -> int:
    """The token that fills a batch's rows past their end and stands for an empty response (the
    engine stopped at once), masked: the first EOS id, else the pad id (`info`: ModelInfo)."""
    return info.eos_token_ids[0] if info.eos_token_ids else info.pad_token_id

