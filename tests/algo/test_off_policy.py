"""The off-policy corrections (algo/off_policy.py) against float64 references written from their
formulas with Python loops, against verl's and AReaL's functions (transcribed below as oracles,
citing their files), and in the policy loss: a rejected token adds nothing to the loss, to its
normaliser or to the gradient. CPU, about 2 s."""
from __future__ import annotations

import math

import pytest
import torch

from tests.algo import reference as ref
from tests.algo.loss_inputs import AGG_MODES
from verl_mcore.algo.aggregation import LossDenominators
from verl_mcore.algo.off_policy import (correct_off_policy, decoupled_weights, log_ratio,
                                        sequence_ratio_mask, token_ratio_mask)
from verl_mcore.algo.policy_loss import PolicyLossParams, ppo_loss, truncated_is_weights

SEEDS = [0, 1, 2]


def batch(seed: int, spread: float = 0.5, rows: int = 10, length: int = 9) -> dict:
    """float64 [B, R] old / engine log-probs on reference.random_batch's awkward masks (an empty
    row, a one-token row, holes), with a few extreme tokens for the +-20 clamp."""
    b = ref.random_batch(seed, rows, length)
    g = torch.Generator().manual_seed(500 + seed)
    shape = (rows, length)
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    engine = old + torch.randn(shape, generator=g, dtype=torch.float64) * spread
    engine[-1, 0] = old[-1, 0] + 25.0  # ratio e^-25: clamped to e^-20
    engine[-2, 0] = old[-2, 0] - 25.0  # e^25 -> e^20
    advantages = torch.randn(shape, generator=g, dtype=torch.float64)
    log_prob = old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    return {"mask": b["mask"].to(torch.float64), "old": old, "engine": engine,
            "advantages": advantages, "log_prob": log_prob}


def clamped_log_ratio(old: float, engine: float) -> float:
    return max(-20.0, min(20.0, old - engine))


def valid_rows(mask) -> list[list[int]]:
    return [ref.valid_positions(r) for r in ref.rows(mask)]


# ---------------------------------------------------------------------------------------------
# float64 references, by hand

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1.2, 1.5, 3.0])
def test_token_mask_by_hand(seed, k):
    b = batch(seed)
    kept, m = token_ratio_mask(b["old"], b["engine"], b["mask"], k)
    old, eng = ref.rows(b["old"]), ref.rows(b["engine"])
    rejected = n_valid = 0
    seqs_hit = seqs = 0
    for i, pos in enumerate(valid_rows(b["mask"])):
        hit = False
        for t in range(len(old[i])):
            ratio = math.exp(clamped_log_ratio(old[i][t], eng[i][t]))
            keep = t in pos and 1 / k <= ratio <= k
            assert float(kept[i, t]) == (1.0 if keep else 0.0), (i, t, ratio)
            if t in pos:
                n_valid += 1
                rejected += not keep
                hit |= not keep
        if pos:
            seqs += 1
            seqs_hit += hit
    assert 0 < rejected < n_valid  # the bound acted, and not on everything
    assert math.isclose(float(m["rollout/token_mask_fraction"]), rejected / n_valid, rel_tol=1e-12)
    assert math.isclose(float(m["rollout/token_mask_seq_fraction"]), seqs_hit / seqs, rel_tol=1e-12)
    assert kept.dtype == b["mask"].dtype


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_mask_by_hand(seed):
    b, k = batch(seed, spread=0.3), 1.15
    kept, m = sequence_ratio_mask(b["old"], b["engine"], b["mask"], k)
    old, eng = ref.rows(b["old"]), ref.rows(b["engine"])
    geo, out_tokens, n_tokens = [], 0, 0
    for i, pos in enumerate(valid_rows(b["mask"])):
        if not pos:
            assert kept[i].sum() == 0
            continue
        g = math.exp(sum(clamped_log_ratio(old[i][t], eng[i][t]) for t in pos) / len(pos))
        geo.append(g)
        keep = 1 / k <= g <= k
        want = [1.0 if (t in pos and keep) else 0.0 for t in range(len(old[i]))]
        assert kept[i].tolist() == want, (i, g)
        n_tokens += len(pos)
        out_tokens += 0 if keep else len(pos)
    rejected = sum(1 for g in geo if not 1 / k <= g <= k)
    assert 0 < rejected < len(geo)
    assert math.isclose(float(m["rollout/seq_mask_fraction"]), rejected / len(geo), rel_tol=1e-12)
    assert math.isclose(float(m["rollout/seq_mask_token_fraction"]), out_tokens / n_tokens,
                        rel_tol=1e-12)
    assert math.isclose(float(m["rollout/seq_ratio_mean"]), sum(geo) / len(geo), rel_tol=1e-12)
    assert math.isclose(float(m["rollout/seq_ratio_max"]), max(geo), rel_tol=1e-12)
    assert math.isclose(float(m["rollout/seq_ratio_min"]), min(geo), rel_tol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cap", [None, 1.3])
def test_decoupled_weights_by_hand(seed, cap):
    b = batch(seed)
    w, m = decoupled_weights(b["old"], b["engine"], b["mask"], cap)
    old, eng = ref.rows(b["old"]), ref.rows(b["engine"])
    values, capped = [], 0
    for i, pos in enumerate(valid_rows(b["mask"])):
        for t in range(len(old[i])):
            ratio = math.exp(clamped_log_ratio(old[i][t], eng[i][t]))
            over = cap is not None and ratio > cap
            want = ratio if (t in pos and not over) else 0.0
            assert math.isclose(float(w[i, t]), want, rel_tol=1e-12, abs_tol=1e-300), (i, t)
            if t in pos:
                values.append(want)
                capped += over
    assert math.isclose(float(m["rollout/decoupled_weight_mean"]), sum(values) / len(values),
                        rel_tol=1e-12)
    assert math.isclose(float(m["rollout/decoupled_weight_max"]), max(values), rel_tol=1e-12)
    assert math.isclose(float(m["rollout/decoupled_capped_fraction"]), capped / len(values),
                        rel_tol=1e-12)
    assert (capped > 0) == (cap is not None)
    assert not w.requires_grad


def test_correct_off_policy_combines_the_masks_and_reports_the_ratio():
    b = batch(0)
    mask = b["mask"]
    fix = correct_off_policy(b["old"], b["engine"], mask, token_mask=1.5, seq_mask=1.2)
    tok, _ = token_ratio_mask(b["old"], b["engine"], mask, 1.5)
    seq, _ = sequence_ratio_mask(b["old"], b["engine"], mask, 1.2)
    assert torch.equal(fix.loss_mask, tok * seq)
    assert fix.weights is None
    valid = mask.bool()
    ratios = [math.exp(clamped_log_ratio(float(b["old"][i, t]), float(b["engine"][i, t])))
              for i, t in valid.nonzero().tolist()]
    m = fix.metrics
    assert all(isinstance(v, float) for v in m.values())
    assert math.isclose(m["rollout/ratio_mean"], sum(ratios) / len(ratios), rel_tol=1e-12)
    assert m["rollout/ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-12)  # the clamp
    assert m["rollout/ratio_min"] == pytest.approx(math.exp(-20.0), rel=1e-12)
    out = float((valid & ~fix.loss_mask.bool()).sum()) / float(valid.sum())
    assert math.isclose(m["rollout/masked_token_fraction"], out, rel_tol=1e-12)
    decoupled = correct_off_policy(b["old"], b["engine"], mask, decoupled=True, decoupled_cap=2.0)
    assert decoupled.loss_mask is None and "rollout/masked_token_fraction" not in decoupled.metrics
    assert torch.equal(decoupled.weights, decoupled_weights(b["old"], b["engine"], mask, 2.0)[0])


def test_bad_bounds_are_refused_naming_the_key():
    b = batch(0)
    for fn, key in ((token_ratio_mask, "token_mask"), (sequence_ratio_mask, "seq_mask")):
        for k in (1.0, 0.5, math.inf, math.nan):
            with pytest.raises(ValueError, match=f"rollout.correction.{key}="):
                fn(b["old"], b["engine"], b["mask"], k)
    with pytest.raises(ValueError, match="rollout.correction.decoupled_cap=0"):
        decoupled_weights(b["old"], b["engine"], b["mask"], 0.0)
    with pytest.raises(ValueError, match="without rollout.correction.decoupled=true"):
        correct_off_policy(b["old"], b["engine"], b["mask"], decoupled_cap=2.0)
    with pytest.raises(ValueError, match=r"must all be \[batch, response_len\]"):
        log_ratio(b["old"], b["engine"][:, :3], b["mask"])


# ---------------------------------------------------------------------------------------------
# verl's and AReaL's functions, transcribed as oracles.

def _verl_masked_sum(values, mask, axis=None):
    # verl/utils/torch_functional.py masked_sum
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def _verl_masked_mean(values, mask, axis=None):
    # verl/utils/torch_functional.py masked_mean: note the 1e-8 in the denominator
    return _verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_rejection_mask(log_ratio, response_mask, option: str, k: float):
    """verl-project/verl verl/trainer/ppo/rollout_corr_helper.py (commit 20c30bf),
    compute_rollout_rejection_mask for its k1 options with one threshold k (then
    _parse_rollout_rs_thresholds makes lower = 1/k): (modified_response_mask, the option's
    rollout_rs_<option>_masked_fraction and _seq_masked_fraction)."""
    lower = float(str(1.0 / float(k)))
    lower_log, upper_log = math.log(lower), math.log(k)
    log_ratio_safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
    token_k1 = -log_ratio_safe
    seq_valid_mask = response_mask.sum(dim=-1) > 0
    if option == "token_k1":
        token_keep_bool = (token_k1 >= lower_log) & (token_k1 <= upper_log)
    elif option == "seq_mean_k1":
        seq_stat = _verl_masked_mean(token_k1, response_mask, axis=-1)
        seq_keep = (seq_stat >= lower_log) & (seq_stat <= upper_log)
        token_keep_bool = seq_keep.unsqueeze(-1).expand_as(response_mask.bool())
    else:
        raise ValueError(option)
    token_keep_mask = token_keep_bool.to(dtype=log_ratio.dtype)
    seq_keep = (~((~token_keep_bool) & response_mask.bool())).all(dim=-1)
    token_masked = _verl_masked_mean(1 - token_keep_mask, response_mask).item()
    seq_valid = seq_valid_mask.float()
    seq_masked = (((1.0 - seq_keep.to(log_ratio.dtype)) * seq_valid).sum() / seq_valid.sum()).item()
    return (response_mask * token_keep_mask).to(dtype=response_mask.dtype), token_masked, seq_masked


def verl_legacy_rejection_mask(log_ratio, response_mask, rollout_rs: str, k: float):
    """volcengine/verl verl/trainer/ppo/rollout_corr_helper.py (commit 0b4e2a8),
    compute_rollout_rejection_mask with rollout_rs "token" or "geometric", threshold k and the
    default lower threshold 1/k: the modified response mask."""
    upper, lower = k, 1.0 / k
    if rollout_rs == "token":
        w = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    elif rollout_rs == "geometric":
        mean = _verl_masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        w = torch.exp(torch.clamp(mean, min=-20.0, max=20.0)).expand_as(log_ratio)
    else:
        raise ValueError(rollout_rs)
    mask = ((w >= lower) & (w <= upper)).float()
    return response_mask * mask


def verl_truncated_is(log_ratio, response_mask, threshold: float):
    """verl-project/verl rollout_corr_helper.py compute_rollout_correction_weights,
    rollout_is="token" with a float threshold (TIS): the weights, rollout_is_mean and
    rollout_is_ratio_fraction_high (compute_is_metrics, token level)."""
    raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0)) * response_mask
    weights = raw.clamp(max=threshold).detach()
    mean = _verl_masked_mean(weights, response_mask).item()
    fraction_high = _verl_masked_mean((raw > threshold).float(), response_mask).item()
    return weights, mean, fraction_high


def areal_ppo_actor_loss(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip,
                         loss_mask, eps_clip_higher, c_clip, behav_imp_weight_cap):
    """inclusionAI/AReaL areal/utils/functional.py ppo_actor_loss_fn (decoupled loss: proximal =
    the recomputed log-probs, old = the inference engine's), the loss only."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_higher)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    pg_loss = torch.max(pg_loss1, pg_loss2)
    pg_loss3 = torch.sign(advantages) * c_clip * advantages
    pg_loss = torch.min(pg_loss, pg_loss3)
    behav_imp_weight = (proximal_logprobs - old_logprobs).exp()
    behav_mask = ((behav_imp_weight <= behav_imp_weight_cap).logical_and(loss_mask)
                  if behav_imp_weight_cap is not None else loss_mask)
    behav_imp_weight = torch.where(behav_mask, behav_imp_weight, 0.0)
    pg_loss = pg_loss * behav_imp_weight
    return torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count


def _margin(stat: torch.Tensor, k: float) -> float:
    """Distance of the nearest statistic to a bound +-log k (in log space)."""
    return float((stat.abs() - math.log(k)).abs().min())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1.2, 1.5, 2.0])
def test_token_mask_equals_verls_token_k1(seed, k):
    b = batch(seed)
    lr = b["old"] - b["engine"]
    assert _margin(lr.clamp(-20, 20)[b["mask"].bool()], k) > 1e-9  # no tie for eps to break
    kept, m = token_ratio_mask(b["old"], b["engine"], b["mask"], k)
    want, token_fraction, seq_fraction = verl_rejection_mask(lr, b["mask"], "token_k1", k)
    assert torch.equal(kept, want)
    assert torch.equal(kept, verl_legacy_rejection_mask(lr, b["mask"], "token", k))
    assert float(m["rollout/token_mask_fraction"]) == pytest.approx(token_fraction, rel=1e-7)
    assert float(m["rollout/token_mask_seq_fraction"]) == pytest.approx(seq_fraction, rel=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1.1, 1.2, 1.5])
def test_sequence_mask_equals_verls_seq_mean_k1_and_geometric(seed, k):
    b = batch(seed, spread=0.3)
    b["engine"][-2:, 0] = b["old"][-2:, 0]  # no clamped token: there old and new verl agree
    lr, mask = b["old"] - b["engine"], b["mask"]
    seq_lr = (lr * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    assert _margin(seq_lr[mask.bool().any(-1)], k) > 1e-6  # verl's 1e-8 cannot tip a sample
    kept, m = sequence_ratio_mask(b["old"], b["engine"], mask, k)
    want, token_fraction, seq_fraction = verl_rejection_mask(lr, mask, "seq_mean_k1", k)
    assert torch.equal(kept, want)
    assert torch.equal(kept, verl_legacy_rejection_mask(lr, mask, "geometric", k))
    assert float(m["rollout/seq_mask_token_fraction"]) == pytest.approx(token_fraction, rel=1e-7)
    assert float(m["rollout/seq_mask_fraction"]) == pytest.approx(seq_fraction, rel=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cap", [1.2, 2.0])
def test_truncated_is_equals_verls_token_tis(seed, cap):
    """rollout.tis_cap (kept as it was) is verl's token-level TIS, weights and both metrics."""
    b = batch(seed)
    weights, m = truncated_is_weights(b["old"], b["engine"], b["mask"], cap)
    want, mean, fraction_high = verl_truncated_is(b["old"] - b["engine"], b["mask"], cap)
    assert torch.allclose(weights, want, rtol=1e-15, atol=0)
    assert m["rollout/tis_weight_mean"] == pytest.approx(mean, rel=1e-7)
    assert m["rollout/tis_clip_fraction"] == pytest.approx(fraction_high, rel=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cap", [None, 1.4])
def test_decoupled_ppo_loss_equals_areals(seed, cap):
    """ppo_loss (token-mean, clip around pi_old) weighted by decoupled_weights is AReaL's
    decoupled objective: the loss and its gradient."""
    b = batch(seed)
    b["engine"][-2:, 0] = b["old"][-2:, 0]  # AReaL does not clamp the log-ratio at 20
    mask = b["mask"]
    w, _ = decoupled_weights(b["old"], b["engine"], mask, cap)
    params = PolicyLossParams(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                              clip_ratio_c=3.0)
    ours_lp = b["log_prob"].clone().requires_grad_(True)
    ours, _ = ppo_loss(ours_lp, b["old"], b["advantages"], mask, LossDenominators.of(mask),
                       params, token_weights=w)
    theirs_lp = b["log_prob"].clone().requires_grad_(True)
    theirs = areal_ppo_actor_loss(theirs_lp, b["old"], b["engine"], b["advantages"], 0.2,
                                  mask.bool(), 0.28, 3.0, cap)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_lp.grad, theirs_lp.grad, rtol=1e-12, atol=1e-15)
    if cap is not None:  # a capped token weighs 0 but still counts in AReaL's normaliser
        assert bool(((w == 0) & mask.bool()).any())


# ---------------------------------------------------------------------------------------------
# In the loss: a rejected token is out of the sum, the normaliser and the gradient.

@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_masked_tokens_leave_the_loss_its_normaliser_and_the_gradient(mode, seed):
    b = batch(seed)
    fix = correct_off_policy(b["old"], b["engine"], b["mask"], token_mask=1.5, seq_mask=1.25)
    kept = fix.loss_mask
    rejected = b["mask"].bool() & ~kept.bool()
    assert bool(rejected.any()) and bool(kept.bool().any())
    params = PolicyLossParams(agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28,
                              clip_ratio_c=3.0)
    norm_len = float(b["mask"].shape[1])

    def loss_of(log_prob, advantages):
        lp = log_prob.clone().requires_grad_(True)
        loss, _ = ppo_loss(lp, b["old"], advantages, kept,
                           LossDenominators.of(kept, norm_len=norm_len), params)
        loss.backward()
        return float(loss), lp.grad

    loss, grad = loss_of(b["log_prob"], b["advantages"])
    # float64 reference over the kept tokens only: their count (and samples) the normaliser
    tokens, _, _ = ref.ppo_tokens(b["log_prob"], b["old"], b["advantages"], 0.2, 0.28, 3.0)
    assert loss == pytest.approx(ref.aggregate(tokens, kept, mode, norm_len), rel=1e-12)
    assert bool((grad[rejected] == 0).all())
    # Anything at a rejected token (its log-prob, its advantage) changes nothing.
    noise = torch.randn(b["log_prob"].shape, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(9))
    moved_lp = torch.where(rejected, b["log_prob"] + noise, b["log_prob"])
    moved_adv = torch.where(rejected, b["advantages"] * 10 + 1, b["advantages"])
    loss2, grad2 = loss_of(moved_lp, moved_adv)
    assert loss2 == loss and torch.equal(grad2, grad)
