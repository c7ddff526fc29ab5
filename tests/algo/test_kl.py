import math

import pytest
import torch

from tests.algo import reference as ref
from tests.algo.loss_inputs import AGG_MODES, loss_batch
from verl_mcore.algo.aggregation import LossDenominators
from verl_mcore.algo.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)

KINDS = ["k1", "abs", "k2", "k3", "low_var_kl"]
VERL_NAMES = {"kl": "k1", "mse": "k2"}  # verl's names for ours


@pytest.mark.parametrize("kind", KINDS)
def test_kl_penalty_matches_reference(kind):
    b = loss_batch(0)
    lp, rp = b["log_prob"], b["ref_log_prob"]
    rp[0, 0] = lp[0, 0] + 30.0  # k3 clamps: log-ratio to 20, the estimate to 10
    expected = ref.kl_tokens(lp, rp, "k3" if kind == "low_var_kl" else kind)
    torch.testing.assert_close(kl_penalty(lp, rp, kind), torch.tensor(expected, dtype=torch.float64))
    names = KINDS + list(VERL_NAMES)
    assert set(KL_PENALTIES) == set(names) | {n + "+" for n in names}


def test_schema_lists_every_penalty():
    import typing

    from verl_mcore.config.schema import KLKind
    assert set(typing.get_args(KLKind)) == set(KL_PENALTIES)


@pytest.mark.parametrize("name", sorted(VERL_NAMES))
def test_verl_names_are_our_estimators(name):
    b = loss_batch(3)
    assert torch.equal(kl_penalty(b["log_prob"], b["ref_log_prob"], name),
                       kl_penalty(b["log_prob"], b["ref_log_prob"], VERL_NAMES[name]))


@pytest.mark.parametrize("kind", KINDS + list(VERL_NAMES))
def test_plus_takes_value_of_estimator_and_gradient_of_k2(kind):
    """verl's straight-through "+" form: k1/k3's expected gradient is not KL's, k2's is."""
    b = loss_batch(4)
    rp = b["ref_log_prob"]
    rp[0, 0] = b["log_prob"][0, 0] + 30.0  # inside k3's clamp: the value is clamped, the gradient not
    lp = b["log_prob"].clone().requires_grad_(True)
    plus = kl_penalty(lp, rp, kind + "+")
    torch.testing.assert_close(plus.detach(), kl_penalty(b["log_prob"], rp, kind), rtol=0, atol=1e-12)
    plus.sum().backward()
    torch.testing.assert_close(lp.grad, b["log_prob"] - rp)  # d/dlogp of 0.5 (logp - ref)^2


def test_k3_is_nonnegative_and_clamped():
    lp = torch.linspace(-30, 30, 61, dtype=torch.float64)[None]
    k3 = kl_penalty(lp, torch.zeros_like(lp), "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all() and k3[0, 30] == 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_kl_loss_is_aggregated_penalty(mode):
    b = loss_batch(1)
    m = b["mask"]
    lp = b["log_prob"].clone().requires_grad_(True)
    loss, diag = kl_loss(lp, b["ref_log_prob"], m, LossDenominators.of(m), kind="k2", agg_mode=mode)
    expected = ref.aggregate(ref.kl_tokens(b["log_prob"], b["ref_log_prob"], "k2"), m, mode, m.shape[1])
    assert math.isclose(loss.item(), expected, rel_tol=1e-10)
    assert diag["kl_loss"].item() == loss.item()
    loss.backward()
    w = torch.tensor(ref.token_weights(m, mode, m.shape[1]), dtype=torch.float64)
    torch.testing.assert_close(lp.grad, (b["log_prob"] - b["ref_log_prob"]) * w)


@pytest.mark.parametrize("kind", ["k1", "low_var_kl"])
def test_apply_kl_penalty(kind):
    b = loss_batch(2)
    m = b["mask"]
    rewards = torch.randn(m.shape, dtype=torch.float64)
    ctrl = FixedKLController(0.05)
    out, info = apply_kl_penalty(rewards, b["log_prob"], b["ref_log_prob"], m, ctrl, kind)
    kl = ref.kl_tokens(b["log_prob"], b["ref_log_prob"], "k3" if kind == "low_var_kl" else kind)
    r = ref.rows(rewards)
    expected = [[r[i][t] - 0.05 * kl[i][t] if m[i, t] else r[i][t] for t in range(m.shape[1])]
                for i in range(m.shape[0])]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    per_seq = [sum(kl[i][t] for t in ref.valid_positions(m[i].tolist())) / m[i].sum().item()
               for i in range(m.shape[0]) if m[i].any()]
    assert math.isclose(info["current_kl"], sum(per_seq) / len(per_seq), rel_tol=1e-10)
    assert info["kl_coef"] == 0.05


def test_adaptive_controller_update_and_checkpoint():
    ctrl = AdaptiveKLController(kl_coef=0.1, target_kl=0.5, horizon=1000)
    ctrl.update(current_kl=0.6, n_steps=100)  # error 0.2 -> *1.02
    assert math.isclose(ctrl.value, 0.1 * 1.02)
    ctrl.update(current_kl=5.0, n_steps=100)  # error clipped to +0.2
    assert math.isclose(ctrl.value, 0.1 * 1.02 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=500)  # error clipped to -0.2 -> *0.9
    assert math.isclose(ctrl.value, 0.1 * 1.02 * 1.02 * 0.9)
    state = ctrl.state_dict()
    resumed = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.5, horizon=1000)
    resumed.load_state_dict(state)
    assert resumed.value == ctrl.value
    with pytest.raises(ValueError, match="not finite"):
        ctrl.update(float("nan"), 1)


def test_fixed_controller_and_kind_mismatch():
    ctrl = make_kl_controller("fixed", kl_coef=0.01)
    ctrl.update(current_kl=3.0, n_steps=10)
    assert ctrl.value == 0.01
    with pytest.raises(ValueError, match="holds a 'fixed' controller but the config asks for 'adaptive'"):
        AdaptiveKLController(0.1, 0.5, 100).load_state_dict(ctrl.state_dict())
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown KL controller 'pid'"):
        make_kl_controller("pid", kl_coef=0.1)
