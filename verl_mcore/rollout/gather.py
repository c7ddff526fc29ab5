"""The global rollout batch from every generation replica's samples, gathered as tensors.

    mine = Rollout.from_outputs(prompts, outputs, vocab_size)   # TP_g rank 0 of a replica
    batch = gather_rollout(mine, groups, vocab_size)   # every rank: the whole step's samples

Every rank of a TP_g group holds the same samples, so TP_g rank 0 speaks for its replica: the
TP_g ranks 0 (together one gen_dp group) all-gather their parts, and each broadcasts the result to
the rest of its TP_g group. Each buffer is then [DP_g, largest part], not [world, ...]: with
TP_g = 8 a world-wide gather would receive 7 padding parts for every real one.

What crosses ranks, in this order: the sizes of each part (one int64 row per replica, with the
per-token fields it carries), then the per-prompt and per-sample integers (lengths, local prompt
of each sample, finish reason, turns, sampled reward) in one int64 buffer, then all token ids in one flat buffer, then
the per-token fields (rollout/token_fields.py: log-probs, loss mask, versions, extras) in one
flat buffer per dtype, then the dataset rows once per prompt (small dicts: the only pickled
object). Prompt tokens are sent once per prompt, not once per sample.

Global order: generation replica, then prompt, then sample, so the n samples of a prompt are
consecutive (mini-batches keep GRPO groups together) and the global prompt index, which counts
prompts over replicas, is the group id.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from verl_mcore.config.placement import format_ranks
from verl_mcore.distributed.groups import collective_device
from verl_mcore.errors import RoleSetFailure, failure_class
from verl_mcore.rollout import token_fields
from verl_mcore.rollout.batch import _PER_SAMPLE, Rollout, joined, token_dtype

# A part's sizes row: replica, prompts, samples, prompt tokens, response tokens, and the per-token
# fields it carries (token_fields.carried_bits).
_SIZES = 6


def _sizes(part: Rollout, replica: int) -> Tensor:
    """[_SIZES] int64: what a receiver needs to allocate and cut `part`."""
    return torch.tensor([replica, len(part.prompt_lens), part.num_samples,
                         part.prompt_ids.numel(), part.num_tokens,
                         token_fields.carried_bits(part.token_fields)], dtype=torch.int64)


def gather_rollout(mine: Optional[Rollout], groups, vocab_size: int) -> Rollout:
    """The global batch on every rank, from `mine` on TP_g rank 0 of each replica (None on the
    other ranks, which hold the same samples). Its prompt_of counts prompts over replicas."""
    lead = groups.gen_tp_rank == 0
    if lead != (mine is not None):
        raise ValueError(f"rank {groups.rank}: gather_rollout takes a part exactly on TP_g rank 0 "
                         f"(this rank has TP_g rank {groups.gen_tp_rank})")
    gather = _Gather(groups, lead)
    sizes = gather.tensors(_sizes(mine, groups.gen_dp_rank) if lead else None, [_SIZES] * gather.n,
                           torch.int64)
    sizes = torch.stack(sizes)
    order = sizes[:, 0].argsort().tolist()  # replica order (the group's rank order already)
    prompts, samples, prompt_tokens, response_tokens, carried = (sizes[:, i].tolist()
                                                                  for i in range(1, 6))
    integers = gather.tensors(mine.integers() if lead else None,
                              [p + _PER_SAMPLE * s for p, s in zip(prompts, samples)], torch.int64)
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
    rows = gather.objects(mine.prompt_rows if lead else None)
    parts = [Rollout.cut(integers[i], tokens[i], rows[i], prompts[i], samples[i],
                         prompt_tokens[i], token_fields.unpack(buffers[i], names,
                                                               response_tokens[i]))
             for i in order]
    return joined(parts)


def gather_integers(mine: Optional[Tensor], groups) -> list[Tensor]:
    """Each replica's 1-D int64 tensor on every rank, in replica order, from TP_g rank 0 of each
    (None on the other ranks): the per-prompt numbers a caller keeps beside a gathered batch
    (partial rollouts' prompt serials in checkpoints)."""
    lead = groups.gen_tp_rank == 0
    gather = _Gather(groups, lead)
    lengths = gather.tensors(torch.tensor([mine.numel()]) if lead else None, [1] * gather.n,
                             torch.int64)
    return gather.tensors(mine.to(torch.int64) if lead else None,
                          [int(n) for n in lengths], torch.int64)


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


def broadcast_part(part: Optional[Rollout], src: int, group, vocab_size: int,
                   rows: Optional[Sequence] = None, failure: Optional[BaseException] = None,
                   who: str = "the generating set", with_rows: bool = True) -> Rollout:
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
    header = (_sizes(part, 0)[1:] if sending else torch.zeros(5, dtype=torch.int64)).to(device)
    dist.broadcast(header, src=src, group=group)
    prompts_n, samples, prompt_tokens, response_tokens, carried = header.tolist()

    def cast(local: Optional[Tensor], n: int, dtype) -> Tensor:
        buf = (local.to(device=device, dtype=dtype).contiguous() if sending
               else torch.empty(max(n, 1), dtype=dtype, device=device))
        if sending and buf.numel() == 0:  # gloo refuses empty buffers
            buf = torch.zeros(1, dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        return buf.cpu()[:n]

    integers = cast(part.integers() if sending else None, prompts_n + _PER_SAMPLE * samples,
                    torch.int64)
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
    return Rollout.cut(integers, tokens, list(rows[:prompts_n]), prompts_n, samples,
                       prompt_tokens, fields)


def share_rollout(place, part: Optional[Rollout], prompts, vocab_size: int,
                  failure: Optional[BaseException] = None) -> Rollout:
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
