"""ops/triton_paged.py: decode attention over a paged KV cache in Triton, against
`paged_attention_reference` -- on the CPU under Triton's interpreter (where Triton is installed:
the GPU image has it; CI's CPU environment does not), and on a GPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

from verl_mcore.ops import decode, triton_paged


def test_splits_depend_on_shapes_only():
    # 128 sequences x 2 groups on 132 SMs: 3 shares (4 programs an SM), each >= 4 tiles of 64 keys
    assert triton_paged.splits_for(128, 2, 4096, 132) == 3
    assert triton_paged.splits_for(128, 2, 512, 132) == 2  # 512 keys: 2 shares of 4 tiles
    assert triton_paged.splits_for(8, 1, 100_000, 132) == 64  # capped
    assert triton_paged.splits_for(4096, 2, 4096, 132) == 1


def test_triton_paged_matches_reference_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed here (the GPU image has it)")
    body = os.path.join(os.path.dirname(__file__), "triton_paged_body.py")
    out = subprocess.run([sys.executable, body], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stdout[-2000:] + out.stderr[-3000:]
    for dtype, splits, err, same_dtype in json.loads(line[0][len("RESULT "):]):
        # fp16: p is rounded to fp16 before p.v, as in flash attention; fp32: summation order only
        assert err < (2e-3 if dtype in ("torch.float16", "self-check") else 1e-5), (dtype, splits, err)
        assert same_dtype


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,heads,groups,hd,page,width,splits", [
    (5, 12, 2, 128, 256, 3, None), (9, 28, 4, 128, 16, 40, 7), (6, 4, 4, 64, 3, 30, 1),
    (3, 16, 1, 256, 256, 2, 64), (128, 12, 2, 128, 256, 4, None)])
def test_triton_paged_matches_reference_on_gpu(dtype, b, heads, groups, hd, page, width, splits):
    g = torch.Generator(device="cuda").manual_seed(b * heads)
    kc = torch.randn(b * width + 1, page, groups, hd, device="cuda", generator=g).to(dtype)
    vc = torch.randn(b * width + 1, page, groups, hd, device="cuda", generator=g).to(dtype)
    kc[0] = vc[0] = 1e4  # scratch block: in no table
    table = (torch.randperm(b * width, device="cuda", generator=g) + 1).view(b, width).to(torch.int32)
    lens = torch.randint(1, width * page + 1, (b,), device="cuda", generator=g).to(torch.int32)
    lens[:2] = torch.tensor([1, width * page])
    q = torch.randn(b, heads, hd, device="cuda", generator=g).to(dtype)
    got = triton_paged.paged_attention(q, kc, vc, table, lens, hd ** -0.5, splits=splits)
    want = decode.paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - want.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_triton_paged_self_check_and_graph_replay():
    assert decode.paged_triton_supported(torch.device("cuda")) is None
    b, heads, groups, hd, page, width = 16, 12, 2, 128, 256, 4
    kc = torch.randn(b * width + 1, page, groups, hd, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.zeros(b, width, device="cuda", dtype=torch.int32)
    lens = torch.ones(b, device="cuda", dtype=torch.int32)
    q = torch.randn(b, heads, hd, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        triton_paged.paged_attention(q, kc, vc, table, lens, hd ** -0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_paged.paged_attention(q, kc, vc, table, lens, hd ** -0.5)
    # other tables and lengths, replayed by the same graph
    table.copy_((torch.randperm(b * width, device="cuda") + 1).view(b, width).to(torch.int32))
    lens.copy_(torch.randint(1, width * page + 1, (b,), device="cuda", dtype=torch.int32))
    graph.replay()
    want = decode.paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5)
    assert (out.float() - want.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,groups,hd,page,splits", [
    (24, 2, 32, 16, 1), (24, 2, 32, 16, 3), (12, 2, 128, 256, None), (8, 8, 128, 16, 2), (16, 2, 64, 3, 4)])
def test_triton_paged_cascade_on_gpu(dtype, heads, groups, hd, page, splits):
    """Shared prompt blocks read once for a prefix group (more members than a group row holds,
    two groups, one sequence alone) against the reference: r = 12, 6 (Qwen2.5-1.5B), 1, 8; blocks
    of 16, 256 and 3 tokens; the kernel's own split count."""
    from tests.ops.triton_cases import cascade_case

    assert cascade_case(dtype, heads=heads, groups=groups, hd=hd, page=page, splits=splits, device="cuda") < 2e-2
