"""CUDA kernels (csrc/) against the torch reference, over many shapes; run on a GPU machine.

Every case draws fresh random inputs. Outputs are "poisoned": the allocation the kernel will write
into is first filled with NaN bytes (through the caching allocator: a same-size block freed just
before is handed back), so an element the kernel forgets to write shows up as NaN.
"""
import importlib
import random

import pytest
import torch

from verl_mcore import ops
from verl_mcore.algo import advantages as algo
from verl_mcore.ops import reference
from verl_mcore.ops._extension import extension, extension_status

# The module ops/gae.py (the package's `gae` is its function of that name).
gae_op_module = importlib.import_module("verl_mcore.ops.gae")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ext():
    mod = extension()
    assert mod is not None, (
        f"CUDA extension not loaded ({extension_status()}): build it with "
        "`python setup.py build_ext --inplace` or set VERL_MCORE_OPS=jit"
    )
    return mod


def _poison(*nbytes: int) -> list[int]:
    """Leave freed NaN-filled blocks of these sizes in the caching allocator; returns their addresses."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in nbytes]
    ptrs = [b.data_ptr() for b in blocks]
    del blocks
    return ptrs


def _assert_poisoned(out: torch.Tensor, ptrs: list[int]):
    assert out.data_ptr() in ptrs, "the allocator did not hand back a poisoned block; the check is void"
    assert not torch.isnan(out).any(), "the kernel left elements of its output unwritten"


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# GAE
# ------------------------------------------------------------------------------------------------

GAE_SHAPES = [(1, 1), (7, 1), (1, 5), (3, 127), (5, 128), (2, 129), (9, 511), (4, 2048), (3, 2051),
              (2, 4096), (3, 4097), (6, 8192), (2, 12290), (4, 32768), (1, 40001), (512, 16384), (1000, 61)]


@pytest.mark.parametrize("case", range(len(GAE_SHAPES)))
def test_gae_kernel_matches_reference(ext, case):
    batch, length = GAE_SHAPES[case]
    mask_kind = ["bool", "float", "int64"][case % 3]
    rng = random.Random(batch * 7919 + length)
    gamma, lam = rng.choice([(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
    rewards = torch.randn(batch, length, device="cuda")
    values = torch.randn(batch, length, device="cuda")
    valid = torch.rand(batch, length, device="cuda") > rng.choice([0.0, 0.3, 0.9])
    valid[rng.randrange(batch)] = False  # an all-masked row
    rewards[~valid] = float("nan")  # never read at masked positions
    values[~valid] = float("inf")
    mask = {"bool": valid, "float": valid.float(), "int64": valid.long()}[mask_kind]
    nbytes = batch * length * 4
    # Two output blocks, plus one for the bool mask that ops.gae makes of an int64 mask.
    ptrs = _poison(nbytes, nbytes, batch * length)
    adv, ret = ops.gae(rewards, values, mask, gamma, lam)
    _assert_poisoned(adv, ptrs)
    _assert_poisoned(ret, ptrs)
    ref_adv, ref_ret = algo.gae(rewards.cpu().double(), values.cpu().double(), valid.cpu(), gamma, lam)
    for out, ref in ((adv, ref_adv), (ret, ref_ret)):
        scale = ref.abs().max().clamp_min(1.0)
        err = (out.cpu().double() - ref).abs().max() / scale
        assert err <= 2e-5, f"{tuple(out.shape)} gamma={gamma} lam={lam}: max error {err:.2e} of scale {scale:.1f}"


@pytest.mark.parametrize("config", range(7))
def test_gae_every_tile_shape(ext, config):
    """Each compiled tile shape (forced) on rows spanning many tiles, vector and scalar paths."""
    for length in (20000, 20001):
        rewards = torch.randn(3, length, device="cuda")
        values = torch.randn_like(rewards)
        mask = torch.rand_like(rewards) > 0.5
        adv, ret, _ = ext.gae(rewards, values, mask, 0.97, 0.9, torch.cuda.current_stream().cuda_stream, config)
        ref_adv, ref_ret = algo.gae(rewards.cpu().double(), values.cpu().double(), mask.cpu(), 0.97, 0.9)
        assert (adv.cpu().double() - ref_adv).abs().max() <= 2e-5 * ref_adv.abs().max().clamp_min(1)
        assert (ret.cpu().double() - ref_ret).abs().max() <= 2e-5 * ref_ret.abs().max().clamp_min(1)


@pytest.mark.parametrize("case", range(len(GAE_SHAPES)))
def test_gae_whitened_kernel_matches_reference(ext, case):
    batch, length = GAE_SHAPES[case]
    if batch * length < 8:
        pytest.skip("whitening needs at least 2 valid tokens")
    rewards = torch.randn(batch, length, device="cuda") + 0.5
    values = torch.randn(batch, length, device="cuda")
    valid = torch.rand(batch, length, device="cuda") > 0.3
    valid[0] = False
    valid.view(-1)[-2:] = True  # at least 2 valid tokens
    mask = valid.float() if case % 2 else valid
    adv, ret = ops.gae_whitened(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = algo.gae(rewards.cpu().double(), values.cpu().double(), valid.cpu(), 0.99, 0.95)
    ref_adv = algo.masked_whiten(ref_adv, valid.cpu())
    assert (adv.cpu().double() - ref_adv).abs().max() <= 1e-4
    assert (ret.cpu().double() - ref_ret).abs().max() <= 2e-5 * ref_ret.abs().max().clamp_min(1)
    assert (adv[~valid] == 0).all()


@pytest.mark.parametrize("valid_tokens", [0, 1])
def test_gae_whitened_refuses_fewer_than_two_valid_tokens(ext, valid_tokens):
    rewards = torch.randn(3, 4096, device="cuda")
    valid = torch.zeros(3, 4096, dtype=torch.bool, device="cuda")
    valid.view(-1)[:valid_tokens] = True
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        ops.gae_whitened(rewards, torch.randn_like(rewards), valid, 0.99, 0.95)


@pytest.mark.parametrize("whiten", [True, False])
def test_trainer_gae_runs_the_kernel_and_equals_the_cpu_loop(ext, whiten, monkeypatch):
    """compute_advantages("gae") as Learner.advantages calls it (float32 mask, CUDA tensors)
    takes the kernel, never the Python loop, and gives the loop's numbers."""
    def no_loop(*args, **kwargs):
        raise AssertionError("the trainer's GAE ran the Python loop on CUDA tensors")

    rewards = torch.randn(64, 700, device="cuda")
    values = torch.randn(64, 700, device="cuda")
    valid = torch.rand(64, 700, device="cuda") > 0.2
    mask = valid.float()
    # ops/gae.py's fallback to the reference loop (gae_reference.gae, which algo exports as gae)
    monkeypatch.setattr(gae_op_module, "_reference_gae", no_loop)
    adv, ret = algo.compute_advantages("gae", rewards, mask, values=values, gamma=0.99, lam=0.95,
                                       whiten=whiten)
    monkeypatch.undo()
    ref_adv, ref_ret = algo.gae(rewards.cpu().double(), values.cpu().double(), valid.cpu(), 0.99, 0.95)
    if whiten:
        ref_adv = algo.masked_whiten(ref_adv, valid.cpu())
    assert adv.device.type == "cuda" and adv.dtype == torch.float32
    assert (adv.cpu().double() - ref_adv).abs().max() <= 1e-4
    assert (ret.cpu().double() - ref_ret).abs().max() <= 2e-5 * ref_ret.abs().max().clamp_min(1)


def test_gae_kernel_is_deterministic_under_lookback(ext):
    """Many tiles per row racing through the look-back must give identical results every time."""
    rewards = torch.randn(256, 65536, device="cuda")
    values = torch.randn_like(rewards)
    mask = torch.rand_like(rewards) > 0.2
    first = ops.gae(rewards, values, mask, 0.999, 0.97)
    for _ in range(5):
        again = ops.gae(rewards, values, mask, 0.999, 0.97)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


# ------------------------------------------------------------------------------------------------
# log-prob + entropy
# ------------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LPE_SHAPES = [(1, 1), (3, 7), (2, 8), (5, 1000), (17, 4096), (9, 32003), (4, 151936), (64, 50304), (300, 257)]


def _lpe_inputs(tokens, vocab, dtype, rng):
    logits = (torch.randn(tokens, vocab, device="cuda") * rng.choice([1.0, 4.0])).to(dtype)
    vocab_start = rng.choice([0, 3 * vocab])
    # Targets anywhere in a range wider than the shard: some land in other shards.
    lo, hi = max(0, vocab_start - vocab // 2), vocab_start + vocab + vocab // 2 + 1
    target = torch.randint(lo, hi, (tokens,), device="cuda")
    return logits, target, vocab_start


@pytest.mark.parametrize("tokens,vocab", LPE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lpe_forward_stats_match_reference(ext, tokens, vocab, dtype):
    rng = random.Random(tokens * 31 + vocab)
    logits, target, vocab_start = _lpe_inputs(tokens, vocab, dtype, rng)
    inv_temp = rng.choice([1.0, 1 / 0.7])
    ptrs = _poison(tokens * 16)
    stats = ext.lpe_forward(logits, target, vocab_start, inv_temp, torch.cuda.current_stream().cuda_stream)
    _assert_poisoned(stats, ptrs)
    ref = reference.local_stats(logits.double(), target, vocab_start, inv_temp)
    assert _rel(stats[:, 0], ref[:, 0]) <= 1e-6  # max: exact up to the final scaling
    assert _rel(stats[:, 1], ref[:, 1]) <= 2e-6
    assert _rel(stats[:, 2], ref[:, 2]) <= 2e-6 if vocab > 1 else stats[:, 2].abs().max() == 0
    torch.testing.assert_close(stats[:, 3].double(), ref[:, 3], rtol=1e-6, atol=0)  # incl. exact zeros


@pytest.mark.parametrize("tokens,vocab", LPE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lpe_backward_matches_reference(ext, tokens, vocab, dtype):
    rng = random.Random(tokens * 17 + vocab)
    logits, target, vocab_start = _lpe_inputs(tokens, vocab, dtype, rng)
    inv_temp = rng.choice([1.0, 1 / 0.7])
    stats = reference.local_stats(logits.double(), target, vocab_start, inv_temp)
    _, _, logz, ez = reference.combine_stats(stats, None)
    g_logp, g_ent = torch.randn(tokens, device="cuda"), torch.randn(tokens, device="cuda")
    logz32, ez32 = logz.float(), ez.float()  # before poisoning: no allocation may come in between
    ptrs = _poison(logits.numel() * logits.element_size())
    grad = ext.lpe_backward(logits, target, vocab_start, inv_temp, logz32, ez32, g_logp, g_ent,
                            torch.cuda.current_stream().cuda_stream)
    _assert_poisoned(grad, ptrs)
    assert grad.dtype == dtype and grad.shape == logits.shape
    ref = reference.grad_logits(logits.double(), target, vocab_start, inv_temp, logz, ez, g_logp, g_ent)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    if vocab == 1:
        # One logit: p = exp(z - logZ) is 1 only up to the fp32 rounding of logZ and E[z] (inputs
        # the kernel gets in fp32), an ulp of |z|; the gradient (exactly 0 or -g_logp/T) then
        # carries |g| x that ulp of absolute error, which no relative bound on a 0 can hold.
        z = logits.double().abs().max().item() * inv_temp
        scale = (g_logp.abs() + g_ent.abs()).max().item() * inv_temp
        atol = 8 * torch.finfo(torch.float32).eps * (1 + z) * scale
        err = (grad.double() - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item() + atol, (err, atol)
    else:
        assert _rel(grad, ref) <= tol


def test_lpe_strided_rows(ext):
    """A [tokens, V] view with a longer row stride (a slice of a wider tensor)."""
    wide = torch.randn(33, 4096 + 64, device="cuda", dtype=torch.bfloat16)
    for vocab in (4096, 4091):
        logits = wide[:, :vocab]
        target = torch.randint(0, vocab, (33,), device="cuda")
        stats = ext.lpe_forward(logits, target, 0, 1.0, torch.cuda.current_stream().cuda_stream)
        ref = reference.local_stats(logits.double(), target, 0, 1.0)
        assert _rel(stats, ref) <= 2e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_op_end_to_end_with_autograd(ext, dtype):
    tokens, vocab = 129, 5003
    logits = (torch.randn(tokens, vocab, device="cuda") * 3).to(dtype).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    w_logp, w_ent = torch.randn(tokens, device="cuda"), torch.randn(tokens, device="cuda")
    logp, ent = ops.logprob_entropy(logits, target, temperature=0.8)
    (w_logp * logp + w_ent * ent).sum().backward()
    x = logits.detach().double().requires_grad_(True)
    lp_all = torch.log_softmax(x / 0.8, -1)
    ref_logp = lp_all.gather(1, target[:, None]).squeeze(1)
    ref_ent = -(lp_all.exp() * lp_all).sum(-1)
    (w_logp * ref_logp + w_ent * ref_ent).sum().backward()
    assert _rel(logp, ref_logp) <= 1e-6 and _rel(ent, ref_ent) <= 2e-6
    assert logits.grad.dtype == dtype
    assert _rel(logits.grad, x.grad) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_public_op_under_torch_compile(ext):
    logits = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 1000, (64,), device="cuda")
    fn = torch.compile(lambda x: sum(o.sum() for o in ops.logprob_entropy(x, target)), fullgraph=True)
    out = fn(logits)
    out.backward()
    expected = sum(o.sum() for o in ops.logprob_entropy(logits.detach(), target))
    torch.testing.assert_close(out, expected)
    assert torch.isfinite(logits.grad.float()).all()


def test_reward_to_go_estimators_take_the_kernel(ext):
    """REINFORCE++ / ReMax on CUDA: returns from the GAE kernel, equal to the CPU loop."""
    rewards = torch.randn(32, 3000, device="cuda")
    mask = (torch.rand(32, 3000, device="cuda") > 0.2).float()
    got = algo._returns_via_ops(rewards, mask, 0.99)
    ref = algo.discounted_returns(rewards.cpu().double(), mask.cpu(), 0.99)
    assert got.is_cuda
    assert (got.cpu().double() - ref).abs().max() <= 2e-5 * ref.abs().max().clamp_min(1)
