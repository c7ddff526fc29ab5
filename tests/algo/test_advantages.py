import math

import pytest
import torch

from tests.algo import reference as ref
from verl_mcore.algo import advantages as adv

SEEDS = [0, 1, 2, 3]


def assert_close(actual: torch.Tensor, expected, atol=1e-10):
    expected = torch.tensor(expected, dtype=torch.float64)
    assert actual.dtype == torch.float64
    assert torch.isfinite(actual).all(), actual
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)])
def test_gae_matches_reference(seed, gamma, lam):
    b = ref.random_batch(seed)
    a, r = adv.gae(b["rewards"], b["values"], b["mask"], gamma, lam)
    exp_a, exp_r = ref.gae(b["rewards"], b["values"], b["mask"], gamma, lam)
    assert_close(a, exp_a)
    assert_close(r, exp_r)
    # Masked positions (NaN inputs there) are exactly 0 in both outputs.
    assert (a[~b["mask"]] == 0).all() and (r[~b["mask"]] == 0).all()


def test_gae_terminal_reward_gamma_lam_one_is_reward_minus_value():
    # Hand-checkable: one reward at the last valid token, gamma = lam = 1 -> A_t = r - V_t.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[0.5, -1.0, 9.0, 9.0, 2.0, 9.0], [0.25, 9, 9, 9, 9, 9], [9.0] * 6],
                          dtype=torch.float64)
    rewards = torch.zeros(3, 6, dtype=torch.float64)
    rewards[0, 4] = 3.0
    rewards[0, 2] = 100.0  # inside a hole: never read
    rewards[1, 0] = -1.0
    a, r = adv.gae(rewards, values, mask, 1.0, 1.0)
    expected = torch.tensor([[2.5, 4.0, 0, 0, 1.0, 0], [-1.25, 0, 0, 0, 0, 0], [0] * 6], dtype=torch.float64)
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-12)
    # Returns are advantage + value = the reward at every valid position, 0 elsewhere.
    expected_returns = torch.tensor([[3.0, 3.0, 0, 0, 3.0, 0], [-1.0, 0, 0, 0, 0, 0], [0] * 6],
                                    dtype=torch.float64)
    torch.testing.assert_close(r, expected_returns, rtol=0, atol=1e-12)


def test_gae_hole_is_transparent():
    # A hole between two valid tokens chains them exactly as if it were not there.
    gamma, lam = 0.9, 0.8
    values = torch.tensor([[0.3, 0.7, 1.1]], dtype=torch.float64)
    rewards = torch.tensor([[0.1, 0.0, 1.0]], dtype=torch.float64)
    holed_v = torch.tensor([[0.3, 5.0, 5.0, 0.7, 1.1]], dtype=torch.float64)
    holed_r = torch.tensor([[0.1, 7.0, 7.0, 0.0, 1.0]], dtype=torch.float64)
    holed_m = torch.tensor([[1, 0, 0, 1, 1]])
    a, r = adv.gae(rewards, values, torch.ones(1, 3), gamma, lam)
    ah, rh = adv.gae(holed_r, holed_v, holed_m, gamma, lam)
    torch.testing.assert_close(ah[:, [0, 3, 4]], a, rtol=0, atol=1e-14)
    torch.testing.assert_close(rh[:, [0, 3, 4]], r, rtol=0, atol=1e-14)
    assert (ah[:, 1:3] == 0).all() and (rh[:, 1:3] == 0).all()


def test_gae_low_precision_inputs_compute_in_float32():
    b = ref.random_batch(0)
    a, _ = adv.gae(b["rewards"].nan_to_num().bfloat16(), b["values"].nan_to_num().bfloat16(), b["mask"], 1.0, 0.95)
    assert a.dtype == torch.float32


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_match_reference(seed, gamma):
    b = ref.random_batch(seed)
    assert_close(adv.discounted_returns(b["rewards"], b["mask"], gamma),
                 ref.discounted_returns(b["rewards"], b["mask"], gamma))


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_whiten_matches_reference(seed):
    b = ref.random_batch(seed)
    x = b["values"]
    out = adv.masked_whiten(x, b["mask"])
    assert_close(out, ref.whiten(ref.rows(x), b["mask"]))
    valid = out[b["mask"]]
    assert abs(valid.mean().item()) < 1e-12
    assert math.isclose(valid.std().item(), 1.0, rel_tol=1e-6)
    # shift_mean=False keeps the mean: only scaled.
    kept = adv.masked_whiten(x, b["mask"], shift_mean=False)
    torch.testing.assert_close(kept[b["mask"]].mean(), x[b["mask"]].mean())


def test_masked_whiten_needs_two_tokens():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[1, 2] = True
    with pytest.raises(ValueError, match="at least 2 valid tokens.*found 1"):
        adv.masked_whiten(torch.randn(2, 3), mask)
    # All equal values: finite zeros, not NaN.
    out = adv.masked_whiten(torch.full((2, 3), 4.0), torch.ones(2, 3))
    assert (out == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(seed, norm_by_std):
    b = ref.random_batch(seed)
    out = adv.grpo(b["scores"], b["group_ids"], b["mask"], norm_by_std=norm_by_std)
    assert_close(out, ref.grpo(b["scores"], b["group_ids"], b["mask"], norm_by_std=norm_by_std), atol=1e-9)
    assert (out[3] == 0).all(), "group of size 1 gets advantage 0"
    assert (out[4:6] == 0).all(), "identical scores in a group give advantage 0"


def test_grpo_groups_by_id_not_position():
    scores = torch.tensor([1.0, 10.0, 3.0, 20.0])
    mask = torch.ones(4, 2)
    out = adv.grpo(scores, torch.tensor([5, 9, 5, 9]), mask, norm_by_std=False)
    torch.testing.assert_close(out[:, 0], torch.tensor([-1.0, -5.0, 1.0, 5.0]))
    perm = torch.tensor([2, 0, 3, 1])
    permuted = adv.grpo(scores[perm], torch.tensor([5, 9, 5, 9])[perm], mask, norm_by_std=False)
    torch.testing.assert_close(permuted, out[perm])


@pytest.mark.parametrize("score, size", [(0.7, 16), (0.9, 16), (0.7, 64), (123.456, 5), (123.456, 64), (0.1, 3)])
def test_equal_scores_give_exactly_zero_in_float32(score, size):
    """A group whose float32 scores are all equal: a float32 mean is an ulp off, and that error
    over a std made of the same error was O(1) (0.97 at 123.456 x 64). It must be exactly 0."""
    scores = torch.full((size + 2,), score, dtype=torch.float32)
    scores[-2:] = torch.tensor([0.0, 1.0])  # another group, not tied
    groups = torch.tensor([0] * size + [1, 1])
    mask = torch.ones(size + 2, 3)
    for out in (adv.grpo(scores, groups, mask), adv.grpo(scores, groups, mask, norm_by_std=False),
                adv.rloo(scores, groups, mask)):
        assert out.dtype == torch.float32
        assert torch.equal(out[:size], torch.zeros(size, 3))
        assert (out[size:] != 0).all()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_row_without_valid_tokens_keeps_its_score_in_the_group(estimator):
    """Token rewards carry a row's score on its last valid token; a row with none (a fully masked
    response) would count as 0 in its group's baseline. With the outcome scores given it counts
    with its own: the other rows match the estimator run on the scores themselves."""
    from verl_mcore.reward import place_on_last_token

    scores = torch.tensor([-1.0, 1.0, 1.0, 0.0, 0.5, 0.25])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.ones(6, 4)
    mask[0] = 0  # row 0: no valid token
    mask[3, 2:] = 0
    token_rewards = place_on_last_token(scores, mask)
    got, _ = adv.compute_advantages(estimator, token_rewards, mask, group_ids=groups, scores=scores)
    full = torch.ones(6, 4)
    want, _ = adv.compute_advantages(estimator, place_on_last_token(scores, full), full, group_ids=groups)
    if estimator == "reinforce_plus_plus_baseline":  # whitened over the valid tokens: compare the sign pattern and order
        assert torch.equal(got[0], torch.zeros(4))
        assert got[1, 0] > got[4, 0] > got[3, 0]  # centred scores 0.75 > 0.125 > -0.25 (group 0 mean 0.25)
    else:
        assert torch.allclose(got[1:][mask[1:].bool()], want[1:][mask[1:].bool()], atol=1e-6)
        assert torch.equal(got[0], torch.zeros(4))
    # Without the scores the masked row counts as 0: a different baseline for rows 1-3.
    old, _ = adv.compute_advantages(estimator, token_rewards, mask, group_ids=groups)
    assert not torch.allclose(old[1], got[1])


def test_grpo_rejects_float_group_ids():
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        adv.grpo(torch.zeros(2), torch.zeros(2), torch.ones(2, 3))


def test_group_ids_from_uids():
    ids = adv.group_ids_from_uids(["b", "a", "b", "c", "a"])
    assert ids.tolist() == [0, 1, 0, 2, 1]


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_reference(seed):
    b = ref.random_batch(seed)
    out = adv.rloo(b["scores"], b["group_ids"], b["mask"])
    assert_close(out, ref.rloo(b["scores"], b["group_ids"], b["mask"]))
    assert (out[3] == 0).all() and (out[4:6] == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_reinforce_plus_plus_matches_reference(seed, gamma):
    b = ref.random_batch(seed)
    a, r = adv.reinforce_plus_plus(b["rewards"], b["mask"], gamma)
    exp_r = ref.discounted_returns(b["rewards"], b["mask"], gamma)
    assert_close(r, exp_r)
    assert_close(a, ref.whiten(exp_r, b["mask"]))


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_matches_reference(seed):
    b = ref.random_batch(seed)
    out = adv.reinforce_plus_plus_baseline(b["rewards"], b["group_ids"], b["mask"])
    assert_close(out, ref.reinforce_plus_plus_baseline(b["rewards"], b["group_ids"], b["mask"]))


@pytest.mark.parametrize("seed", SEEDS)
def test_remax_matches_reference(seed):
    b = ref.random_batch(seed)
    a, r = adv.remax(b["rewards"], b["baseline_scores"], b["mask"])
    exp_a, exp_r = ref.remax(b["rewards"], b["baseline_scores"], b["mask"])
    assert_close(a, exp_a)
    assert_close(r, exp_r)


def test_registry_dispatch_matches_direct_calls():
    b = ref.random_batch(5)
    m, r = b["mask"], b["rewards"]
    scores = torch.tensor(ref.sequence_scores(r, m), dtype=torch.float64)
    common = dict(values=b["values"], group_ids=b["group_ids"], baseline_scores=b["baseline_scores"],
                  gamma=0.9, lam=0.8)
    expected = {
        "gae": adv.masked_whiten(adv.gae(r, b["values"], m, 0.9, 0.8)[0], m),
        "grpo": adv.grpo(scores, b["group_ids"], m),
        "rloo": adv.rloo(scores, b["group_ids"], m),
        "reinforce_plus_plus": adv.reinforce_plus_plus(r, m, 0.9)[0],
        "reinforce_plus_plus_baseline": adv.reinforce_plus_plus_baseline(r, b["group_ids"], m),
        "remax": adv.remax(r, b["baseline_scores"], m)[0],
    }
    assert set(adv.ADV_ESTIMATORS) == set(expected)
    for name, want in expected.items():
        got, returns = adv.compute_advantages(name, r, m, **common)
        torch.testing.assert_close(got, want, msg=name)
        assert torch.isfinite(got).all() and torch.isfinite(returns).all(), name
    # gae returns are the un-whitened advantages plus values; whiten=False skips whitening.
    raw, returns = adv.gae(r, b["values"], m, 0.9, 0.8)
    got, got_returns = adv.compute_advantages("gae", r, m, whiten=False, **common)
    torch.testing.assert_close(got, raw)
    torch.testing.assert_close(got_returns, returns)


def test_registry_errors_name_the_problem():
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        adv.compute_advantages("ppo", torch.zeros(2, 3), m)
    with pytest.raises(ValueError, match="'gae' needs values"):
        adv.compute_advantages("gae", torch.zeros(2, 3), m)
    with pytest.raises(ValueError, match="'grpo' needs group_ids"):
        adv.compute_advantages("grpo", torch.zeros(2, 3), m)
    with pytest.raises(ValueError, match="values has shape"):
        adv.gae(torch.zeros(2, 3), torch.zeros(2, 4), m, 1.0, 1.0)
