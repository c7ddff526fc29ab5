"""Micro-batch planning and layout (no ranks, no model)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.common import make_batch
from verl_mcore.engine.batch import TrainBatch
from verl_mcore.engine.packing import (
    build_micro_batch,
    lpt_partition,
    pad_micro_batch,
    plan_micro_batches,
    round_up,
)


def test_lpt_partition_balances_and_keeps_every_item():
    weights = [7, 7, 6, 5, 4, 3, 3, 2, 2, 1]
    bins = lpt_partition(weights, 3)
    assert sorted(i for b in bins for i in b) == list(range(len(weights)))
    sums = [sum(weights[i] for i in b) for b in bins]
    assert max(sums) - min(sums) <= 1  # 40 into 3: 14/13/13
    assert all(b == sorted(b) for b in bins)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    dp=st.integers(1, 4),
    budget=st.integers(52, 200),  # >= the longest padded sample
    pad=st.sampled_from([1, 2, 4]),
    count_multiple=st.sampled_from([1, 2]),
)
def test_packed_plan_properties(lens, dp, budget, pad, count_multiple):
    plan = plan_micro_batches(lens, dp, max_tokens=budget, pad_multiple=pad, count_multiple=count_multiple)
    assert len(plan) == dp
    counts = {len(rank) for rank in plan}
    assert len(counts) == 1, f"micro-batch counts differ across DP ranks: {counts}"
    assert counts.pop() % count_multiple == 0
    rows = sorted(i for rank in plan for mb in rank for i in mb)
    assert rows == list(range(len(lens))), "every sample exactly once"
    for rank in plan:
        for mb in rank:
            assert sum(round_up(lens[i], pad) for i in mb) <= budget


def test_packed_plan_balances_ranks():
    lens = [30, 29, 28, 5, 5, 4, 4, 3, 40, 2, 2, 2]
    plan = plan_micro_batches(lens, 2, max_tokens=64)
    rank_tokens = [sum(lens[i] for mb in rank for i in mb) for rank in plan]
    assert abs(rank_tokens[0] - rank_tokens[1]) <= 4, rank_tokens


def test_packed_plan_rejects_an_oversized_sample():
    with pytest.raises(ValueError, match=r"sample 1 has 70 tokens .*max_tokens_per_microbatch=64"):
        plan_micro_batches([10, 70], 1, max_tokens=64)


def test_padded_plan_contiguous_shares_with_empty_tail():
    plan = plan_micro_batches([5] * 7, 2, micro_batch_size=2)
    assert plan == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    plan = plan_micro_batches([5] * 3, 2, micro_batch_size=2, count_multiple=2)
    assert plan == [[[0, 1], []], [[2], []]]


def _response_tokens(batch: TrainBatch, row: int) -> torch.Tensor:
    p, s = int(batch.prompt_lens[row]), int(batch.seq_lens[row])
    return batch.input_ids[row, p:s]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("pad", [1, 4])
def test_gather_index_points_at_the_logit_that_predicts_each_response_token(packed, pad):
    batch = make_batch(seed=3, num=5)
    rows = [4, 1, 3]
    mb = build_micro_batch(batch, rows, packed=packed, pad_multiple=pad)
    for grown in (mb, pad_micro_batch(mb, (mb.input_ids.shape[0] + (0 if packed else 2), mb.input_ids.shape[1] + 2 * pad))):
        flat_targets = grown.targets.reshape(-1)
        flat_ids = grown.input_ids.reshape(-1)
        for i, row in enumerate(rows):
            n = int(batch.seq_lens[row] - batch.prompt_lens[row])
            idx = grown.gather_index[i, :n]
            assert torch.equal(flat_targets[idx], _response_tokens(batch, row))
            # the predicting position holds the token just before the response token
            assert torch.equal(flat_ids[idx], batch.input_ids[row, int(batch.prompt_lens[row]) - 1 + torch.arange(n)])
            assert grown.gather_valid[i, :n].all() and not grown.gather_valid[i, n:].any()
        assert grown.input_ids.shape[-1] % pad == 0
        assert torch.equal(grown.fields["advantages"], batch.advantages[rows])


def test_packed_layout_restarts_positions_and_pads_each_sequence():
    batch = make_batch(seed=4, num=3)
    mb = build_micro_batch(batch, [0, 1, 2], packed=True, pad_multiple=4)
    padded = [round_up(int(s), 4) for s in batch.seq_lens]
    cu = mb.packed_seq_params.cu_seqlens_q.tolist()
    assert cu == [0, padded[0], padded[0] + padded[1], sum(padded)]
    assert mb.input_ids.shape == (1, sum(padded))
    for start, length in zip(cu[:-1], padded):
        assert mb.position_ids[0, start:start + length].tolist() == list(range(length))
    grown = pad_micro_batch(mb, (1, sum(padded) + 8))
    assert grown.packed_seq_params.cu_seqlens_q.tolist() == cu + [sum(padded) + 8]


def test_empty_micro_batch_is_one_padding_sequence():
    batch = make_batch(seed=4, num=3)
    mb = build_micro_batch(batch, [], packed=True, pad_multiple=2)
    assert mb.num_samples == 0 and mb.input_ids.shape == (1, 2)
    assert mb.gather_index.shape == (0, batch.response_width)


def test_batch_validation_names_the_row():
    batch = make_batch(seed=4, num=3)
    with pytest.raises(ValueError, match="row 1"):
        TrainBatch(batch.input_ids, batch.prompt_lens, torch.tensor([9, 1, 9]), batch.response_mask)
    with pytest.raises(ValueError, match="advantages must be"):
        TrainBatch(batch.input_ids, batch.prompt_lens, batch.seq_lens, batch.response_mask,
                   advantages=torch.zeros(3, 2))


@pytest.mark.parametrize("packed", [True, False])
def test_routing_goes_to_the_positions_whose_logits_predict_each_response_token(packed):
    """TrainBatch.routed_experts [B, R, layers, k] laid out like input_ids: response token j's
    routing at the position that predicts it (ForcedRouting forces it there), -1 at every other
    position, through the growth a pipeline schedule applies; concat pads with -1."""
    batch = make_batch(seed=3, num=5)
    b, r = batch.num_samples, batch.response_width
    routed = torch.arange(b * r * 3 * 2, dtype=torch.int32).view(b, r, 3, 2)
    routed[~batch.response_field_mask()] = -1
    batch = dataclasses.replace(batch, routed_experts=routed)
    rows = [4, 1, 3]
    mb = build_micro_batch(batch, rows, packed=packed, pad_multiple=4)
    shape = (mb.input_ids.shape[0] + (0 if packed else 2), mb.input_ids.shape[1] + 8)
    for grown in (mb, pad_micro_batch(mb, shape)):
        assert grown.routing.shape == (*grown.input_ids.shape, 3, 2)
        flat = grown.routing.view(-1, 3, 2)
        placed = torch.zeros(flat.shape[0], dtype=torch.bool)
        for i, row in enumerate(rows):
            n = int(batch.seq_lens[row] - batch.prompt_lens[row])
            idx = grown.gather_index[i, :n]
            assert torch.equal(flat[idx], routed[row, :n])
            placed[idx] = True
        assert (flat[~placed] == -1).all()
    both = TrainBatch.concat([batch.select([0]), batch.select([1, 2])], pad_token_id=0)
    assert torch.equal(both.routed_experts, routed[:3, :both.response_width])
    with pytest.raises(ValueError, match="routed_experts is set in batches \\[0\\]"):
        TrainBatch.concat([batch.select([0]), dataclasses.replace(batch.select([1]), routed_experts=None)], 0)
    with pytest.raises(ValueError, match="routed_experts must be \\[B, R, layers, k\\]"):
        dataclasses.replace(batch, routed_experts=routed[:, :, 0])
