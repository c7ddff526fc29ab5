"""models/grad_accum.py, apex's wgrad_gemm_accum_* in torch: `main_grad += grad_output^T @
total_input` in place, against a float64 reference; install() into megatron's linears. The
engine-level check (one PPO step fused == unfused) is tests/engine/test_grad_accum_fusion.py."""
from __future__ import annotations

import pytest
import torch

from verl_mcore.models import grad_accum

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(n, out, inp, dtype, device="cpu", acc_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total_input = torch.randn(n, inp, generator=g).to(dtype).to(device)
    grad_output = torch.randn(n, out, generator=g).to(dtype).to(device)
    main_grad = torch.randn(out, inp, generator=g).to(acc_dtype).to(device)
    want = main_grad.double() + grad_output.double().t() @ total_input.double()
    return total_input, grad_output, main_grad, want


def _rel(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp32_accumulation_in_place(dtype):
    x, g, main_grad, want = _case(37, 12, 20, dtype)
    storage = main_grad.data_ptr()
    grad_accum.wgrad_gemm_accum_fp32(x, g, main_grad)
    assert main_grad.data_ptr() == storage and main_grad.dtype == torch.float32
    # Half inputs: their products are exact in fp32, so only fp32 summation error remains.
    assert _rel(main_grad, want) <= 1e-6


def test_half_precision_main_grad():
    x, g, main_grad, want = _case(37, 12, 20, torch.bfloat16, acc_dtype=torch.bfloat16)
    grad_accum.wgrad_gemm_accum_fp16(x, g, main_grad)
    assert main_grad.dtype == torch.bfloat16 and _rel(main_grad, want) <= 1e-2


def test_install_hands_megatron_our_functions(monkeypatch):
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda", raising=False)
    grad_accum.install()
    grad_accum.install()
    assert layers._grad_accum_fusion_available
    assert layers.fused_weight_gradient_mlp_cuda is grad_accum


def test_install_keeps_apex_when_megatron_found_it(monkeypatch):
    from megatron.core.tensor_parallel import layers

    apex = object()
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", apex, raising=False)
    grad_accum.install()
    assert layers.fused_weight_gradient_mlp_cuda is apex


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_accumulation(dtype):
    """A fused candidate works on this torch build (not the unfused fallback), and accumulates
    in fp32 on weight-gradient shapes of the 3B model (tokens x hidden x ffn)."""
    fn = grad_accum.probe(torch.device("cuda"), dtype)
    assert fn is not None, "no fused fp32-accumulating GEMM on this torch build"
    for n, out, inp in [(4096, 11008, 2048), (1000, 256, 2048), (8, 384, 64)]:
        x, g, main_grad, want = _case(n, out, inp, dtype, device="cuda")
        storage = main_grad.data_ptr()
        grad_accum.wgrad_gemm_accum_fp32(x, g, main_grad)
        assert main_grad.data_ptr() == storage
        assert _rel(main_grad, want) <= 1e-5, (n, out, inp)
