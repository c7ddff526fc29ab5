"""verl_mcore.ops.logprob_entropy (torch reference path) against a float64 full-vocabulary oracle."""
import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore import ops
from verl_mcore.ops import reference


def _oracle(logits: torch.Tensor, target: torch.Tensor, temperature: float):
    """float64 log_softmax over the whole vocabulary: (logp, entropy), each [tokens]."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _oracle_grads(logits, target, temperature, w_logp, w_ent):
    x = logits.detach().double().requires_grad_(True)
    logp, ent = _oracle(x, target, temperature)
    (w_logp * logp + w_ent * ent).sum().backward()
    return logp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("tokens,vocab", [(1, 1), (3, 2), (7, 1000), (33, 4099)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fp32_matches_float64_full_vocab(tokens, vocab, temperature):
    g = torch.Generator().manual_seed(tokens * 1000 + vocab)
    logits = (torch.randn(tokens, vocab, generator=g) * 4).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    w_logp, w_ent = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    logp, ent = ops.logprob_entropy(logits, target, temperature=temperature)
    (w_logp * logp + w_ent * ent).sum().backward()
    ref_logp, ref_ent, ref_grad = _oracle_grads(logits, target, temperature, w_logp, w_ent)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert _rel(logp, ref_logp) <= 1e-6
    if vocab > 1:  # entropy of a one-word vocabulary is exactly 0
        assert _rel(ent, ref_ent) <= 1e-6
    else:
        assert ent.abs().max().item() == 0.0
    assert _rel(logits.grad, ref_grad) <= 1e-6 if vocab > 1 else logits.grad.abs().max().item() == 0.0


def test_token_blocks_and_leading_dims(monkeypatch):
    """Several token blocks (a block boundary mid-batch) and [seq, batch, V] logits."""
    monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", 3 * 257)
    logits = (torch.randn(5, 3, 257) * 3).requires_grad_(True)
    target = torch.randint(0, 257, (5, 3))
    logp, ent = ops.logprob_entropy(logits, target, temperature=1.3)
    assert logp.shape == (5, 3) and ent.shape == (5, 3)
    (logp.sum() - 0.5 * ent.sum()).backward()
    ref_logp, ref_ent, ref_grad = _oracle_grads(logits, target, 1.3, 1.0, -0.5)
    assert _rel(logp, ref_logp) <= 1e-6 and _rel(ent, ref_ent) <= 1e-6
    assert _rel(logits.grad, ref_grad) <= 1e-6


def test_gradcheck_float64_both_outputs():
    logits = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 9, (4,))
    assert torch.autograd.gradcheck(lambda x: ops.logprob_entropy(x, target, temperature=0.8), (logits,))


def test_vocab_shards_by_hand_match_unsplit():
    """Shards computed one at a time (targets outside a shard) combine to the unsplit answer."""
    logits = torch.randn(6, 23, dtype=torch.float64) * 5
    target = torch.tensor([0, 22, 10, 11, 12, 5])
    full = reference.local_stats(logits, target, 0, 0.9)
    shards = [reference.local_stats(logits[:, lo:hi], target, lo, 0.9) for lo, hi in [(0, 11), (11, 23)]]
    # Combine like combine_stats does across ranks, but in-process.
    m = torch.maximum(shards[0][:, 0], shards[1][:, 0])
    s = sum(st[:, 1] * torch.exp(st[:, 0] - m) for st in shards)
    sd = sum(torch.exp(st[:, 0] - m) * (st[:, 2] + (st[:, 0] - m) * st[:, 1]) for st in shards)
    zt = sum(st[:, 3] for st in shards)
    logp, ent, _, _ = reference.combine_stats(torch.stack([m, s, sd, zt], -1), None)
    ref_logp, ref_ent, _, _ = reference.combine_stats(full, None)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)


def test_neg_inf_logits_have_zero_probability():
    logits = torch.randn(3, 10)
    logits[:, 7:] = float("-inf")
    target = torch.tensor([0, 3, 6])
    logp, ent = ops.logprob_entropy(logits, target)
    ref_logp, ref_ent = _oracle(logits[:, :7], target, 1.0)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert _rel(logp, ref_logp) <= 1e-6 and _rel(ent, ref_ent) <= 1e-6


def test_compile_and_options():
    logits = torch.randn(4, 50, requires_grad=True)
    target = torch.randint(0, 50, (4,))
    logp, ent = ops.logprob_entropy(logits, target, compute_entropy=False)
    assert ent is None
    compiled = torch.compile(lambda x: ops.logprob_entropy(x, target)[0].sum(), fullgraph=True, backend="eager")
    out = compiled(logits)
    out.backward()
    torch.testing.assert_close(out, logp.sum())
    with pytest.raises(ValueError, match="temperature"):
        ops.logprob_entropy(logits, target, temperature=0.0)
    with pytest.raises(ValueError, match="target has shape"):
        ops.logprob_entropy(logits, target[:3])


def _tp2_body(rank, world_size, seed):
    import torch.distributed as dist

    from verl_mcore import ops as rank_ops

    g = torch.Generator().manual_seed(seed)
    tokens, vocab, split = 37, 1001, 500  # uneven shards: vocab not a multiple of anything
    full = torch.randn(tokens, vocab, generator=g) * 4
    target = torch.randint(0, vocab, (tokens,), generator=g)
    w_logp, w_ent = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    lo, hi = (0, split) if rank == 0 else (split, vocab)
    shard = full[:, lo:hi].clone().requires_grad_(True)
    logp, ent = rank_ops.logprob_entropy(shard, target, tp_group=dist.group.WORLD, temperature=0.7, vocab_start=lo)
    (w_logp * logp + w_ent * ent).sum().backward()
    return {"logp": logp.detach(), "ent": ent.detach(), "grad": shard.grad, "lo": lo, "hi": hi}


@pytest.mark.distributed
def test_tp2_matches_float64_full_vocab():
    seed = 1234
    results = run_on_ranks(_tp2_body, world_size=2, args=(seed,), timeout=120)
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(37, 1001, generator=g) * 4
    target = torch.randint(0, 1001, (37,), generator=g)
    w_logp, w_ent = torch.randn(37, generator=g), torch.randn(37, generator=g)
    ref_logp, ref_ent, ref_grad = _oracle_grads(full, target, 0.7, w_logp, w_ent)
    for res in results:
        assert _rel(res["logp"], ref_logp) <= 1e-6
        assert _rel(res["ent"], ref_ent) <= 1e-6
        assert _rel(res["grad"], ref_grad[:, res["lo"]:res["hi"]]) <= 1e-6
