"""bench/roofline.py's bound: the arithmetic behind each rollout's "share of bound"."""
import pytest

from bench.bench_actor import _arch
from bench.roofline import generation_bound, kv_bytes_per_token, weight_bytes

ARCH = _arch("1.5b", 4096)  # Qwen2.5-1.5B: tied embeddings, QKV bias


def test_the_shapes_bytes():
    assert kv_bytes_per_token(ARCH) == 28672  # 2 · 28 layers · 2 KV heads · 128 · 2 bytes
    # 1,543,714,304 parameters (Qwen2.5-1.5B, tied), the input embedding's rows aside: its
    # matrix is the output layer's, read once.
    assert weight_bytes(ARCH) == 2 * 1_543_714_304


@pytest.mark.parametrize("batch,prompt,new,tokens_per_s", [
    (128, 256, 256, 82_000), (64, 1024, 1024, 40_000), (512, 512, 512, 97_000)])
def test_the_issue_bounds_at_4_2_tb_s(batch, prompt, new, tokens_per_s):
    """The bounds issue 22 quotes (H200: ~4.2 TB/s copy, ~750 TFLOP/s bf16 matmul)."""
    bound = generation_bound(ARCH, [prompt] * batch, new, 4.2e12, 750e12)
    assert batch * new / bound.seconds == pytest.approx(tokens_per_s, rel=0.06)


def test_sequences_leave_the_decode_when_done():
    """Two sequences, 3 and 1 new tokens after prompts of 4 and 6. The second's one token comes
    from its prefill, so no decoding step reads its cache; the first's are read at 5 and 6
    tokens. With 3 new tokens each, both are read in both steps."""
    bw = 1e12
    b = generation_bound(ARCH, [4, 6], [3, 1], bw, 1e15)
    kv = kv_bytes_per_token(ARCH)
    assert b.decode_steps == 2
    assert b.decode_seconds == pytest.approx((2 * weight_bytes(ARCH) + kv * (5 + 6)) / bw)
    same = generation_bound(ARCH, [4, 6], 3, bw, 1e15)
    assert same.prefill_seconds == b.prefill_seconds
    assert same.decode_seconds == pytest.approx((2 * weight_bytes(ARCH) + kv * (5 + 6 + 7 + 8)) / bw)


def test_decode_parts_groups_a_steps_kernels_by_name():
    """bench_decode_parts.step_kernels (on the GPU: the CUDA kernels of one eager decode step),
    here over CPU ops: counts per name, their time summed, the gap to the replayed step."""
    import torch

    from bench.bench_decode_parts import step_kernels

    x = torch.randn(64, 64)
    out = step_kernels(lambda: [(x @ x).relu() for _ in range(3)], 10.0, device="cpu")
    assert out["by_name"]["aten::relu"]["count"] == 3 and out["by_name"]["aten::mm"]["count"] == 3
    assert out["launches"] == sum(v["count"] for v in out["by_name"].values())
    assert out["kernel_us"] == pytest.approx(sum(v["us"] for v in out["by_name"].values()))
    assert out["graph_step_us"] == 10_000.0


def test_an_fp8_copy_halves_the_linear_bytes_and_adds_a_scale_per_row():
    """rollout.dtype=fp8: the 28 layers' linears (1.31 G weights, 27,776 output rows a layer)
    at 1 byte plus 4 per row; norms, biases, the final norm and the tied head stay bf16."""
    h, f, q, kv = 1536, 8960, 1536, 256
    linear = h * (q + 2 * kv) + q * h + 3 * h * f
    rows = (q + 2 * kv) + h + 2 * f + h
    assert rows == 23_040
    assert weight_bytes(ARCH) - weight_bytes(ARCH, fp8=True) == 28 * (linear - 4 * rows)
    assert weight_bytes(ARCH, fp8=True) / weight_bytes(ARCH) == pytest.approx(0.576, abs=0.001)
    bw = 1e12
    plain = generation_bound(ARCH, [8], 4, bw, 1e15)
    fp8 = generation_bound(ARCH, [8], 4, bw, 1e15, fp8=True)
    assert fp8.weight_bytes == weight_bytes(ARCH, fp8=True)
    assert plain.decode_seconds - fp8.decode_seconds == pytest.approx(
        3 * (weight_bytes(ARCH) - weight_bytes(ARCH, fp8=True)) / bw)
