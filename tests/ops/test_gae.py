"""verl_mcore.ops.gae on CPU: the public op is `verl_mcore.algo.advantages.gae`, checked here
against an independent float64 scalar loop of the documented recurrence."""
import pytest
import torch

from verl_mcore import ops


def gae_scalar_loop(rewards, values, mask, gamma, lam):
    """float64, one scalar at a time: the recurrence exactly as written in the algo docstring."""
    batch, length = rewards.shape
    adv = torch.zeros(batch, length, dtype=torch.float64)
    ret = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        next_value = next_adv = 0.0
        for t in range(length - 1, -1, -1):
            if mask[b, t]:
                r, v = float(rewards[b, t]), float(values[b, t])
                a = r + gamma * next_value - v + gamma * lam * next_adv
                adv[b, t], ret[b, t] = a, a + v
                next_value, next_adv = v, a
    return adv, ret


@pytest.mark.parametrize("batch,length", [(1, 1), (3, 17), (4, 64)])
def test_matches_scalar_loop_with_holes_and_empty_rows(batch, length):
    g = torch.Generator().manual_seed(batch * 100 + length)
    rewards = torch.randn(batch, length, generator=g)
    values = torch.randn(batch, length, generator=g)
    mask = torch.rand(batch, length, generator=g) > 0.3
    mask[0] = False  # an all-masked row
    rewards[~mask] = float("nan")  # masked positions must never be read
    values[~mask] = float("nan")
    adv, ret = ops.gae(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = gae_scalar_loop(rewards, values, mask, 0.99, 0.95)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)


def test_shape_errors_name_the_tensors():
    with pytest.raises(ValueError, match="must all be"):
        ops.gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


def test_fake_tensor_shapes_for_compile():
    fn = torch.compile(lambda r, v, m: ops.gae(r, v, m, 1.0, 0.9), fullgraph=True, backend="eager")
    r, v, m = torch.randn(2, 5), torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool)
    adv, ret = fn(r, v, m)
    torch.testing.assert_close(adv, ops.gae(r, v, m, 1.0, 0.9)[0])
