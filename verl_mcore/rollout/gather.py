"""The global rollout batch from every generation replica's samples, gathered as tensors.

    mine = RolloutPart.from_outputs(prompts, outputs, vocab_size)   # TP_g rank 0 of a replica
    batch = gather_rollout(mine, groups, vocab_size)   # every rank: the whole step's samples

Every rank of a TP_g group holds the same samples, so TP_g rank 0 speaks for its replica: the
TP_g ranks 0 (together one gen_dp group) all-gather their parts, and each broadcasts the result to
the rest of its TP_g group. Each buffer is then [DP_g, largest part], not [world, ...]: with
TP_g = 8 a world-wide gather would receive 7 padding parts for every real one.

What crosses ranks, in this order: the sizes of each part (one int64 row per replica, with the
per-token fields it carries), then the per-prompt and per-sample integers (lengths, local prompt
of each sample, finish reason) in one int64 buffer, then all token ids in one flat buffer, then
the per-token fields (rollout/token_fields.py: log-probs, loss mask, versions, extras) in one
flat buffer per dtype, then the dataset rows once per prompt (small dicts: the only pickled
object). Prompt tokens are sent once per prompt, not once per sample.

Global order: generation replica, then prompt, then sample, so the n samples of a prompt are
consecutive (mini-batches keep GRPO groups together) and the global prompt index, which counts
prompts over replicas, is the group id.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from verl_mcore.config.placement import format_ranks
from verl_mcore.distributed.groups import collective_device
from verl_mcore.engine.batch import flatten_token_ids
from verl_mcore.errors import RoleSetFailure, failure_class
from verl_mcore.rollout import token_fields
from verl_mcore.rollout.base import FinishReason, SampleOutput
from verl_mcore.rollout.token_fields import TOKEN_FIELDS

FINISH_REASONS: tuple[str, ...] = typing.get_args(FinishReason)  # code = index
# A part's sizes row: replica, prompts, samples, prompt tokens, response tokens, and the per-token
# fields it carries (token_fields.carried_bits).
_SIZES = 6


def token_dtype(vocab_size: int) -> torch.dtype:
    """int32 when every token id fits, as it does for every real vocabulary (32k-256k ids): half
    the bytes of int64 on the wire and in the gathered buffers."""
    return torch.int32 if vocab_size <= 2**31 else torch.int64


@dataclass
class RolloutPart:
    """Samples with their prompts, as flat tensors (one replica's, or the global batch):

    prompt_ids     [sum(prompt_lens)]   int32|int64  the prompts' tokens, one after another
    prompt_lens    [P] int64
    response_ids   [T = sum(response_lens)] int32|int64  the responses' tokens, sample after sample
    response_lens  [B] int64
    prompt_of      [B] int64   each sample's prompt (an index into the P prompts)
    finish         [B] int64   index into FINISH_REASONS
    rows           [P] dicts   each prompt's dataset row
    token_fields   name -> [T, *shape]: the per-token fields it carries (rollout/token_fields.py:
                   logprobs, loss_mask, versions, extras), aligned with response_ids; one not
                   carried has its default on every token (`token_field`)
    """

    prompt_ids: Tensor
    prompt_lens: Tensor
    response_ids: Tensor
    response_lens: Tensor
    prompt_of: Tensor
    finish: Tensor
    rows: list
    token_fields: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self):
        self.token_fields = token_fields.check(self.token_fields, self.response_ids.numel(),
                                               "RolloutPart")

    @property
    def logprobs(self) -> Optional[Tensor]:
        """[T] float32 the engine's log-prob of each response token, or None when not asked for."""
        return self.token_fields.get("logprobs")

    def token_field(self, name: str, version: Optional[int] = None) -> Optional[Tensor]:
        """[T, *shape] per-token field `name`: carried, or its default on every token (`version`,
        the batch's, for `versions`), or None (the engine's log-probs when not asked for)."""
        return token_fields.filled(self.token_fields, name, self.response_ids.numel(), version)

    @classmethod
    def from_outputs(cls, prompts, outputs: Sequence[SampleOutput],
                     vocab_size: int) -> "RolloutPart":
        """One replica's engine outputs for `prompts` (a PromptBatch), ordered by (prompt,
        sample). Its prompts are those up to the last one with a sample (the group-id count)."""
        outputs = sorted(outputs, key=lambda o: (o.prompt_index, o.sample_index))
        count = 1 + max((o.prompt_index for o in outputs), default=-1)
        dtype = token_dtype(vocab_size)
        prompt_ids, prompt_lens = flatten_token_ids(prompts.input_ids[:count], dtype)
        response_ids, response_lens = flatten_token_ids([o.token_ids for o in outputs], dtype)
        return cls(prompt_ids, prompt_lens, response_ids, response_lens,
                   prompt_of=torch.tensor([o.prompt_index for o in outputs], dtype=torch.int64),
                   finish=finish_codes([o.finish_reason for o in outputs]),
                   rows=list(prompts.rows[:count]), token_fields=_fields_of(outputs))

    @classmethod
    def from_samples(cls, samples, vocab_size: int) -> "RolloutPart":
        """[(prompt ids, dataset row, response ids, finish reason)], each sample its own prompt."""
        dtype = token_dtype(vocab_size)
        prompt_ids, prompt_lens = flatten_token_ids([s[0] for s in samples], dtype)
        response_ids, response_lens = flatten_token_ids([s[2] for s in samples], dtype)
        return cls(prompt_ids, prompt_lens, response_ids, response_lens,
                   prompt_of=torch.arange(len(samples)),
                   finish=finish_codes([s[3] for s in samples]), rows=[s[1] for s in samples])

    @property
    def num_samples(self) -> int:
        return self.response_lens.numel()

    def sizes(self, replica: int) -> Tensor:
        """[_SIZES] int64: what a receiver needs to allocate and cut this part."""
        return torch.tensor([replica, len(self.prompt_lens), self.num_samples,
                             self.prompt_ids.numel(), self.response_ids.numel(),
                             token_fields.carried_bits(self.token_fields)],
                            dtype=torch.int64)

    def integers(self) -> Tensor:
        """[P + 3B] int64: prompt_lens | response_lens | prompt_of | finish."""
        return torch.cat([self.prompt_lens, self.response_lens, self.prompt_of, self.finish])

    def tokens(self) -> Tensor:
        """[prompt tokens + response tokens]: prompt_ids | response_ids."""
        return torch.cat([self.prompt_ids, self.response_ids])

    def field_buffer(self, names: Sequence[str], dtype: torch.dtype) -> Tensor:
        """The per-token fields `names` of `dtype` in one flat buffer (token_fields.pack), the
        default where this part lacks one that another part of the batch carries."""
        return token_fields.pack(self.token_fields, names, self.response_ids.numel(), dtype)

    def sample_rows(self) -> list:
        """[B] each sample's dataset row: the prompt's dict itself, shared by its samples."""
        return [self.rows[p] for p in self.prompt_of.tolist()]

    def finish_reasons(self) -> list[str]:
        return [FINISH_REASONS[c] for c in self.finish.tolist()]


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


def finish_codes(reasons: Sequence[str]) -> Tensor:
    code = {r: i for i, r in enumerate(FINISH_REASONS)}
    try:
        return torch.tensor([code[r] for r in reasons], dtype=torch.int64)
    except KeyError as e:
        raise ValueError(f"finish reason {e.args[0]!r} of a rollout sample is none of "
                         f"{FINISH_REASONS} (rollout/base.py FinishReason)") from None


def gather_rollout(mine: Optional[RolloutPart], groups, vocab_size: int) -> RolloutPart:
    """The global batch on every rank, from `mine` on TP_g rank 0 of each replica (None on the
    other ranks, which hold the same samples). Its prompt_of counts prompts over replicas."""
    lead = groups.gen_tp_rank == 0
    if lead != (mine is not None):
        raise ValueError(f"rank {groups.rank}: gather_rollout takes a part exactly on TP_g rank 0 "
                         f"(this rank has TP_g rank {groups.gen_tp_rank})")
    gather = _Gather(groups, lead)
    sizes = gather.tensors(mine.sizes(groups.gen_dp_rank) if lead else None, [_SIZES] * gather.n,
                           torch.int64)
    sizes = torch.stack(sizes)
    order = sizes[:, 0].argsort().tolist()  # replica order (the group's rank order already)
    prompts, samples, prompt_tokens, response_tokens, carried = (sizes[:, i].tolist()
                                                                  for i in range(1, 6))
    integers = gather.tensors(mine.integers() if lead else None,
                              [p + 3 * s for p, s in zip(prompts, samples)], torch.int64)
    tokens = gather.tensors(mine.tokens() if lead else None,
                            [p + r for p, r in zip(prompt_tokens, response_tokens)],
                            token_dtype(vocab_size))
    # The per-token fields, one buffer per dtype (the engine's log-probs only when every replica
    # has them; a loss mask where any has one: token_fields.merged).
    names = token_fields.agreed_names(carried, response_tokens, "replicas")
    buffers: list[dict] = [{} for _ in range(gather.n)]
    for dtype in token_fields.dtypes_of(names):
        got = gather.tensors(mine.field_buffer(names, dtype) if lead else None,
                             [token_fields.buffer_numel(names, dtype, r) for r in response_tokens],
                             dtype)
        for i, t in enumerate(got):
            buffers[i][dtype] = t
    rows = gather.objects(mine.rows if lead else None)
    parts = [_cut(integers[i], tokens[i], rows[i], prompts[i], samples[i], prompt_tokens[i],
                  token_fields.unpack(buffers[i], names, response_tokens[i])) for i in order]
    return _concat(parts)


class _Gather:
    """The two-stage collective over the leads' gen_dp group and each TP_g group."""

    def __init__(self, groups, lead: bool):
        self.groups, self.lead = groups, lead
        self.n = groups.layout.dp_gen
        self.tp = groups.layout.tp_gen > 1
        # Where NCCL needs the buffers (the current GPU); gloo takes them on the host.
        self.device = collective_device(groups.gen_dp)
        self.src = dist.get_global_rank(groups.gen_tp, 0) if self.tp else groups.rank
        # One replica of one rank holds the whole batch: nothing to exchange (the collectives
        # of a one-rank group still cost a round trip each, ~5 ms on gloo).
        self.alone = self.n == 1 and not self.tp

    def tensors(self, local: Optional[Tensor], lengths: list[int],
                dtype: torch.dtype) -> list[Tensor]:
        """Each replica's 1-D tensor (its length in `lengths`), on the host, in gen_dp rank order.
        all_gather needs equal sizes: each part is padded to the largest."""
        if self.alone:
            return [local.cpu()]
        width = max(1, max(lengths))  # gloo refuses empty buffers
        out = torch.empty(self.n, width, dtype=dtype, device=self.device)  # [DP_g, width]
        if self.lead:
            padded = torch.zeros(width, dtype=dtype, device=self.device)
            padded[:local.numel()] = local.to(self.device)
            dist.all_gather(list(out.unbind(0)), padded, group=self.groups.gen_dp)
        if self.tp:
            dist.broadcast(out, src=self.src, group=self.groups.gen_tp)
        out = out.cpu()
        return [out[i, :lengths[i]] for i in range(self.n)]

    def objects(self, local: Optional[list]) -> list:
        """Each replica's list of small objects (the dataset rows, once per prompt)."""
        if self.alone:
            return [local]
        out: list = [None] * self.n
        if self.lead:
            dist.all_gather_object(out, local, group=self.groups.gen_dp)
        if self.tp:
            box = [out]
            dist.broadcast_object_list(box, src=self.src, group=self.groups.gen_tp)
            out = box[0]
        return out


def _cut(integers: Tensor, tokens: Tensor, rows: list, prompts: int, samples: int,
         prompt_tokens: int, fields: Optional[dict[str, Tensor]] = None) -> RolloutPart:
    """One replica's part from its unpadded integer and token buffers and its per-token fields
    (views, no copies)."""
    lens = integers[:prompts]
    response_lens, prompt_of, finish = integers[prompts:].view(3, samples)
    return RolloutPart(tokens[:prompt_tokens], lens, tokens[prompt_tokens:], response_lens,
                       prompt_of, finish, rows, fields or {})


def _concat(parts: list[RolloutPart]) -> RolloutPart:
    """Parts in replica order as one: prompt indices shifted by the prompts before each part.
    The per-token fields are the gathered ones: every part carries the same."""
    base = np.cumsum([0] + [len(p.prompt_lens) for p in parts[:-1]]).tolist()
    return RolloutPart(
        prompt_ids=torch.cat([p.prompt_ids for p in parts]),
        prompt_lens=torch.cat([p.prompt_lens for p in parts]),
        response_ids=torch.cat([p.response_ids for p in parts]),
        response_lens=torch.cat([p.response_lens for p in parts]),
        prompt_of=torch.cat([p.prompt_of + b for p, b in zip(parts, base)]),
        finish=torch.cat([p.finish for p in parts]),
        rows=[row for p in parts for row in p.rows],
        token_fields={name: torch.cat([p.token_fields[name] for p in parts])
                      for name in parts[0].token_fields})


def decode_responses(tokenizer, part: RolloutPart, chunk: int = 1024) -> list[str]:
    """[B] response texts. batch_decode takes Python lists of ints; building them a chunk of
    samples at a time keeps at most `chunk` responses of them alive (the whole batch's would
    be ~36 bytes per token)."""
    ends = part.response_lens.cumsum(0).tolist()
    starts = [0] + ends[:-1]
    texts: list[str] = []
    for lo in range(0, part.num_samples, chunk):
        hi = min(lo + chunk, part.num_samples)
        base = starts[lo]
        flat = part.response_ids[base:ends[hi - 1]].tolist()
        lists = [flat[s - base:e - base] for s, e in zip(starts[lo:hi], ends[lo:hi])]
        texts += tokenizer.batch_decode(lists, skip_special_tokens=True)
    return texts


class GenerationFailure(RuntimeError):
    """Raised on the ranks that wait for a batch when another rank's work failed."""


def agreed_failure(failure: Optional[BaseException], group, what: str
                   ) -> Optional[BaseException]:
    """One all-reduce over `group`: None when no rank failed, else on each rank its own error,
    or the last failed rank's error class and message (GenerationFailure where the trainer has
    no class of its own for it, errors.failure_class), naming that rank and `what` (where
    they met). Every rank of the group must call it, failed or not, so that none waits in a
    collective the failed rank never joins."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return failure
    flag = torch.tensor([0 if failure is None else dist.get_rank() + 1], dtype=torch.int64,
                        device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag[0]):
        return None
    # What went wrong, from the failed rank (a few words, on the failure path only), so every
    # rank's error names the cause, as the class the trainer treats specially where it has one.
    src = int(flag[0]) - 1
    box = [(type(failure).__name__, str(failure)) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if failure is not None:
        return failure
    kind, text = box[0]
    cls = failure_class(kind)
    return (GenerationFailure if cls is RoleSetFailure else cls)(
        f"rank {src} failed before {what}: {kind}: {text}")


def broadcast_part(part: Optional[RolloutPart], src: int, group, vocab_size: int,
                   rows: Optional[Sequence] = None, failure: Optional[BaseException] = None,
                   who: str = "the generating set", with_rows: bool = True) -> RolloutPart:
    """`part` of global rank `src` on every rank of `group` (None: the world), as tensors: a
    header (failure flag, sizes), the integers, the tokens, the per-token fields the part
    carries (one buffer per dtype). The dataset rows are not sent: a receiver passes its own
    copy of the batch's (`rows`, at least as many as the part has prompts); a rank that holds
    the part passes rows=None and gets its part back.

    A `failure` on any rank (its sampling or training failed) is agreed first
    (agreed_failure): then no batch is sent and every rank raises, a failed rank its own error,
    the others GenerationFailure naming the first failed rank. with_rows=False: the receivers
    need no dataset rows (theirs are None)."""
    rank = dist.get_rank()
    device = collective_device(group)
    sending = rank == src
    failure = agreed_failure(failure, group, f"handing over {who}'s batch")
    if failure is not None:
        raise failure
    header = (part.sizes(0)[1:] if sending else torch.zeros(5, dtype=torch.int64)).to(device)
    dist.broadcast(header, src=src, group=group)
    prompts_n, samples, prompt_tokens, response_tokens, carried = header.tolist()

    def cast(local: Optional[Tensor], n: int, dtype) -> Tensor:
        buf = (local.to(device=device, dtype=dtype).contiguous() if sending
               else torch.empty(max(n, 1), dtype=dtype, device=device))
        if sending and buf.numel() == 0:  # gloo refuses empty buffers
            buf = torch.zeros(1, dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        return buf.cpu()[:n]

    integers = cast(part.integers() if sending else None, prompts_n + 3 * samples, torch.int64)
    tokens = cast(part.tokens() if sending else None, prompt_tokens + response_tokens,
                  token_dtype(vocab_size))
    names = token_fields.names_of(carried)
    fields = token_fields.unpack(
        {dtype: cast(part.field_buffer(names, dtype) if sending else None,
                     token_fields.buffer_numel(names, dtype, response_tokens), dtype)
         for dtype in token_fields.dtypes_of(names)}, names, response_tokens)
    if not with_rows and not sending:
        rows = [None] * prompts_n
    if rows is None:
        if not sending and part is None:
            raise ValueError(f"rank {rank}: broadcast_part needs the batch's rows to receive")
        return part
    if len(rows) < prompts_n:
        raise RuntimeError(f"rank {rank}: {who}'s batch has {prompts_n} prompts, this rank's "
                           f"loader {len(rows)}")
    return _cut(integers, tokens, list(rows[:prompts_n]), prompts_n, samples, prompt_tokens,
                fields)


def share_rollout(place, part: Optional[RolloutPart], prompts, vocab_size: int,
                  failure: Optional[BaseException] = None) -> RolloutPart:
    """The generating set's gathered rollout batch (`part`; the rollout set's with
    placement.rollout, else the actor's) on every rank of `place` (distributed/placement.py
    RolePlacement), broadcast as tensors from that set's first rank (broadcast_part); the dataset
    rows are not sent, each rank takes them from its own copy of the batch's prompts (`prompts`,
    the global batch on ranks outside the generating set: their loader hands out all of it).

    `failure`: what stopped this generating rank's work; the first rank's is agreed in the
    broadcast's header, so every rank raises instead of waiting for a batch that will not
    come."""
    generating = place.placement.ranks(place.generating_set)
    if len(generating) == place.placement.world:
        if failure is not None:
            raise failure
        return part
    src = generating[0]
    rows = None if place.rank in generating else prompts.rows
    return broadcast_part(part, src, None, vocab_size, rows, failure=failure,
                          who=f"the {place.generating_set} set ({format_ranks(generating)})")
