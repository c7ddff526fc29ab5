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
