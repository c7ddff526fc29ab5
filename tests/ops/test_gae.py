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


def test_gae_whitened_is_gae_then_masked_whiten():
    from verl_mcore.algo.advantages import masked_whiten

    rewards, values = torch.randn(4, 33), torch.randn(4, 33)
    mask = torch.rand(4, 33) > 0.4
    adv, ret = ops.gae_whitened(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = ops.gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, masked_whiten(ref_adv, mask))
    torch.testing.assert_close(ret, ref_ret)
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        ops.gae_whitened(rewards, values, torch.zeros_like(mask), 0.99, 0.95)


def _tile_stats(x: torch.Tensor, valid: torch.Tensor, tile: int) -> torch.Tensor:
    """(count, mean, M2) of the valid entries of each `tile`-long piece of the flattened x: what the
    GAE kernel emits for fused whitening."""
    rows = []
    for lo in range(0, x.numel(), tile):
        v = x.flatten()[lo:lo + tile][valid.flatten()[lo:lo + tile]].double()
        mean = v.mean() if v.numel() else torch.tensor(0.0, dtype=torch.float64)
        rows.append([float(v.numel()), mean.item(), ((v - mean) ** 2).sum().item()])
    return torch.tensor(rows, dtype=torch.float32)


def test_moments_from_tile_stats_pool_exactly():
    from verl_mcore.ops.gae import moments_from_tile_stats

    x = torch.randn(5, 41) * 3 + 7
    valid = torch.rand(5, 41) > 0.3
    valid[1] = False  # tiles without any valid entry
    n, mean, var = moments_from_tile_stats(_tile_stats(x, valid, 16), None)
    ref = x[valid].double()
    assert n == ref.numel()
    assert abs(mean - ref.mean().item()) <= 1e-5 and abs(var - ref.var().item()) <= 1e-4


def _whiten_moments_body(rank, world_size, seed):
    import torch.distributed as dist

    from verl_mcore.ops.gae import moments_from_tile_stats

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, 50, generator=g) * (r + 1) for r in range(world_size)]
    valid = [torch.rand(3, 50, generator=g) > 0.5 for _ in range(world_size)]
    return moments_from_tile_stats(_tile_stats(xs[rank], valid[rank], 32), dist.group.WORLD)


@pytest.mark.distributed
def test_moments_from_tile_stats_across_ranks():
    from tests.multiproc import run_on_ranks

    results = run_on_ranks(_whiten_moments_body, world_size=2, args=(7,), timeout=120)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(3, 50, generator=g) * (r + 1) for r in range(2)]
    valid = [torch.rand(3, 50, generator=g) > 0.5 for _ in range(2)]
    pooled = torch.cat([x[v] for x, v in zip(xs, valid)]).double()
    for n, mean, var in results:
        assert n == pooled.numel()
        assert abs(mean - pooled.mean().item()) <= 1e-5 and abs(var - pooled.var().item()) <= 1e-4


@pytest.mark.parametrize("whiten", [True, False])
def test_trainer_gae_goes_through_ops_and_equals_the_loop(whiten, monkeypatch):
    """compute_advantages("gae") (the trainer's call) dispatches through verl_mcore.ops (the
    CUDA kernel there on GPUs) and on the CPU equals the loop, whitening included."""
    from verl_mcore import ops
    from verl_mcore.algo import advantages as algo

    called = []
    for name in ("gae", "gae_whitened"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k))
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(5, 33, generator=g), torch.randn(5, 33, generator=g)
    mask = (torch.rand(5, 33, generator=g) > 0.3).float()
    adv, ret = algo.compute_advantages("gae", rewards, mask, values=values, gamma=0.99, lam=0.9,
                                       whiten=whiten)
    assert called == ["gae_whitened" if whiten else "gae"]
    ref_adv, ref_ret = algo.gae(rewards, values, mask, 0.99, 0.9)
    if whiten:
        ref_adv = algo.masked_whiten(ref_adv, mask)
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)


def test_reward_to_go_through_ops_is_the_loop_bit_for_bit():
    """REINFORCE++ and ReMax take their returns from ops.gae (values 0, lam 1): the same as
    discounted_returns, holes and empty rows included."""
    from verl_mcore.algo import advantages as algo

    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(6, 40, generator=g)
    mask = (torch.rand(6, 40, generator=g) > 0.3).float()
    mask[2] = 0
    for gamma in (1.0, 0.99, 0.5):
        assert torch.equal(algo._returns_via_ops(rewards, mask, gamma),
                           algo.discounted_returns(rewards, mask, gamma))
