"""ops/fp8.py: per-channel / per-token e4m3 quantization and the FP8 linear, against float64
formulas on the CPU (the reference is the oracle of the GPU path), against torch's own
_scaled_mm where this torch has a CPU one, and on a GPU (marked: _scaled_mm and the Triton
quantization kernel against the reference)."""
import pytest
import torch

from verl_mcore.ops import fp8

# Shapes (rows, K): decode-like skinny and prefill-like tall, K not a power of two, K < 16.
SHAPES = [(1, 16), (3, 64), (17, 48), (64, 200), (5, 1000), (130, 96), (2, 7)]


def _rows(shape, kind: str, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Test matrices: gaussian, rows of very different magnitude, one outlier column (the case
    per-channel scaling handles worst: the rest of each row falls into few mantissa steps),
    an all-zero row, and values small enough that some land in e4m3's subnormals."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape, generator=g, dtype=torch.float64)
    if kind == "row_scales":
        a *= torch.logspace(-8, 8, shape[0], dtype=torch.float64).view(-1, 1)
    elif kind == "outlier":
        a[:, shape[1] // 2] *= 1000.0
    elif kind == "zero_row":
        a[shape[0] // 2] = 0.0
    elif kind == "tiny":
        a *= 1e-30
    return a.to(dtype)


KINDS = ["gaussian", "row_scales", "outlier", "zero_row", "tiny"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_round_trip_is_within_the_per_channel_bound(shape, kind, dtype):
    w = _rows(shape, kind, dtype)
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == fp8.FP8 and q.shape == w.shape and scale.shape == (shape[0],)
    assert scale.dtype == torch.float32 and bool((scale > 0).all())
    w64 = w.double()
    amax = w64.abs().amax(dim=1)
    # the scale is each row's max / 448 (fp32 rounding; a row below MIN_AMAX quantizes to
    # zeros), and that max maps to +-448 exactly
    want = amax.clamp(min=fp8.MIN_AMAX) / fp8.FP8_MAX
    assert torch.allclose(scale.double(), want, rtol=2 ** -23, atol=0)
    nonzero = amax > fp8.MIN_AMAX
    top = q.float().abs().amax(dim=1).double()
    assert torch.equal(top[nonzero], torch.full_like(top[nonzero], fp8.FP8_MAX))
    err = (w64 - fp8.dequantize(q, scale).double()).abs()
    bound = fp8.element_error_bound(w, scale).double()
    assert bool((err <= bound).all()), (err - bound).max()
    # and the bound is not vacuous: it is met within a factor 2 somewhere in a gaussian row
    if kind == "gaussian":
        assert (err / bound).max() > 0.5


def test_quantize_into_preallocated_tensors_in_chunks_equals_one_shot():
    w = _rows((37, 40), "row_scales")
    q, s = fp8.quantize_weight(w)
    q2 = torch.empty_like(q)
    s2 = torch.empty(37, dtype=torch.float32)
    fp8.quantize_weight_into(w, q2, s2, rows_at_once=5)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    with pytest.raises(ValueError, match=r"weight \(37, 40\)"):
        fp8.quantize_weight_into(w, q2[:3], s2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["gaussian", "row_scales", "zero_row", "tiny"])
def test_token_quantization_is_the_weight_scheme_per_row(shape, kind):
    x = _rows(shape, kind, seed=1)
    q, scale = fp8.quantize_tokens(x)  # CPU: the reference
    wq, ws = fp8.quantize_weight(x)
    assert scale.shape == (shape[0], 1)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(scale.view(-1), ws)


def _float64_linear(xq, xs, wq, ws):
    """The FP8 GEMM's exact value from its quantized operands, in float64, and the sum of the
    magnitudes of its terms (what an fp32 accumulation's rounding is relative to)."""
    x, w = xq.double() * xs.double(), wq.double() * ws.double().view(-1, 1)
    return x @ w.t(), x.abs() @ w.abs().t()


@pytest.mark.parametrize("m,k,n", [(1, 16, 16), (4, 64, 48), (33, 96, 80), (128, 256, 32),
                                   (7, 40, 24), (2, 1000, 3)])
@pytest.mark.parametrize("kind", ["gaussian", "row_scales", "outlier"])
def test_reference_linear_is_the_float64_product_of_its_quantized_operands(m, k, n, kind):
    x = _rows((m, k), kind, seed=2)
    w = _rows((n, k), "gaussian" if kind == "row_scales" else kind, seed=3)
    wq, ws = fp8.quantize_weight(w)
    y = fp8.fp8_linear_reference(x, wq, ws)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    xq, xs = fp8.quantize_tokens_reference(x)
    exact, magnitude = _float64_linear(xq, xs, wq, ws)
    # fp32: products of e4m3 values are exact; k additions and two scale products round
    assert bool(((y.double() - exact).abs() <= (k + 4) * 2 ** -24 * magnitude + 1e-300).all())


@pytest.mark.parametrize("m,k,n", [(3, 64, 48), (50, 128, 16), (9, 40, 24)])
def test_fp8_linear_is_close_to_the_unquantized_product_within_the_derived_bound(m, k, n):
    """|fp8(x) fp8(w) - x w| <= sum_k (ex |w| + |x| ew + ex ew) with ex, ew the elements'
    quantization bounds: the per-GEMM error the weight-sync check's tolerance builds on."""
    x, w = _rows((m, k), "gaussian", seed=4), _rows((n, k), "outlier", seed=5)
    wq, ws = fp8.quantize_weight(w)
    xs = fp8.quantize_tokens_reference(x)[1]
    y = fp8.fp8_linear(x, wq, ws).double()
    ex, ew = fp8.element_error_bound(x, xs).double(), fp8.element_error_bound(w, ws).double()
    x64, w64 = x.double(), w.double()
    bound = ex @ w64.abs().t() + x64.abs() @ ew.t() + ex @ ew.t() + (k + 4) * 2 ** -23 * (x64.abs() @ w64.abs().t())
    assert bool(((y - x64 @ w64.t()).abs() <= bound).all())


def test_fp8_linear_keeps_leading_dims_and_dtype_and_names_bad_operands():
    x = _rows((6, 32), "gaussian").view(2, 3, 32).to(torch.bfloat16)
    wq, ws = fp8.quantize_weight(_rows((16, 32), "gaussian"))
    y = fp8.fp8_linear(x, wq, ws)
    assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16
    assert torch.equal(y, fp8.fp8_linear_reference(x, wq, ws))
    with pytest.raises(ValueError, match=r"weight \(16, 32\).*\[N, 48\]"):
        fp8.fp8_linear(torch.zeros(2, 48), wq, ws)
    with pytest.raises(ValueError, match="e4m3"):
        fp8.fp8_linear(x, wq.float(), ws)
    assert fp8.scaled_mm_supported(torch.device("cpu")) == "not a CUDA device"


def test_reference_agrees_with_torchs_own_scaled_mm_where_the_cpu_has_one():
    """torch._scaled_mm on the CPU (torch 2.13 has one) as an independent oracle of the
    reference's semantics: row-wise scale_a [M, 1], scale_b [1, N], bf16 out."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    wq, ws = fp8.quantize_weight(torch.randn(32, 64, generator=g))
    xq, xs = fp8.quantize_tokens_reference(x)
    try:
        got = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch has no CPU _scaled_mm with row-wise scales: {e}")
    want = fp8.fp8_linear_reference(x, wq, ws)
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-6).all()


# ------------------------------------------------------------------ GPU

GPU_SHAPES = [(1, 1536, 2048), (128, 1536, 2048), (128, 1536, 1536), (128, 1536, 17920),
              (128, 8960, 1536), (7, 64, 48), (512, 128, 256), (3, 40, 24), (5, 64, 40)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", GPU_SHAPES)
def test_scaled_mm_path_matches_the_reference_on_gpu(m, k, n):
    """The dispatch's GPU path (Triton quantization + torch._scaled_mm; unaligned shapes: the
    reference) against the reference on the same device, bf16."""
    assert fp8.scaled_mm_supported(torch.device("cuda")) is None
    g = torch.Generator(device="cuda").manual_seed(m * k + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    wq, ws = fp8.quantize_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    got = fp8.fp8_linear(x, wq, ws).float()
    want = fp8.fp8_linear_reference(x, wq, ws).float()
    xq, xs = fp8.quantize_tokens_reference(x)
    magnitude = (xq.float().abs() * xs) @ (wq.float().abs() * ws.view(-1, 1)).t()
    # bf16 output (2^-8 relative) and fp32 accumulation in another order
    assert bool(((got - want).abs() <= 2 ** -7 * want.abs() + 1e-3 * magnitude).all())


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 16), (128, 1536), (128, 8960), (33, 1000), (4, 5000)])
def test_triton_token_quantization_gives_the_references_bits(m, k):
    assert fp8.quantize_kernel_supported(torch.device("cuda")) is None
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = (torch.randn(m, k, device="cuda", generator=g) * 10 ** torch.randint(
        -8, 8, (m, 1), device="cuda", generator=g).float()).to(torch.bfloat16)
    x[0, :] = 0.0
    got_q, got_s = fp8.quantize_tokens(x)
    want_q, want_s = fp8.quantize_tokens_reference(x)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s, want_s)


@pytest.mark.gpu
def test_fp8_linear_replays_in_a_cuda_graph():
    x = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    wq, ws = fp8.quantize_weight(torch.randn(2048, 1536, device="cuda") * 0.02)
    want = fp8.fp8_linear(x, wq, ws)  # warm-up: self-checks and Triton compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8.fp8_linear(x, wq, ws)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, fp8.fp8_linear(x, wq, ws)) and not torch.equal(out, want)
