"""DAPO's overlong handling (algo/overlong.py): the soft punishment is verl's formula, and a
sample left out of the actor's loss adds nothing to the loss, its gradient or its normaliser in
every loss_agg_mode, however the mini-batch is split into micro-batches. CPU, about 1 s."""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from tests.algo.loss_inputs import AGG_MODES, differentiable_input, loss_batch, run_loss
from verl_mcore.algo.aggregation import LossDenominators
from verl_mcore.algo.overlong import (
    actor_batch,
    mask_samples,
    overlong_penalty,
    overlong_scores,
    truncated,
)
from verl_mcore.config import Config
from verl_mcore.engine.batch import TrainBatch


def verl_overlong_reward(valid_response_length: int, max_resp_len: int, overlong_buffer_len: int,
                         overlong_penalty_factor: float) -> float:
    """verl's DAPO reward manager (verl/workers/reward_manager/dapo.py), per sample, as written
    there: the reference, independent of the implementation under test."""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)


def test_the_penalty_is_verls_formula_on_random_lengths():
    rng = random.Random(0)
    for _ in range(200):
        max_len = rng.randint(2, 4096)
        buffer = rng.randint(1, max_len - 1)
        factor = rng.choice([0.0, 1.0, rng.uniform(0, 5)])
        lens = [rng.randint(0, max_len) for _ in range(rng.randint(1, 64))]
        ours = overlong_penalty(torch.tensor(lens), max_len, buffer, factor)
        want = torch.tensor([verl_overlong_reward(n, max_len, buffer, factor) for n in lens],
                            dtype=torch.float32)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, want, rtol=0, atol=0)


def test_the_penalty_is_zero_up_to_the_buffer_and_the_factor_at_the_limit():
    lens = torch.tensor([1, 12, 13, 14, 16])
    assert overlong_penalty(lens, 16, 4, 2.0).tolist() == [0.0, 0.0, -0.5, -1.0, -2.0]
    with pytest.raises(ValueError, match="reward.overlong_buffer.len"):
        overlong_penalty(lens, 16, 0, 1.0)


def _batch(response_lens: list[int]) -> TrainBatch:
    """Prompts of 3 tokens and responses of `response_lens` tokens (all in the loss mask)."""
    return TrainBatch.from_sequences([[1, 2, 3]] * len(response_lens),
                                     [[5] * n for n in response_lens], pad_token_id=0)


def _cfg(*overrides: str) -> Config:
    return Config.load(None, ["data.max_response_length=16", *overrides])


def test_overlong_scores_reads_its_config_and_adds_the_penalty():
    lens = [3, 12, 13, 14, 16, 16]
    rollout = SimpleNamespace(train=_batch(lens))
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 0.0])
    same, metrics = overlong_scores(_cfg(), rollout, scores)
    assert same is scores and metrics == {}
    cfg = _cfg("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
               "reward.overlong_buffer.penalty_factor=2.0")
    shaped, metrics = overlong_scores(cfg, rollout, scores)
    penalty = [verl_overlong_reward(n, 16, 4, 2.0) for n in lens]
    torch.testing.assert_close(shaped, scores + torch.tensor(penalty), rtol=0, atol=0)
    assert metrics == {"reward/overlong/penalty_mean": pytest.approx(sum(penalty) / 6),
                       "reward/overlong/fraction": pytest.approx(4 / 6)}


def test_actor_batch_masks_only_the_samples_cut_at_the_limit():
    batch = _batch([3, 16, 5, 16])
    rollout = SimpleNamespace(train=batch, finish=["stop", "length", "stop", "stop"])
    same, metrics = actor_batch(_cfg(), rollout)
    assert same is batch and metrics == {}
    masked, metrics = actor_batch(_cfg("actor.mask_truncated_samples=true"), rollout)
    assert metrics == {"actor/masked_truncated_fraction": 0.25}
    assert masked.response_mask.sum(dim=1).tolist() == [3.0, 0.0, 5.0, 16.0]
    # The critic's and the metrics' batch keeps its mask; the actor's keeps every other field.
    assert batch.response_mask.sum(dim=1).tolist() == [3.0, 16.0, 5.0, 16.0]
    assert torch.equal(masked.input_ids, batch.input_ids)
    assert torch.equal(masked.seq_lens, batch.seq_lens)
    assert truncated(rollout.finish).tolist() == [False, True, False, False]


# The actor's loss terms (policy losses, the KL loss, the entropy bonus); the value loss is the
# critic's, which keeps truncated samples.
ACTOR_LOSSES = ["ppo", "gspo", "reinforce", "kl_k1", "kl_k3", "entropy"]


def _micro_batched(name, inputs, leaf, mode, denoms, chunks):
    """Sum of the contributions of `chunks` row ranges, as the engine's micro-batches add up."""
    total, diag_total = 0.0, {}
    for rows in chunks:
        part = {k: v[rows] for k, v in inputs.items()}
        loss, diag = run_loss(name, part, leaf[rows], denoms, mode)
        total = total + loss
        for k, v in diag.items():
            diag_total[k] = diag_total.get(k, 0.0) + v
    return total, diag_total


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", ACTOR_LOSSES)
def test_a_masked_sample_adds_nothing_to_the_loss_or_its_normaliser(name, mode):
    """Rows 4 and 6 masked (mask_samples, as actor_batch does) in a batch split into three
    micro-batches give the loss, diagnostics and gradients of the batch without those rows,
    unsplit; the masked rows get no gradient, and they count in neither N_tok nor N_seq."""
    inputs = loss_batch(3, batch=8, length=9)
    drop = torch.zeros(8, dtype=torch.bool)
    drop[[4, 6]] = True
    assert inputs["mask"][drop].any(dim=1).all()  # they had valid tokens to lose
    masked = dict(inputs, mask=mask_samples(inputs["mask"], drop))
    kept = {k: v[~drop] for k, v in inputs.items()}
    length = inputs["mask"].shape[1]  # norm_len: the configured maximum, as the trainer passes

    denoms = LossDenominators.of(masked["mask"], norm_len=length)
    assert denoms == LossDenominators.of(kept["mask"], norm_len=length)
    key = differentiable_input(name)
    leaf = masked[key].clone().requires_grad_(True)
    loss, diag = _micro_batched(name, masked, leaf, mode, denoms,
                                [slice(0, 3), slice(3, 5), slice(5, 8)])
    loss.backward()

    kept_leaf = kept[key].clone().requires_grad_(True)
    want, want_diag = run_loss(name, kept, kept_leaf, denoms, mode)
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=0, atol=1e-12)
    for k, v in want_diag.items():
        torch.testing.assert_close(diag[k], v, rtol=0, atol=1e-12, msg=k)
    torch.testing.assert_close(leaf.grad[~drop], kept_leaf.grad, rtol=0, atol=1e-12)
    assert not leaf.grad[drop].any()


def test_mask_samples_checks_its_shapes():
    with pytest.raises(ValueError, match=r"drop \(3,\) must be \[B\]"):
        mask_samples(torch.ones(2, 4), torch.zeros(3, dtype=torch.bool))
    out = mask_samples(torch.ones(2, 4, dtype=torch.float64), torch.tensor([True, False]))
    assert out.dtype == torch.float64 and out.sum(dim=1).tolist() == [0.0, 4.0]


def test_overlong_config_defaults_are_off():
    cfg = Config()
    assert not cfg.reward.overlong_buffer.enable and not cfg.actor.mask_truncated_samples
    assert dataclasses.asdict(cfg.reward.overlong_buffer) == {"enable": False, "len": None,
                                                              "penalty_factor": 1.0}
