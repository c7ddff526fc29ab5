"""Hypothesis properties: shapes, finiteness, whitening statistics, clip fractions in [0, 1]."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_mcore.algo import advantages as adv
from verl_mcore.algo.aggregation import AGG_MODES, LossDenominators
from verl_mcore.algo.policy_loss import POLICY_LOSSES, PolicyLossParams
from verl_mcore.algo.value_loss import value_loss

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def token_batches(draw, low=-1e3, high=1e3):
    """Random (x, y, mask, group_ids) with shapes [batch, T], [batch, T], [batch, T], [batch]."""
    batch = draw(st.integers(1, 6))
    length = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(batch, length, dtype=torch.float64).uniform_(low, high, generator=g)
    y = torch.empty(batch, length, dtype=torch.float64).uniform_(low, high, generator=g)
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    mask = torch.rand(batch, length, generator=g) < density
    group_ids = torch.randint(-2, 2, (batch,), generator=g)
    return x, y, mask, group_ids


@PROPERTY_SETTINGS
@given(token_batches(), st.floats(0, 1), st.floats(0, 1))
def test_gae_finite_and_zero_where_masked(batch, gamma, lam):
    rewards, values, mask, _ = batch
    a, r = adv.gae(rewards, values, mask, gamma, lam)
    assert a.shape == r.shape == mask.shape
    assert torch.isfinite(a).all() and torch.isfinite(r).all()
    assert (a[~mask] == 0).all() and (r[~mask] == 0).all()


@PROPERTY_SETTINGS
@given(token_batches(), st.booleans())
def test_group_estimators_finite_and_centred(batch, norm_by_std):
    scores, _, mask, group_ids = batch
    scores = scores[:, 0]
    for out in (adv.grpo(scores, group_ids, mask, norm_by_std), adv.rloo(scores, group_ids, mask)):
        assert out.shape == mask.shape and torch.isfinite(out).all() and (out[~mask] == 0).all()
    # Within each group of size > 1, the per-sequence advantages sum to 0.
    per_seq = adv.rloo(scores, group_ids, torch.ones_like(mask))[:, 0]
    for gid in group_ids.unique():
        members = group_ids == gid
        assert abs(per_seq[members].sum().item()) <= 1e-9 * max(1.0, scores.abs().max().item())


@PROPERTY_SETTINGS
@given(token_batches(), st.sampled_from(["reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"]))
def test_registry_estimators_finite_or_clear_error(batch, name):
    rewards, values, mask, group_ids = batch
    try:
        a, r = adv.compute_advantages(name, rewards, mask, values=values, group_ids=group_ids,
                                      baseline_scores=values[:, 0], gamma=0.99, lam=0.95)
    except ValueError as e:  # the whitening estimators refuse batches with < 2 valid tokens
        assert "at least 2 valid tokens" in str(e) and mask.sum() < 2
        return
    assert torch.isfinite(a).all() and torch.isfinite(r).all()
    assert (a[~mask] == 0).all()


@PROPERTY_SETTINGS
@given(token_batches(low=-50, high=50), st.floats(-1e3, 1e3))
def test_whitening_gives_mean_zero_std_one(batch, offset):
    x, _, mask, _ = batch
    x = x + offset
    if mask.sum() < 2:
        with pytest.raises(ValueError):
            adv.masked_whiten(x, mask)
        return
    out = adv.masked_whiten(x, mask)
    valid = out[mask]
    assert torch.isfinite(out).all() and (out[~mask] == 0).all()
    assert abs(valid.mean().item()) < 1e-9
    if x[mask].var().item() > 1e-3:  # eps=1e-8 inside the sqrt is negligible there
        assert math.isclose(valid.std().item(), 1.0, rel_tol=1e-6)


@PROPERTY_SETTINGS
@given(token_batches(low=-30, high=0), st.sampled_from(sorted(POLICY_LOSSES)), st.sampled_from(AGG_MODES),
       st.floats(0, 0.5), st.floats(0, 0.5), st.floats(1.01, 10))
def test_policy_losses_finite_and_clip_fractions_in_unit_interval(batch, name, mode, lo, hi, c):
    log_prob, old_log_prob, mask, _ = batch
    g = torch.Generator().manual_seed(int(mask.sum()))
    advantages = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 5
    log_prob = log_prob.clone().requires_grad_(True)
    params = PolicyLossParams(agg_mode=mode, clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c)
    loss, diag = POLICY_LOSSES[name](log_prob, old_log_prob, advantages, mask, LossDenominators.of(mask), params)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    for key in ("pg_clipfrac", "pg_clipfrac_lower"):
        assert 0.0 <= diag[key].item() <= 1.0, (key, diag[key])


@PROPERTY_SETTINGS
@given(token_batches(low=-10, high=10), st.floats(0, 2))
def test_value_clipfrac_in_unit_interval(batch, clip_eps):
    values, returns, mask, _ = batch
    old = values.flip(-1)
    loss, diag = value_loss(values, old, returns, mask, LossDenominators.of(mask), clip_eps)
    assert torch.isfinite(loss) and loss.item() >= 0
    assert 0.0 <= diag["vf_clipfrac"].item() <= 1.0
