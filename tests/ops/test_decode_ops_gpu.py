"""The native engine's fused decode ops (csrc/decode.cu, flash attention over the KV cache) against
their torch references (verl_mcore/ops/decode.py), and torch's flash kernel over a paged KV cache;
run on a GPU machine."""
import pytest
import torch

from verl_mcore.ops import decode
from verl_mcore.ops._extension import extension, extension_status

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def ext():
    assert extension() is not None, f"CUDA extension not loaded ({extension_status()})"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the larger value's bf16/fp16 spacing."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp(min=1e-3)
    return ((a.float() - b.float()).abs() / (scale * eps)).max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 1536), (128, 2048), (300, 5120)])
def test_rmsnorm_matches_reference(dtype, rows, hidden):
    g = torch.Generator(device="cuda").manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    d = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    # The sum of squares is reduced in another order: rstd differs in its last bits, which moves a
    # bf16/fp16 result by at most an ulp or two, and an fp32 one by a few dozen of its (tiny) ulps.
    tol = 256 if dtype == torch.float32 else 2
    got, want = decode.rmsnorm(x.clone(), None, w, 1e-6), decode.rmsnorm_reference(x.clone(), None, w, 1e-6)
    assert _ulps(got, want) <= tol
    # with residual += delta (in place, exactly torch's rounded add)
    hk, hr = x.clone(), x.clone()
    got, want = decode.rmsnorm(hk, d, w, 1e-6), decode.rmsnorm_reference(hr, d, w, 1e-6)
    assert torch.equal(hk, hr)
    assert _ulps(got, want) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8), (128, 8960), (3, 5, 7), (2, 1, 4104), (0, 16), (2049, 8193)])
def test_swiglu_matches_reference(dtype, shape):
    """Vector (f % 8 == 0) and scalar (f = 7) paths, a misaligned view (scalar), no rows, more
    outputs than the grid's 65535 x 256 threads (the grid-stride loop)."""
    *lead, f = shape
    g = torch.Generator(device="cuda").manual_seed(f)
    x = (3 * torch.randn(*lead, 2 * f, device="cuda", generator=g)).to(dtype)
    got, want = decode.swiglu(x), decode.swiglu_reference(x)
    assert got.shape == want.shape == (*lead, f) and got.dtype == dtype
    # fast-math exp and division against torch's: at most an ulp of silu, then one product rounding
    assert got.numel() == 0 or _ulps(got, want) <= (64 if dtype == torch.float32 else 2)
    if x.numel():
        flat = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:].view(x.shape)
        flat.copy_(x)  # starts 2 bytes past an allocation: the one-element path
        assert torch.equal(decode.swiglu(flat), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,groups,r,hd", [(1, 1, 1, 64), (5, 2, 6, 128), (128, 4, 7, 128), (33, 8, 1, 256)])
def test_rope_cache_matches_reference(dtype, tokens, groups, r, hd):
    g = torch.Generator(device="cuda").manual_seed(tokens + groups)
    qkv = torch.randn(tokens, groups * (r + 2) * hd, device="cuda", generator=g).to(dtype)
    angles = torch.rand(512, hd // 2, device="cuda", generator=g) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, 512, (tokens,), device="cuda", generator=g)
    rows = torch.randperm(4 * tokens, device="cuda", generator=g)[:tokens]  # distinct rows, any order
    caches = [torch.randn(4 * tokens, groups, hd, device="cuda", generator=g).to(dtype) for _ in range(2)]
    kk, vk = (c.clone() for c in caches)
    kr, vr = (c.clone() for c in caches)
    q_kernel = decode.rope_cache(qkv, cos, sin, positions, rows, kk, vk, groups, r, hd)
    q_ref = decode.rope_cache_reference(qkv, cos, sin, positions, rows, kr, vr, groups, r, hd)
    assert torch.equal(q_kernel, q_ref)
    assert torch.equal(kk, kr) and torch.equal(vk, vr)  # written where the reference writes, nothing else


@pytest.mark.parametrize("b,heads,groups,hd,width", [(3, 12, 2, 128, 2), (128, 16, 2, 128, 8),
                                                      (9, 4, 4, 64, 3)])
def test_paged_attention_reads_each_sequences_own_blocks(b, heads, groups, hd, width):
    why = decode.paged_flash_supported(torch.device("cuda"))
    if why is not None:
        pytest.skip(f"torch's flash kernel reads no paged cache here ({why})")
    block = 256
    g = torch.Generator(device="cuda").manual_seed(b)
    q = torch.randn(b, heads, hd, device="cuda", generator=g).to(torch.bfloat16)
    kc, vc = (torch.randn(b * width + 1, block, groups, hd, device="cuda", generator=g).to(torch.bfloat16)
              for _ in range(2))
    table = (torch.randperm(b * width, device="cuda", generator=g) + 1).view(b, width).to(torch.int32)
    lens = torch.randint(1, width * block + 1, (b,), device="cuda", generator=g).to(torch.int32)
    lens[0] = 1
    got = decode.paged_attention(q, kc, vc, table, lens, hd ** -0.5, flash="paged")
    want = decode.paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5)
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    # keys past a sequence's length, and blocks it does not hold, must not matter
    kc[0], vc[0] = 1e4, 1e4  # block 0 is in no table
    lens.clamp_(max=width * block - 1)
    last = table.gather(1, torch.full((b, 1), width - 1, device="cuda", dtype=torch.long)).long().squeeze(1)
    kc[last, -1], vc[last, -1] = 1e4, 1e4
    again = decode.paged_attention(q, kc, vc, table, lens, hd ** -0.5, flash="paged")
    want = decode.paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5)
    assert (again.float() - want.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("b,heads,groups,hd,block", [(3, 12, 2, 128, 256), (128, 16, 2, 128, 1024),
                                                      (9, 4, 4, 64, 768)])
def test_sequence_blocks_attention_reads_each_sequences_own_keys(b, heads, groups, hd, block):
    """flash="sequence" (torch without a paged flash kernel): one block a sequence, out of order."""
    assert decode.sequence_flash_supported(torch.device("cuda"), heads, groups, hd) is None
    g = torch.Generator(device="cuda").manual_seed(b)
    q = torch.randn(b, heads, hd, device="cuda", generator=g).to(torch.bfloat16)
    kc, vc = (torch.randn(b + 1, block, groups, hd, device="cuda", generator=g).to(torch.bfloat16)
              for _ in range(2))
    table = (torch.randperm(b, device="cuda", generator=g) + 1).view(b, 1).to(torch.int32)
    lens = torch.randint(1, block, (b,), device="cuda", generator=g).to(torch.int32)
    lens[0] = 1
    got = decode.paged_attention(q, kc, vc, table, lens, hd ** -0.5, flash="sequence")
    want = decode.paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5)
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    kc[0], vc[0] = 1e4, 1e4  # the scratch block, in no row
    kc[table.long().squeeze(1), -1], vc[table.long().squeeze(1), -1] = 1e4, 1e4  # past every length
    again = decode.paged_attention(q, kc, vc, table, lens, hd ** -0.5, flash="sequence")
    assert (again.float() - want.float()).abs().max().item() < 2e-2


# ------------------------------------------------------------------------------------------------
# csrc/paged_attention.cu (flash="kernel")
# ------------------------------------------------------------------------------------------------

def _reference(q, kc, vc, table, lens, scale):
    """paged_attention_reference in true fp32 (no TF32 matmuls, whatever an earlier test set)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return decode.paged_attention_reference(q, kc, vc, table, lens, scale)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Both round an fp32 result (summed in another order) to bf16/fp16: at most one unit of the
    output's last place apart, plus a little for the fp32 sums themselves."""
    g, w = got.float(), want.float()
    bound = torch.finfo(got.dtype).eps * torch.maximum(g.abs(), w.abs()) + 1e-4
    return bool(((g - w).abs() <= bound).all().item()) and not torch.isnan(g).any().item()


def _kernel(q, kc, vc, table, lens, scale, splits):
    return extension().paged_attention(q, kc, vc, table, lens, scale, splits,
                                       torch.cuda.current_stream().cuda_stream)


def _paged_case(b, heads, groups, hd, block, width, dtype, seed):
    """q, caches with one scratch block (0, in no table) and every sequence's `width` own blocks
    out of order, and lengths 1, block - 1, block, block + 1, width * block, then random."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, heads, hd, device="cuda", generator=g).to(dtype)
    kc, vc = (torch.randn(b * width + 1, block, groups, hd, device="cuda", generator=g).to(dtype)
              for _ in range(2))
    table = (torch.randperm(b * width, device="cuda", generator=g) + 1).view(b, width).to(torch.int32)
    lens = torch.randint(1, width * block + 1, (b,), device="cuda", generator=g).to(torch.int32)
    special = [n for n in (1, block - 1, block, block + 1, width * block) if 1 <= n <= width * block]
    lens[: len(special)] = torch.tensor(special[:b], dtype=torch.int32)
    return q, kc, vc, table, lens


def _poison_unread(kc, vc, table, lens):
    """1e4 in the scratch block and in every row of a sequence's blocks at or past its length."""
    b, width = table.shape
    block = kc.shape[1]
    kc[0], vc[0] = 1e4, 1e4
    pos = torch.arange(width * block, device="cuda")
    past = pos.view(1, -1) >= lens.view(-1, 1).long()  # [b, width * block]
    blocks = table.long().repeat_interleave(block, dim=1)[past]
    rows = pos.remainder(block).expand(b, -1)[past]
    kc[blocks, rows], vc[blocks, rows] = 1e4, 1e4


# (b, heads, groups, hd, block, width): r = heads / groups is 1, 6, 7, 12 (two CTAs a group: 8 + 4
# heads), 16; hd 64, 128, 256 and 96 (lanes idle in a row), 8; blocks of 16, 256 and 3 (no shift).
KERNEL_SHAPES = [(5, 2, 2, 64, 16, 4), (6, 12, 2, 128, 16, 8), (5, 28, 4, 128, 256, 2),
                 (5, 14, 2, 256, 16, 3), (7, 8, 8, 64, 256, 3), (5, 24, 2, 96, 16, 5),
                 (5, 16, 1, 256, 256, 2), (6, 4, 4, 8, 3, 7), (9, 7, 1, 128, 16, 40)]


@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_paged_kernel_matches_reference(shape, dtype, splits):
    b, heads, groups, hd, block, width = shape
    q, kc, vc, table, lens = _paged_case(*shape, dtype, seed=b * heads + hd)
    scale = hd ** -0.5
    got = _kernel(q, kc, vc, table, lens, scale, splits)
    assert got.shape == q.shape and got.dtype == dtype
    assert _within_rounding(got, _reference(q, kc, vc, table, lens, scale))
    # Rows past a sequence's length and blocks in no table are never read: the same bits again.
    _poison_unread(kc, vc, table, lens)
    assert torch.equal(_kernel(q, kc, vc, table, lens, scale, splits), got)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("hd,block,r", [(128, 16, 7), (64, 256, 1), (256, 16, 6)])
def test_paged_kernel_reads_every_key(hd, block, r, splits):
    """Sequence i holds one key that outscores the others by far (at position i, or its last):
    the output is that key's value, so a row read from the wrong place, or not at all, shows."""
    width, groups = 3, 2
    n = width * block
    b = min(n, 64)
    hot = torch.linspace(0, n - 1, b, device="cuda").round().long()  # spans every block, both ends
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(hd + block)
    q = torch.randn(b, groups * r, hd, device="cuda", generator=g)
    kc = 0.1 * torch.randn(b * width + 1, block, groups, hd, device="cuda", generator=g)
    vc = torch.randn(b * width + 1, block, groups, hd, device="cuda", generator=g)
    table = (torch.randperm(b * width, device="cuda", generator=g) + 1).view(b, width).to(torch.int32)
    # The hot key points along the mean of its group's query heads: a large score for each head.
    direction = q.view(b, groups, r, hd).mean(2)
    direction = direction / direction.norm(dim=-1, keepdim=True) * 16 * hd ** 0.5
    blocks = table.long().gather(1, (hot // block).view(-1, 1)).squeeze(1)
    kc[blocks, hot % block] = direction
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    hot_v = vc[blocks, hot % block].repeat_interleave(r, dim=1).float()  # [b, heads, hd]
    for lens in (torch.full((b,), n, device="cuda"), hot + 1):  # the whole table; ending at the hot key
        lens = lens.to(torch.int32)
        got = _kernel(q, kc, vc, table, lens, hd ** -0.5, splits)
        want = _reference(q, kc, vc, table, lens, hd ** -0.5)
        assert (want.float() - hot_v).abs().max().item() < 0.05  # the case is what it claims
        assert _within_rounding(got, want)


def test_paged_kernel_splits_skip_empty_shares():
    """More splits than keys: all but the first share of a 1-key sequence are empty, and their
    workspace (left unwritten, here likely NaN from the allocator's recycled poison) is skipped."""
    b, heads, groups, hd, block, width, splits = 4, 12, 2, 128, 16, 2, 64
    q, kc, vc, table, lens = _paged_case(b, heads, groups, hd, block, width, torch.bfloat16, seed=3)
    lens[:] = torch.tensor([1, 2, 17, 32], dtype=torch.int32)
    workspace = [b * heads * splits * hd * 4, b * heads * splits * 2 * 4, q.numel() * 2]
    nan = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in workspace]
    del nan
    got = _kernel(q, kc, vc, table, lens, hd ** -0.5, splits)
    assert _within_rounding(got, _reference(q, kc, vc, table, lens, hd ** -0.5))


def test_paged_kernel_in_a_cuda_graph_replays_new_lengths_and_tables():
    """One capture (the dispatch's split count, and 7 splits), replayed after seq_lens and the
    block table change in place: a graph serves every mix of lengths."""
    b, heads, groups, hd, block, width = 6, 12, 2, 128, 256, 4
    q, kc, vc, table, lens = _paged_case(b, heads, groups, hd, block, width, torch.bfloat16, seed=11)
    scale = hd ** -0.5

    def both():
        return (decode.paged_attention(q, kc, vc, table, lens, scale, flash="kernel"),
                _kernel(q, kc, vc, table, lens, scale, 7))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        both()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = both()
    g = torch.Generator(device="cuda").manual_seed(0)
    for step in range(4):
        if step == 1:
            lens.copy_(torch.tensor([1, 255, 256, 257, 1024, 2], dtype=torch.int32))
        elif step == 2:
            lens.copy_(torch.randint(1, width * block + 1, (b,), device="cuda", generator=g))
        elif step == 3:
            table.copy_(table.view(-1)[torch.randperm(b * width, device="cuda", generator=g)].view(b, width))
        graph.replay()
        want = _reference(q, kc, vc, table, lens, scale)
        assert all(_within_rounding(out, want) for out in outs), step


@pytest.mark.parametrize("heads,groups,hd,dtype", [(4, 2, 64, torch.bfloat16), (12, 2, 128, torch.bfloat16),
                                                   (28, 4, 128, torch.float16), (16, 16, 256, torch.bfloat16)])
def test_paged_kernel_dispatch_and_self_check(heads, groups, hd, dtype):
    assert decode.paged_kernel_supported(torch.device("cuda"), heads, groups, hd, dtype) is None
    q, kc, vc, table, lens = _paged_case(9, heads, groups, hd, 16, 6, dtype, seed=heads)
    got = decode.paged_attention(q, kc, vc, table, lens, hd ** -0.5, flash="kernel")
    assert _within_rounding(got, _reference(q, kc, vc, table, lens, hd ** -0.5))


def test_paged_kernel_rejects_what_it_cannot_read():
    q, kc, vc, table, lens = _paged_case(3, 4, 2, 64, 16, 2, torch.bfloat16, seed=0)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        _kernel(q.float(), kc.float(), vc.float(), table, lens, 0.125, 1)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        _kernel(q[..., :60].contiguous(), kc[..., :60].contiguous(), vc[..., :60].contiguous(), table, lens, 0.125, 1)
    with pytest.raises(RuntimeError, match="not a multiple"):
        _kernel(q[:, :3].contiguous(), kc, vc, table, lens, 0.125, 1)
    with pytest.raises(RuntimeError, match="int32"):
        _kernel(q, kc, vc, table.long(), lens, 0.125, 1)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:]
        _kernel(flat.view(q.shape), kc, vc, table, lens, 0.125, 1)
