"""Token sampling: greedy, temperature, top-k, top-p against the exact distributions."""
import numpy as np
import pytest
import torch

from verl_mcore.rollout import sampling
from verl_mcore.rollout.base import SamplingParams


def _draws(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """n samples from one row, one uniform each (row repeated n times)."""
    keys = sampling.sequence_keys(5, np.zeros(n, dtype=np.int64), np.arange(n))
    u = torch.from_numpy(sampling.uniforms(keys, np.zeros(n, dtype=np.int64)))
    return sampling.sample(logits_row.expand(n, -1), u=u, **kw)


def test_uniforms_deterministic_and_uniform():
    keys = sampling.sequence_keys(3, np.repeat(np.arange(100), 4), np.tile(np.arange(4), 100))
    assert len(set(keys.tolist())) == 400  # every (prompt, sample) has its own stream
    u = sampling.uniforms(keys, np.full(400, 7))
    assert np.array_equal(u, sampling.uniforms(keys, np.full(400, 7)))
    assert not np.array_equal(u, sampling.uniforms(keys, np.full(400, 8)))
    assert not np.array_equal(keys, sampling.sequence_keys(4, np.repeat(np.arange(100), 4),
                                                           np.tile(np.arange(4), 100)))
    assert u.min() >= 0.0 and u.max() < 1.0
    many = sampling.uniforms(keys, np.arange(400))
    assert abs(many.mean() - 0.5) < 0.05 and np.histogram(many, bins=4, range=(0, 1))[0].min() > 70


def test_greedy_and_logprobs():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens = sampling.sample(logits, 0.0, 1.0, -1, None)
    assert torch.equal(tokens, logits.argmax(-1))
    lp = sampling.token_logprobs(logits, tokens, 0.0)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])
    lp_t = sampling.token_logprobs(logits, tokens, 0.5)
    assert torch.allclose(lp_t, torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 3, 1.0), (1.3, -1, 0.6),
                                                       (1.0, 4, 0.8)])
def test_sampled_frequencies_match_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 20000
    tokens = _draws(logits, n, temperature=temperature, top_p=top_p, top_k=top_k)
    probs = torch.softmax(logits / temperature, -1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False  # logits are sorted descending
    before = torch.cumsum(probs, 0) - probs
    keep &= before < top_p
    expected = torch.where(keep, probs, 0.0)
    expected /= expected.sum()
    freq = torch.bincount(tokens, minlength=len(logits)).double() / n
    assert (freq[~keep] == 0).all()
    assert torch.allclose(freq, expected.double(), atol=0.015), (freq, expected)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(stop_token_ids=[np.int64(3)]).stop_token_ids == (3,)


def test_blocked_inverse_cdf_equals_flat_and_never_picks_zero_mass():
    """The two-level inversion (block, then entry) draws what one flat cumsum draws, up to float
    rounding at boundaries, and never a zero-probability token (also in the padded last block)."""
    from verl_mcore.rollout.sampling import _invert_cdf, _invert_cdf_blocked

    g = torch.Generator().manual_seed(0)
    vocab = 1000  # 4 blocks, the last one padded
    probs = torch.rand(64, vocab, generator=g) ** 8
    probs[:, 100:400] = 0.0  # whole zero blocks
    probs[:, -3:] = 0.0      # zero mass at the very end
    probs[0] = 0.0
    probs[0, 999 - 3] = 1.0  # one token only
    probs = probs / probs.sum(-1, keepdim=True)
    same = total = 0
    for _ in range(50):
        u = torch.rand(64, generator=g, dtype=torch.float64)
        blocked = _invert_cdf_blocked(probs, u)
        flat = _invert_cdf(probs.cumsum(-1), u)
        assert (probs.gather(-1, blocked.unsqueeze(-1)) > 0).all()
        same += int((blocked == flat).sum())
        total += 64
    assert same / total > 0.999
    edge = _invert_cdf_blocked(probs[:2], torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert (probs[:2].gather(-1, edge.unsqueeze(-1)) > 0).all()


def _bit_patterns(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Keys [m] uint64 and steps [m] int64: random ones, then every pairing of edge values
    (0, 1, 2^63 - 1, 2^63, 2^64 - 1 as keys; up to 2^63 - 1 and the bits of -1 as steps)."""
    edge_keys = np.array([0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15], dtype=np.uint64)
    edge_steps = np.array([0, 1, 2**31, 2**32 + 1, 2**62, 2**63 - 1, -1], dtype=np.int64)
    keys = np.concatenate([rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False),
                           sampling.sequence_keys(9, np.arange(n), np.zeros(n, dtype=np.int64)),
                           np.repeat(edge_keys, len(edge_steps))])
    steps = np.concatenate([rng.integers(0, 2**63, n, dtype=np.int64, endpoint=False),
                            np.arange(n), np.tile(edge_steps, len(edge_keys))])
    return keys, steps


def _assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float64 and got.shape == want.shape
    same = got.cpu().numpy().view(np.int64) == want.view(np.int64)
    assert same.all(), f"{int((~same).sum())} of {len(want)} differ, first at {np.argmin(same)}"


def test_uniforms_device_bit_identical_to_numpy():
    keys, steps = _bit_patterns(20000, np.random.default_rng(0))
    got = sampling.uniforms_device(sampling.keys_to_tensor(keys), torch.from_numpy(steps))
    _assert_bits_equal(got, sampling.uniforms(keys, steps))


def test_uniforms_device_is_shape_only():
    """Pure tensor ops with no data-dependent host reads: it runs on meta tensors (which have no
    data), as a captured CUDA graph needs."""
    keys = torch.empty(37, dtype=torch.int64, device="meta")
    u = sampling.uniforms_device(keys, torch.empty(37, dtype=torch.int64, device="meta"))
    assert u.device.type == "meta" and u.dtype == torch.float64 and u.shape == (37,)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["uniforms_device", "uniforms_torch"])  # the kernel, the torch ops
def test_uniforms_device_on_cuda_and_in_a_cuda_graph(fn):
    uniforms_device = getattr(sampling, fn)
    keys, steps = _bit_patterns(4096, np.random.default_rng(1))
    want = sampling.uniforms(keys, steps)
    k, s = sampling.keys_to_tensor(keys, "cuda"), torch.from_numpy(steps).cuda()
    torch.cuda.set_sync_debug_mode("error")  # a host sync inside raises
    try:
        u = uniforms_device(k, s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_bits_equal(u, want)
    # Captured on other inputs, replayed on these.
    static_k, static_s = torch.zeros_like(k), torch.zeros_like(s)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        uniforms_device(static_k, static_s)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = uniforms_device(static_k, static_s)
    static_k.copy_(k)
    static_s.copy_(s)
    graph.replay()
    _assert_bits_equal(out, want)


# ------------------------------------------------------------------------------------------------
# csrc/sampling.cu (sample_with_logprobs on a GPU)
# ------------------------------------------------------------------------------------------------

def _fused(logits, temperature, u, top_p=1.0, top_k=-1):
    from verl_mcore.ops._extension import extension

    assert extension() is not None and hasattr(extension(), "sample")
    return sampling.sample_with_logprobs(logits, temperature, top_p, top_k, u, logprobs=True)


def _in_cdf_interval(logits: torch.Tensor, temperature: float, u: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per row: token t has mass and u lies in its float64 CDF interval [cdf[t-1], cdf[t]] up to
    float32 rounding of the sums (what any correct inverse-CDF draw satisfies)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    cdf = p.cumsum(-1)
    hi = cdf.gather(1, tokens.view(-1, 1)).squeeze(1)
    lo = hi - p.gather(1, tokens.view(-1, 1)).squeeze(1)
    tol = 2e-5
    return (p.gather(1, tokens.view(-1, 1)).squeeze(1) > 0) & (lo - tol <= u) & (u <= hi + tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab,width,offset", [(151936, 151936, 0), (151665, 151936, 0), (1000, 1003, 0),
                                                (7, 8, 0), (4000, 4096, 1)])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6, 1e-3])
def test_fused_sampler_matches_torch(dtype, vocab, width, offset, temperature):
    """Against `sample` + `token_logprobs` on a column slice of padded logits (the engine's view;
    offset 1: a misaligned start with an aligned stride, the one-element loads): greedy tokens
    exactly (ties included: bf16 logits repeat); every sampled token inside its float64 CDF interval
    (the kernel sums in another order than torch, so a draw at a boundary may take the neighbour,
    ~1% of rows at a 150k vocabulary) and nearly all equal to torch's; log-probs to float rounding.
    The padding columns hold huge logits that must not be read."""
    g = torch.Generator(device="cuda").manual_seed(vocab + int(temperature * 10))
    rows = 257
    padded = (3 * torch.randn(rows, width + offset, device="cuda", generator=g)).to(dtype)
    padded[:, offset + vocab:] = 1e4
    logits = padded[:, offset:offset + vocab]
    u = torch.rand(rows, device="cuda", generator=g, dtype=torch.float64)
    u[:3] = torch.tensor([0.0, 1.0 - 2 ** -53, 0.5])
    tokens, logp = _fused(logits, temperature, u)
    want = sampling.sample(logits, temperature, 1.0, -1, u)
    want_logp = sampling.token_logprobs(logits, want, temperature)
    assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
    assert int(tokens.min()) >= 0 and int(tokens.max()) < vocab
    same = tokens == want
    if temperature == 0.0:
        assert bool(same.all())
    else:
        assert bool(_in_cdf_interval(logits, temperature, u, tokens).all())
        assert int((~same).sum()) <= max(3, rows // 25), (tokens[~same], want[~same])
    assert torch.allclose(logp[same], want_logp[same], atol=2e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_sampler_degenerate_rows_and_extreme_draws(temperature):
    """Rows torch's sampler cannot draw from (all -inf, a +inf logit, a NaN) give their argmax,
    never an index outside the vocabulary; a dominant logit wins at u -> 1 (no tail token of
    vanishing mass from a rounding fallback); a -inf logit at every lane's first entry (the lane
    boundaries of the in-block scan) is never drawn."""
    vocab = 3000
    rows = torch.randn(6, vocab, device="cuda")
    rows[0] = float("-inf")
    rows[1, 5] = float("inf")
    rows[2, 7] = float("nan")
    rows[3:5, 1000] = 80.0  # all the mass but exp(-80)-sized crumbs on the other entries
    rows[5, ::8] = float("-inf")
    u = torch.tensor([0.3, 0.3, 0.3, 1 - 2 ** -26, 1 - 2 ** -53, 0.77], device="cuda", dtype=torch.float64)
    tokens, _ = _fused(rows, temperature, u)
    assert tokens[:3].tolist() == [0, 5, 7]  # torch's argmax: the first max, the inf, the NaN
    assert tokens[3:5].tolist() == [1000, 1000]
    # sweep the masked row over many uniforms: never a -inf entry
    n = 4096
    masked = rows[5].expand(n, -1)
    uu = torch.linspace(0, 1 - 2 ** -53, n, device="cuda", dtype=torch.float64)
    picks, logp = _fused(masked, temperature or 1.0, uu)
    assert bool(torch.isfinite(rows[5][picks]).all()) and bool(torch.isfinite(logp).all())
    # A 151,936 vocabulary with mass in every other warp lane's chunk of block sums (19 blocks of
    # 256) only: the lanes' scanned sums can round past the target in an empty chunk.
    wide = torch.full((151936,), float("-inf"), device="cuda")
    for c in range(0, 32, 2):
        wide[c * 19 * 256 + 77] = 0.1 * c
    picks, logp = _fused(wide.expand(n, -1), temperature or 1.0, uu)
    assert int(picks.min()) >= 0 and bool(torch.isfinite(wide[picks]).all())


@pytest.mark.gpu
def test_fused_sampler_refuses_what_it_cannot_read():
    from verl_mcore.ops._extension import extension

    ext, stream = extension(), torch.cuda.current_stream().cuda_stream
    x = torch.randn(4, 100, device="cuda")
    u = torch.rand(4, device="cuda", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="unit column stride"):
        ext.sample(x.t(), 4, 1.0, u[:4].clone(), stream)
    with pytest.raises(RuntimeError, match="u must be contiguous float64"):
        ext.sample(x, 100, 1.0, u.float(), stream)
    with pytest.raises(RuntimeError, match="u is required"):
        ext.sample(x, 100, 1.0, None, stream)
    # float64 logits: the torch sampler
    tokens, _ = sampling.sample_with_logprobs(x.double(), 1.0, 1.0, -1, u, logprobs=True)
    assert torch.equal(tokens, sampling.sample(x.double(), 1.0, 1.0, -1, u))


@pytest.mark.gpu
def test_fused_sampler_frequencies_and_graph_replay():
    """20,000 draws from one row (vocab 600: blocks of 256 and a partial one, mass in each) match
    softmax(logits / T); the kernel captured in a CUDA graph replays new uniforms."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(600, device="cuda", generator=g).to(torch.bfloat16)
    logits[[3, 300, 599]] = 4.0
    n, temperature = 20000, 0.8
    keys = sampling.sequence_keys(9, np.zeros(n, dtype=np.int64), np.arange(n))
    u = torch.from_numpy(sampling.uniforms(keys, np.zeros(n, dtype=np.int64))).cuda()
    rows = logits.expand(n, -1)
    tokens, _ = _fused(rows, temperature, u)
    probs = torch.softmax(logits.float() / temperature, -1).double()
    freq = torch.bincount(tokens, minlength=600).double() / n
    assert (freq - probs).abs().max() < 0.01, (freq - probs).abs().max()
    # chi-square over the tokens expected >= 5 times each
    big = probs * n >= 5
    chi2 = float((((freq - probs) * n) ** 2 / (probs * n))[big].sum())
    assert chi2 < int(big.sum()) + 6 * int(big.sum()) ** 0.5, chi2
    static_u = torch.zeros_like(u)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _fused(rows, temperature, static_u)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = _fused(rows, temperature, static_u)
    static_u.copy_(u)
    graph.replay()
    assert torch.equal(out, tokens)


@pytest.mark.gpu
def test_fused_sampler_leaves_truncation_to_torch():
    """top-k / top-p go through `sample` (the kernel draws from the whole distribution)."""
    logits = torch.randn(64, 5000, device="cuda")
    u = torch.rand(64, device="cuda", dtype=torch.float64)
    for top_k, top_p in ((5, 1.0), (-1, 0.7)):
        tokens, logp = sampling.sample_with_logprobs(logits, 1.0, top_p, top_k, u, logprobs=True)
        assert torch.equal(tokens, sampling.sample(logits, 1.0, top_p, top_k, u))
        assert torch.equal(logp, sampling.token_logprobs(logits, tokens, 1.0))
