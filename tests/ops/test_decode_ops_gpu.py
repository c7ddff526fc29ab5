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
