"""The vocab-parallel sampler on 2 gloo ranks against `sampling.sample` on the gathered logits."""
import numpy as np
import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.rollout import sampling

ROWS = 256
# (real vocabulary, shard width): padding in the second shard, a padding-only second shard, odd
# sizes, and one large enough that the messages are much smaller than a row of logits.
LAYOUTS = [(250, 128), (300, 200), (100, 150), (1001, 501), (5003, 2502)]
# (temperature, top_p, top_k): greedy, the vocabulary-order CDF, top-k (also wider than a shard),
# top-p alone (also one that keeps the first token only), both.
SETTINGS = [(0.0, 1.0, -1), (1.0, 1.0, -1), (0.7, 1.0, -1), (1.0, 1.0, 40), (0.7, 1.0, 180),
            (1.0, 0.9, -1), (1.3, 0.95, -1), (0.7, 0.01, -1), (1.0, 0.8, 20), (0.9, 0.95, 300)]


def _case(layout: int, setting: int):
    """Padded logits [ROWS, 2 * width] and uniforms [ROWS], the same on every rank."""
    vocab, width = LAYOUTS[layout]
    g = torch.Generator().manual_seed(1000 * layout + setting)
    logits = torch.randn(ROWS, 2 * width, generator=g) * 2.0
    logits[: ROWS // 4] *= 4.0  # peaked rows: a few tokens hold nearly all the mass
    logits[:, vocab:] = 50.0  # padding ids would win everything if they were counted
    if setting == 0:
        # Greedy ties: the maximum in both shards (or twice in one) goes to the lowest id.
        logits[:8, [3, width + 1]] = 60.0
        logits[8:16, [width - 2, 5]] = 60.0
    keys = sampling.sequence_keys(setting, np.arange(ROWS), np.zeros(ROWS, dtype=np.int64))
    u = torch.from_numpy(sampling.uniforms(keys, np.full(ROWS, layout)))
    return logits, u


def _sampler_body(rank, world_size):
    import torch.distributed as dist

    from verl_mcore.rollout.tp_sampling import sample_vocab_parallel

    sizes = []  # numbers each collective moves per rank
    gather, reduce = dist.all_gather, dist.all_reduce

    def counted_gather(parts, x, **kw):
        sizes.append(x.numel())
        return gather(parts, x, **kw)

    def counted_reduce(x, **kw):
        sizes.append(x.numel())
        return reduce(x, **kw)

    dist.all_gather, dist.all_reduce = counted_gather, counted_reduce
    out = {}
    try:
        for li, (vocab, width) in enumerate(LAYOUTS):
            for si, (t, p, k) in enumerate(SETTINGS):
                logits, u = _case(li, si)
                shard = logits[:, rank * width: (rank + 1) * width]
                sizes.clear()
                tokens, logp = sample_vocab_parallel(shard, t, p, k, None if t == 0.0 else u,
                                                     vocab_size=vocab, group=dist.group.WORLD,
                                                     logprobs=True)
                out[li, si] = (tokens, logp, list(sizes))
    finally:
        dist.all_gather, dist.all_reduce = gather, reduce
    return out


@pytest.mark.distributed
def test_vocab_parallel_sampler_matches_sample_on_gathered_logits():
    results = run_on_ranks(_sampler_body, 2, timeout=240)
    for li, (vocab, width) in enumerate(LAYOUTS):
        for si, (t, p, k) in enumerate(SETTINGS):
            logits, u = _case(li, si)
            full = logits[:, :vocab]
            ref = sampling.sample(full, t, p, k, u)
            ref_logp = sampling.token_logprobs(full, ref, t)
            tokens, logp, sizes = results[0][li, si]
            where = (vocab, width, t, p, k)
            assert torch.equal(tokens, ref), (where, (tokens != ref).nonzero()[:5])
            # Within 1e-6 of the float64 log-softmax of the same (float32) scaled logits;
            # `token_logprobs` computes in float32 and is itself up to ~2e-6 off that.
            scaled = (full.float() / (t or 1.0)).double()
            exact = torch.log_softmax(scaled, -1).gather(-1, ref[:, None])[:, 0]
            assert (logp.double() - exact).abs().max().item() < 1e-6, where
            assert (logp - ref_logp).abs().max().item() < 3e-6, where
            other = results[1][li, si]
            assert torch.equal(other[0], tokens) and torch.equal(other[1], logp), where
            # The cost the module docstring states: the stats all-gather, then one all-reduce
            # (no truncation), one all-gather (top-k) or two searches of 8 key bits per round
            # (top-p alone); never a row of logits: at most 256 cut masses, k keys or 3 stats.
            searches = 2 * -(-(32 + max(1, (vocab - 1).bit_length())) // 8)
            calls = 1 if t == 0.0 else 2 if (0 < k < vocab or p >= 1.0) else 1 + searches
            assert len(sizes) == calls, (where, sizes)
            assert max(sizes) <= ROWS * max(256, 3, min(max(k, 0), width)), (where, sizes)
            if li == len(LAYOUTS) - 1:
                assert max(sizes) < ROWS * width / 8, (where, sizes)
            if t > 0.0 and p > 0.01 and vocab > width:  # draws from both shards
                assert (tokens < width).any() and (tokens >= width).any(), where
    # Greedy ties went to the lowest id, as torch.argmax on the gathered row.
    greedy = results[0][0, 0][0]
    assert (greedy[:8] == 3).all() and (greedy[8:16] == 5).all()
