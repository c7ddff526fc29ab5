"""Micro-batching: which DP rank runs which samples, in which micro-batch, and in what layout.

Two steps, both deterministic functions of the sample lengths, so every rank computes the same plan
from the same global batch without communication:

1. `plan_micro_batches` -> plan[dp_rank][micro_batch] = sample rows.
   Packed path (a token budget `max_tokens`): samples go to DP ranks by greedy LPT on their padded
   lengths (longest first, each to the rank with the fewest tokens so far), then each rank's samples
   into k micro-batches by LPT again. k is the smallest count for which every rank's micro-batches
   fit the budget, the same on all ranks (megatron's pipeline schedule runs the same number of
   micro-batches on every rank), rounded up to `count_multiple` (the interleaved schedule wants a
   multiple of PP). Padded path (`micro_batch_size`): contiguous shares of the batch per rank, cut
   into micro-batches of that many samples. A rank with fewer samples than micro-batches gets empty
   ones, which run one dummy padding sequence and contribute nothing.
2. `build_micro_batch` lays the rows out as model input:
   packed (THD): all sequences concatenated into input_ids [1, T], each padded at its end to a
   multiple of `pad_multiple` (TP, x2·CP), `PackedSeqParams` with the (padded) boundaries. Padding
   sits after each sequence's last token, so under causal attention it changes no real token.
   padded: input_ids [n, s], s = the longest sequence rounded up to `pad_multiple`.
   Either way `gather_index [n, R]` points each response token at the flat position of the logit
   that predicts it, so outputs come back response-aligned whatever the layout. The engine's
   routing (TrainBatch.routed_experts) goes the other way: scattered to those positions, laid
   out like input_ids (`MicroBatch.routing`), -1 everywhere else.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from verl_mcore.engine.batch import RESPONSE_FIELDS, TrainBatch


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def lpt_partition(weights: Sequence[int], k: int) -> list[list[int]]:
    """Greedy longest-processing-time partition of item indices into k bins with balanced sums.

    Items are taken heaviest first (ties: lower index first) and put into the bin with the smallest
    sum (ties: lower bin). Each bin lists its items in ascending index order. Max bin sum is within
    4/3 of optimal (Graham 1969), good enough for balancing and O(n log n).
    """
    if k < 1:
        raise ValueError(f"lpt_partition: need at least one bin, got k={k}")
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        total, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (total + weights[i], b))
    return [sorted(b) for b in bins]


def plan_micro_batches(
    seq_lens: Sequence[int],
    dp_size: int,
    *,
    max_tokens: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    pad_multiple: int = 1,
    count_multiple: int = 1,
) -> list[list[list[int]]]:
    """plan[dp_rank][j] = rows of the batch in micro-batch j of that rank (see module docstring).

    Exactly one of `max_tokens` (packed path: tokens per micro-batch, padding included) and
    `micro_batch_size` (padded path: samples per micro-batch) is given. Every rank gets the same
    number of micro-batches, a multiple of `count_multiple`.
    """
    if (max_tokens is None) == (micro_batch_size is None):
        raise ValueError("plan_micro_batches: give exactly one of max_tokens / micro_batch_size")
    n = len(seq_lens)
    if max_tokens is None:
        per_rank = math.ceil(n / dp_size)
        shares = [list(range(r * per_rank, min(n, (r + 1) * per_rank))) for r in range(dp_size)]
        k = max(1, math.ceil(per_rank / micro_batch_size))
        k = round_up(k, count_multiple)
        return [[share[j * micro_batch_size:(j + 1) * micro_batch_size] for j in range(k)] for share in shares]

    padded = [round_up(int(s), pad_multiple) for s in seq_lens]
    for i, p in enumerate(padded):
        if p > max_tokens:
            raise ValueError(
                f"sample {i} has {int(seq_lens[i])} tokens ({p} padded to a multiple of {pad_multiple}), "
                f"more than max_tokens_per_microbatch={max_tokens}; raise the budget to at least {p}"
            )
    rank_rows = lpt_partition(padded, dp_size)
    rank_tokens = [sum(padded[i] for i in rows) for rows in rank_rows]
    k = max(1, math.ceil(max(rank_tokens) / max_tokens))
    while True:
        k_eff = round_up(k, count_multiple)
        plan = []
        for rows in rank_rows:
            bins = lpt_partition([padded[i] for i in rows], k_eff)
            plan.append([[rows[i] for i in b] for b in bins])
        if all(sum(padded[i] for i in mb) <= max_tokens for rank in plan for mb in rank):
            return plan
        k = k_eff + 1  # LPT is not optimal: one more bin always helps, n bins always fit


@dataclass
class MicroBatch:
    """One forward/backward's input, in the packed (THD) or padded layout.

    input_ids, position_ids: [1, T] packed or [n, s] padded, int64.
    targets: same shape, the next token at every position (what the logits there predict).
    packed_seq_params: megatron PackedSeqParams (packed layout) or None (padded: causal mask).
    rows: [n] the rows of the (mini-)batch in this micro-batch, int64; n = 0 for an empty one.
    gather_index: [n, R] flat index into input_ids.view(-1) of the logit that predicts response
        token j of row i; gather_valid [n, R] says which columns are inside the response.
    fields: [n, R] response-aligned tensors: response_mask and the batch's optional fields.
    num_tokens: T or n*s, the tokens the model processes (padding included).
    seq_lens: [n] real sequence lengths (for FLOP counting).
    routing: [*input_ids.shape, layers, k] int32, the experts to force at each position
        (models/router_replay.py ForcedRouting.force; -1: the router's own choice), or None.
    """

    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    packed_seq_params: object
    rows: Tensor
    gather_index: Tensor
    gather_valid: Tensor
    fields: dict[str, Tensor] = field(default_factory=dict)
    num_tokens: int = 0
    seq_lens: Tensor = None
    routing: Optional[Tensor] = None

    @property
    def num_samples(self) -> int:
        return int(self.rows.numel())

    def to(self, device) -> "MicroBatch":
        # non_blocking: a blocking host-to-GPU copy synchronises the stream, once per tensor.
        # From pageable host memory the data is staged before the call returns, so the CPU
        # tensors may go away at once.
        moved: dict[int, Tensor] = {}

        def move(t: Tensor) -> Tensor:
            # The four cu_seqlens fields are one tensor (build_micro_batch): one copy, and one
            # device tensor, which the packed RoPE (models/rope.py) then caches per micro-batch.
            if id(t) not in moved:
                moved[id(t)] = t.to(device, non_blocking=True)
            return moved[id(t)]

        p = self.packed_seq_params
        if p is not None:
            from megatron.core.packed_seq_params import PackedSeqParams

            p = PackedSeqParams(
                qkv_format=p.qkv_format,
                cu_seqlens_q=move(p.cu_seqlens_q),
                cu_seqlens_kv=move(p.cu_seqlens_kv),
                cu_seqlens_q_padded=move(p.cu_seqlens_q_padded),
                cu_seqlens_kv_padded=move(p.cu_seqlens_kv_padded),
                max_seqlen_q=p.max_seqlen_q,
                max_seqlen_kv=p.max_seqlen_kv,
            )
        return MicroBatch(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            targets=move(self.targets),
            packed_seq_params=p,
            rows=self.rows,
            gather_index=move(self.gather_index),
            gather_valid=move(self.gather_valid),
            fields={k: move(v) for k, v in self.fields.items()},
            num_tokens=self.num_tokens,
            seq_lens=self.seq_lens,
            routing=None if self.routing is None else move(self.routing),
        )


def pad_micro_batch(mb: MicroBatch, shape: tuple[int, int]) -> MicroBatch:
    """`mb` grown to input shape `shape` ([1, T] packed: one extra padding sequence at the end;
    [b, s] padded: zero rows and columns), so that every micro-batch of a pipeline schedule has
    the same activation shape. Real tokens, their positions and the response gather are unchanged.
    """
    old = tuple(mb.input_ids.shape)
    if old == tuple(shape):
        return mb
    if shape[0] < old[0] or shape[1] < old[1]:
        raise ValueError(f"pad_micro_batch: cannot shrink {old} to {tuple(shape)}")
    input_ids = torch.zeros(shape, dtype=torch.long)
    input_ids[: old[0], : old[1]] = mb.input_ids
    gather_index = mb.gather_index
    params = mb.packed_seq_params
    if params is not None:
        extra = shape[1] - old[1]
        position_ids = torch.cat([mb.position_ids, torch.arange(extra)[None, :]], dim=1)
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.cat([params.cu_seqlens_q, torch.tensor([shape[1]], dtype=torch.int32)])
        longest = max(params.max_seqlen_q, extra)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
        )
    else:
        position_ids = torch.arange(shape[1]).expand(shape).contiguous()
        # Flat indices are row * s + column: re-base them on the new row length.
        gather_index = (gather_index // old[1]) * shape[1] + gather_index % old[1]
    targets = torch.roll(input_ids.view(-1), -1).view(shape)
    routing = mb.routing
    if routing is not None:  # the new positions route as their routers choose
        routing = torch.full((*shape, *routing.shape[2:]), -1, dtype=routing.dtype)
        routing[: old[0], : old[1]] = mb.routing
    return dataclasses.replace(
        mb, input_ids=input_ids, position_ids=position_ids, targets=targets, packed_seq_params=params,
        gather_index=gather_index, num_tokens=input_ids.numel(), routing=routing,
    )


def _response_index(starts: Tensor, prompt_lens: Tensor, resp_lens: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """[n, R] flat logit positions (start + prompt_len + j - 1) and which columns are real."""
    cols = torch.arange(width)
    valid = cols[None, :] < resp_lens[:, None]
    index = starts[:, None] + prompt_lens[:, None] - 1 + cols[None, :]
    return torch.where(valid, index, torch.zeros_like(index)), valid


def build_micro_batch(batch: TrainBatch, rows: Sequence[int], packed: bool, pad_multiple: int = 1) -> MicroBatch:
    """Lay `rows` of `batch` out as one micro-batch (see module docstring). CPU tensors."""
    rows_t = torch.as_tensor(list(rows), dtype=torch.long)
    ids = batch.input_ids.cpu()
    seq_lens = batch.seq_lens.cpu()[rows_t]
    prompt_lens = batch.prompt_lens.cpu()[rows_t]
    n, width = len(rows_t), batch.response_width
    if packed:
        # An empty micro-batch still runs one padding sequence, so every rank takes part in the
        # schedule's communication; its outputs are never gathered.
        padded = [round_up(int(s), pad_multiple) for s in seq_lens] or [pad_multiple]
        total = sum(padded)
        input_ids = torch.zeros(1, total, dtype=torch.long)
        position_ids = torch.zeros(1, total, dtype=torch.long)
        starts = torch.zeros(n, dtype=torch.long)
        offset = 0
        for i in range(n):
            s = int(seq_lens[i])
            input_ids[0, offset:offset + s] = ids[rows_t[i], :s]
            position_ids[0, offset:offset + padded[i]] = torch.arange(padded[i])
            starts[i] = offset
            offset += padded[i]
        if n == 0:
            position_ids[0] = torch.arange(total)
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor([0] + list(_cumsum(padded)), dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu, max_seqlen_q=max(padded), max_seqlen_kv=max(padded),
        )
        num_tokens = total
    else:
        s = round_up(max([int(x) for x in seq_lens] or [1]), pad_multiple)
        input_ids = torch.zeros(max(n, 1), s, dtype=torch.long)
        for i in range(n):
            input_ids[i, : int(seq_lens[i])] = ids[rows_t[i], : int(seq_lens[i])]
        position_ids = torch.arange(s).expand(input_ids.shape[0], s).contiguous()
        starts = torch.arange(n, dtype=torch.long) * s
        params = None
        num_tokens = input_ids.numel()
    flat = input_ids.view(-1)
    # The last position's target wraps around; no response token is ever predicted from it.
    targets = torch.roll(flat, -1).view_as(input_ids)
    gather_index, gather_valid = _response_index(starts, prompt_lens, seq_lens - prompt_lens, width)
    fields = {"response_mask": batch.response_mask.cpu()[rows_t]}
    for name in RESPONSE_FIELDS:
        t = getattr(batch, name)
        if t is not None:
            fields[name] = t.cpu()[rows_t]
    routing = None
    if batch.routed_experts is not None:
        routed = batch.routed_experts.cpu()[rows_t]  # [n, R, layers, k]
        routing = torch.full((*input_ids.shape, *routed.shape[2:]), -1, dtype=torch.int32)
        routing.view(-1, *routed.shape[2:])[gather_index[gather_valid]] = \
            routed[gather_valid].to(torch.int32)
    return MicroBatch(
        input_ids=input_ids, position_ids=position_ids, targets=targets, packed_seq_params=params,
        rows=rows_t, gather_index=gather_index, gather_valid=gather_valid, fields=fields,
        num_tokens=num_tokens, seq_lens=seq_lens, routing=routing,
    )


def _cumsum(xs: Sequence[int]):
    total = 0
    for x in xs:
        total += x
        yield total
