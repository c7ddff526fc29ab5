"""The device rule's guard (engine/batch.py: where the tensors live): every algo function (and
reward placement) names the tensors and their devices when its inputs are not on one device,
instead of torch's "Expected all tensors to be on the same device". On the CPU machines the
second device is `meta`."""
import pytest
import torch

from verl_mcore.algo import advantages as adv
from verl_mcore.algo import kl
from verl_mcore.algo.aggregation import LossDenominators, aggregate_loss
from verl_mcore.algo.policy_loss import PolicyLossParams, compute_policy_loss
from verl_mcore.algo.value_loss import value_loss
from verl_mcore.reward.placement import place_on_last_token

B, T = 4, 6


def _cpu(*shape):
    return torch.ones(*shape)


def _meta(*shape):
    return torch.ones(*shape, device="meta")


DENOMS = LossDenominators(num_tokens=24.0, num_seqs=4.0, norm_len=6.0)
CASES = {
    "gae": lambda: adv.compute_advantages("gae", _cpu(B, T), _cpu(B, T), values=_meta(B, T)),
    "grpo": lambda: adv.compute_advantages("grpo", _cpu(B, T), _cpu(B, T),
                                           group_ids=torch.zeros(B, dtype=torch.long, device="meta")),
    "remax": lambda: adv.remax(_cpu(B, T), _meta(B), _cpu(B, T)),
    "rloo": lambda: adv.rloo(_meta(B), torch.zeros(B, dtype=torch.long), _cpu(B, T)),
    "reinforce_plus_plus": lambda: adv.reinforce_plus_plus(_meta(B, T), _cpu(B, T), 1.0),
    "masked_whiten": lambda: adv.masked_whiten(_cpu(B, T), _meta(B, T)),
    "apply_kl_penalty": lambda: kl.apply_kl_penalty(_cpu(B, T), _cpu(B, T), _meta(B, T), _cpu(B, T),
                                                    kl.FixedKLController(0.1)),
    "kl_loss": lambda: kl.kl_loss(_cpu(B, T), _meta(B, T), _cpu(B, T), DENOMS),
    "policy_loss": lambda: compute_policy_loss("ppo", _cpu(B, T), _cpu(B, T), _meta(B, T), _cpu(B, T),
                                               DENOMS, PolicyLossParams()),
    "value_loss": lambda: value_loss(_cpu(B, T), _meta(B, T), _cpu(B, T), _cpu(B, T), DENOMS, 0.2),
    "aggregate_loss": lambda: aggregate_loss(_meta(B, T), _cpu(B, T), "token-mean", DENOMS),
    "place_on_last_token": lambda: place_on_last_token(_meta(B), _cpu(B, T)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mixed_devices_are_named(name):
    with pytest.raises(ValueError) as err:
        CASES[name]()
    msg = str(err.value)
    assert "on cpu" in msg and "on meta" in msg, msg
    assert "different devices" in msg


def test_one_device_passes_the_guard():
    # Everything on meta: the guard lets it through (the computation itself runs on meta).
    adv.compute_advantages("gae", _meta(B, T), _meta(B, T), values=_meta(B, T), whiten=False)
