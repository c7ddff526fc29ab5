import math

import pytest
import torch

from tests.algo import reference as ref
from tests.algo.loss_inputs import AGG_MODES, loss_batch, run_loss
from verl_mcore.algo.aggregation import LossDenominators, aggregate_loss, global_denominators
from verl_mcore.algo.policy_loss import (
    POLICY_LOSSES,
    PolicyLossParams,
    compute_policy_loss,
    entropy_bonus,
    ppo_loss,
    should_compute_entropy,
)
from verl_mcore.algo.value_loss import value_loss

SEEDS = [0, 1, 2]
LO, HI, C = 0.2, 0.28, 3.0  # the clip settings run_loss uses


def close(actual: torch.Tensor, expected: float, tol=1e-10):
    assert math.isfinite(actual.item())
    assert abs(actual.item() - expected) <= tol * max(1.0, abs(expected)), (actual.item(), expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_matches_reference(seed, mode):
    b = loss_batch(seed)
    x = b["advantages"]
    denoms = LossDenominators.of(b["mask"])
    close(aggregate_loss(x, b["mask"], mode, denoms), ref.aggregate(ref.rows(x), b["mask"], mode, x.shape[1]))


def test_denominators_count_only_rows_with_valid_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 0]])
    d = global_denominators(mask)
    assert (d.num_tokens, d.num_seqs, d.norm_len) == (3.0, 2.0, 3.0)
    assert global_denominators(mask, norm_len=128).norm_len == 128.0
    empty = torch.zeros(2, 4, dtype=torch.bool)
    for mode in AGG_MODES:  # an empty mini-batch contributes 0, not NaN
        assert aggregate_loss(torch.ones(2, 4), empty, mode, global_denominators(empty)).item() == 0.0


def test_aggregate_loss_rejects_unknown_mode_and_shapes():
    m = torch.ones(2, 3)
    d = LossDenominators.of(m)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        aggregate_loss(torch.ones(2, 3), m, "mean", d)
    with pytest.raises(ValueError, match="same"):
        aggregate_loss(torch.ones(2, 4), m, "token-mean", d)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_matches_reference(seed, mode):
    b = loss_batch(seed)
    m = b["mask"]
    loss, diag = run_loss("ppo", b, b["log_prob"], LossDenominators.of(m), mode)
    tok, clipped, lower = ref.ppo_tokens(b["log_prob"], b["old_log_prob"], b["advantages"], LO, HI, C)
    close(loss, ref.aggregate(tok, m, mode, m.shape[1]))
    close(diag["pg_clipfrac"], ref.token_mean(clipped, m))
    close(diag["pg_clipfrac_lower"], ref.token_mean(lower, m))
    log_ratio = (b["log_prob"] - b["old_log_prob"]).clamp(-20, 20)
    close(diag["ppo_kl"], ref.token_mean(ref.rows(-log_ratio), m))
    assert 0 < diag["pg_clipfrac"].item() < 1 and 0 < diag["pg_clipfrac_lower"].item() < 1, \
        "the inputs must exercise both clips for this test to mean something"


def test_ppo_dual_clip_and_log_ratio_clamp_by_hand():
    # A < 0 with ratio e^25: unclipped loss = 2 * e^20 (clamped ratio), dual clip caps it at -A*c.
    lp = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-25.0, 0.0, -0.5, 0.5]], dtype=torch.float64)
    a = torch.tensor([[-2.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    m = torch.ones(1, 4)
    params = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0)
    loss, diag = ppo_loss(lp, old, a, m, LossDenominators.of(m), params)
    # token 0: min(max(2 e^20, 2*1.3), 6) = 6; token 1: -1; token 2: ratio e^.5 clipped to 1.3 -> -1.3;
    # token 3: ratio e^-.5 = 0.607 < 0.8, A > 0: max(-0.607, -0.8) = -0.607 (pessimistic, unclipped).
    expected = (6.0 - 1.0 - 1.3 - math.exp(-0.5)) / 4
    close(loss, expected, 1e-12)
    assert diag["pg_clipfrac"].item() == 0.25  # token 2 (token 0's PPO term is the unclipped one)
    assert diag["pg_clipfrac_lower"].item() == 0.25  # token 0
    loss.backward()
    # Only the unclipped token 1 and token 3 carry gradient -A * ratio / 4.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.25, 0.0, -math.exp(-0.5) / 4]], dtype=torch.float64))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_matches_reference_value_and_gradient(seed, mode):
    b = loss_batch(seed)
    m = b["mask"]
    # Small log-ratio noise so that sequence ratios fall both inside and outside the clip range.
    b["old_log_prob"] = b["log_prob"] + 0.15 * torch.randn(m.shape, generator=torch.Generator().manual_seed(seed),
                                                           dtype=torch.float64)
    lp = b["log_prob"].clone().requires_grad_(True)
    loss, diag = run_loss("gspo", b, lp, LossDenominators.of(m), mode)
    tok, clipped, dtok = ref.gspo_tokens(b["log_prob"], b["old_log_prob"], b["advantages"], m, LO, HI)
    close(loss, ref.aggregate(tok, m, mode, m.shape[1]))
    close(diag["pg_clipfrac"], ref.token_mean(clipped, m))
    loss.backward()
    w = ref.token_weights(m, mode, m.shape[1])
    expected = [[w[i][t] * dtok[i][t] for t in range(m.shape[1])] for i in range(m.shape[0])]
    torch.testing.assert_close(lp.grad, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-9)


def test_gspo_clamps_the_sequence_log_ratio_above_at_10_like_verl():
    """verl's compute_policy_loss_gspo: clamp(log s, max=10). A sequence 12 nats above its old
    probability with A < 0 loses e^10 a token and gets no gradient; one 30 nats below is not
    clamped (its ratio is ~0, and with A > 0 the unclipped -A s wins)."""
    m = torch.ones(3, 4, dtype=torch.bool)
    lp = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-12.0] * 4, [30.0] * 4, [0.1] * 4], dtype=torch.float64)
    adv = torch.tensor([[-1.0] * 4, [1.0] * 4, [1.0] * 4], dtype=torch.float64)
    b = {"log_prob": lp.detach(), "old_log_prob": old, "advantages": adv, "mask": m}
    loss, _ = run_loss("gspo", b, lp, LossDenominators.of(m), "seq-mean-token-mean")
    loss.backward()
    s = math.exp(-0.1)
    assert 1 - LO < s < 1 + HI
    close(loss, (math.exp(10.0) - math.exp(-30.0) - s) / 3)
    assert lp.grad[0].abs().max().item() == 0.0
    torch.testing.assert_close(lp.grad[2], torch.full((4,), -s / 4 / 3, dtype=torch.float64))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_reinforce_matches_reference(seed, mode):
    b = loss_batch(seed)
    m = b["mask"]
    lp = b["log_prob"].clone().requires_grad_(True)
    loss, diag = run_loss("reinforce", b, lp, LossDenominators.of(m), mode)
    tok = ref.rows(-b["advantages"] * b["log_prob"])
    close(loss, ref.aggregate(tok, m, mode, m.shape[1]))
    assert diag["pg_clipfrac"].item() == 0 and diag["pg_clipfrac_lower"].item() == 0
    loss.backward()
    w = torch.tensor(ref.token_weights(m, mode, m.shape[1]), dtype=torch.float64)
    torch.testing.assert_close(lp.grad, -b["advantages"] * w)


def test_policy_loss_registry_and_param_checks():
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "reinforce", "gpg"}
    m = torch.ones(1, 2)
    with pytest.raises(ValueError, match="unknown policy loss 'dpo'"):
        compute_policy_loss("dpo", m, m, m, m, LossDenominators.of(m), PolicyLossParams())
    with pytest.raises(ValueError, match="clip_ratio_c=1.0 must be > 1"):
        PolicyLossParams(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode='sum'"):
        PolicyLossParams(agg_mode="sum")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_matches_reference(seed, mode):
    b = loss_batch(seed)
    m = b["mask"]
    loss, diag = run_loss("value", b, b["values"], LossDenominators.of(m), mode)
    tok, clipped = ref.value_tokens(b["values"], b["old_values"], b["returns"], 0.2)
    close(loss, ref.aggregate(tok, m, mode, m.shape[1]))
    close(diag["vf_clipfrac"], ref.token_mean(clipped, m))
    assert 0 < diag["vf_clipfrac"].item() < 1


@pytest.mark.parametrize("name", ["ppo", "reinforce", "value", "kl_k1", "kl_abs", "kl_k2", "kl_k3"])
def test_gradients_match_finite_differences(name):
    b = loss_batch(4, batch=6, length=6)
    key = "values" if name == "value" else "log_prob"
    denoms = LossDenominators.of(b["mask"])

    def f(x):
        return run_loss(name, b, x, denoms, "seq-mean-token-mean")[0]

    assert torch.autograd.gradcheck(f, (b[key].clone().requires_grad_(True),), eps=1e-7, atol=1e-6)


def test_vf_clipfrac_counts_only_values_the_clip_changed():
    """At and inside the clip boundaries nothing counts as clipped, in float32 and bfloat16-like
    magnitudes: the old `old + (v - old).clamp(-eps, eps)` was an ulp off for about 13% of
    in-range values and counted them. Just outside, the clipped term counts when it is larger."""
    eps = 0.2
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 256, generator=g) * 3
    inside = old + (torch.rand(64, 256, generator=g) * 2 - 1) * eps  # strictly inside
    returns = torch.randn(64, 256, generator=g) * 3
    mask = torch.ones(64, 256)
    denoms = LossDenominators.of(mask)
    _, diag = value_loss(inside, old, returns, mask, denoms, clip_eps=eps)
    assert diag["vf_clipfrac"].item() == 0.0
    # Exactly on the boundaries: the clamp leaves the value as it is.
    for edge in (old + eps, old - eps):
        _, diag = value_loss(edge, old, returns, mask, denoms, clip_eps=eps)
        assert diag["vf_clipfrac"].item() == 0.0
    # Outside, moving away from the return: clipped term smaller, not counted; moving past the
    # return from the far side: the clipped prediction stays farther, counted.
    old1 = torch.zeros(1, 4)
    values = torch.tensor([[0.5, -0.5, 0.5, 0.1]])  # |v - old| > eps except the last
    rets = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    _, diag = value_loss(values, old1, rets, torch.ones(1, 4), LossDenominators.of(torch.ones(1, 4)), eps)
    # token 0: v 0.5 -> clip 0.2, return 1: clipped farther (0.64 > 0.25): counted
    # token 1: v -0.5 -> clip -0.2, return 1: clipped nearer (1.44 < 2.25): not counted
    # token 2: v 0.5 -> clip 0.2, return 0: clipped nearer: not counted; token 3 inside: not
    assert diag["vf_clipfrac"].item() == 0.25


def test_value_loss_rejects_negative_clip():
    m = torch.ones(1, 2)
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(m, m, m, m, LossDenominators.of(m), clip_eps=-0.1)


def test_entropy_bonus():
    b = loss_batch(0)
    m, ent = b["mask"], b["entropy"].clone().requires_grad_(True)
    d = LossDenominators.of(m)
    term, diag = entropy_bonus(ent, m, d, entropy_coeff=0.01, agg_mode="token-mean")
    close(term, -0.01 * ref.token_mean(ref.rows(b["entropy"]), m))
    close(diag["entropy"], ref.token_mean(ref.rows(b["entropy"]), m))
    zero, diag0 = entropy_bonus(ent, m, d, entropy_coeff=0.0)
    assert zero.item() == 0 and not zero.requires_grad and "entropy" in diag0
    assert entropy_bonus(None, m, d, entropy_coeff=0.0)[1] == {}
    with pytest.raises(ValueError, match="entropy_coeff=0.01 but no entropy"):
        entropy_bonus(None, m, d, entropy_coeff=0.01)
    assert should_compute_entropy(0.0, log_entropy=False) is False
    assert should_compute_entropy(0.0, log_entropy=True) is True
    assert should_compute_entropy(1e-3, log_entropy=False) is True


@pytest.mark.parametrize("seed", SEEDS)
def test_truncated_is_weights_by_hand(seed):
    from verl_mcore.algo.policy_loss import truncated_is_weights

    b = loss_batch(seed)
    mask, old = b["mask"], b["old_log_prob"]
    g = torch.Generator().manual_seed(seed)
    engine = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.7
    cap = 1.5
    weights, metrics = truncated_is_weights(old, engine, mask, cap)
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            ratio = math.exp(max(-20.0, min(20.0, float(old[i, t] - engine[i, t]))))
            want = min(ratio, cap) if mask[i, t] else 0.0
            assert math.isclose(float(weights[i, t]), want, rel_tol=1e-12, abs_tol=1e-15)
    valid = mask.bool()
    truncated = sum(1 for i, t in valid.nonzero().tolist()
                    if math.exp(float(old[i, t] - engine[i, t])) > cap)
    assert math.isclose(metrics["rollout/tis_clip_fraction"], truncated / int(valid.sum()))
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="tis_cap"):
        truncated_is_weights(old, engine, mask, 0.0)


@pytest.mark.parametrize("name", ["ppo", "gspo", "reinforce"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_token_weights_scale_each_tokens_loss(name, mode):
    """Weights w multiply each token's loss before aggregation: the weighted loss equals the
    loss of the unweighted per-token terms times w, by hand, and w = 1 changes nothing."""
    b = loss_batch(3)
    mask = b["mask"]
    denoms = LossDenominators.of(mask, norm_len=9.0)
    params = PolicyLossParams(agg_mode=mode)
    g = torch.Generator().manual_seed(7)
    w = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
    args = (b["log_prob"], b["old_log_prob"], b["advantages"], mask, denoms, params)
    plain, _ = compute_policy_loss(name, *args)
    ones, _ = compute_policy_loss(name, *args, torch.ones_like(w))
    weighted, _ = compute_policy_loss(name, *args, w)
    assert torch.equal(plain, ones)
    # Each token's term of the aggregated loss: the loss with that token's weight alone.
    per_token = torch.zeros_like(w)
    for i, t in mask.nonzero().tolist():
        e = torch.zeros_like(w)
        e[i, t] = 1.0
        per_token[i, t] = compute_policy_loss(name, *args, e)[0]
    assert torch.allclose(weighted, (per_token * w).sum(), rtol=1e-10, atol=1e-12)
