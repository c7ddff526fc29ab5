"""FLOP count of a decoder-only transformer, for MFU (model FLOPs utilisation).

Per sequence of L tokens, counting multiply-adds as 2 FLOPs and the backward as twice the forward:

    training FLOPs = 6 * N * L  +  6 * n_layers * d_attn * L * (L + 1)
    forward  FLOPs = 2 * N * L  +  2 * n_layers * d_attn * L * (L + 1)

N is the number of weights used in matrix multiplies per token: per layer the QKV projection
h * (d_attn + 2 * d_kv), the output projection d_attn * h and the MLP h * ffn * (3 if gated else
2), plus the output layer h * V (V = 1 for a value head). Embedding look-ups, norms, biases and
softmax are left out (they are not matmuls). The attention term is the score and value products
under a causal mask: query t attends to t keys, L(L+1)/2 query-key pairs per sequence, each costing
2 * d_attn (QK^T) + 2 * d_attn (AV) forward. d_attn = heads * head_dim, d_kv = query groups *
head_dim. Activation recompute is NOT counted (that would be hardware FLOPs, not model FLOPs), and
padding tokens count for nothing: a packed run and a padded run of the same batch do the same
model FLOPs, the padded one just takes longer.

MFU = model FLOPs / (seconds * peak FLOP/s of the devices used); the peak is the dense bf16 tensor
throughput of the device (`peak_flops`).
"""
from __future__ import annotations

from typing import Iterable, Optional

from verl_mcore.utils.device import cuda_in_use

# Dense bf16 tensor-core peak per device, FLOP/s (vendor datasheets, without sparsity).
_PEAKS = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12))


def matmul_params(config, vocab_size: int) -> int:
    """N of the module docstring for a TransformerConfig and output width (vocab or 1)."""
    h = config.hidden_size
    head_dim = config.kv_channels or h // config.num_attention_heads
    d_attn = config.num_attention_heads * head_dim
    d_kv = (config.num_query_groups or config.num_attention_heads) * head_dim
    ffn = config.ffn_hidden_size
    mlp = h * ffn * (3 if config.gated_linear_unit else 2)
    per_layer = h * (d_attn + 2 * d_kv) + d_attn * h + mlp
    return config.num_layers * per_layer + h * vocab_size


def sequence_flops(config, vocab_size: int, seq_lens: Iterable[int], training: bool = True) -> float:
    """Model FLOPs of a forward (+ backward when training) over sequences of these lengths."""
    n = matmul_params(config, vocab_size)
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    d_attn = config.num_attention_heads * head_dim
    mult = 6 if training else 2
    total = 0.0
    for length in seq_lens:
        length = int(length)
        total += mult * (n * length + config.num_layers * d_attn * length * (length + 1))
    return total


def peak_flops(device_name: Optional[str] = None) -> Optional[float]:
    """Dense bf16 peak FLOP/s of the current CUDA device (or of `device_name`); None if unknown."""
    if device_name is None:
        import torch

        if not cuda_in_use():
            return None
        device_name = torch.cuda.get_device_name()
    for key, peak in _PEAKS:
        if key in device_name:
            return peak
    return None


_MEASURED: dict[str, float] = {}


def measured_matmul_ceiling(size: int = 512, repeats: int = 5) -> float:
    """FLOP/s of a square fp32 matmul on this process's device, measured once and cached.

    The MFU denominator where no datasheet peak is known (the CPU machines): there MFU reads as
    "fraction of what a plain matmul reaches here".
    """
    import time

    import torch

    device = "cuda" if cuda_in_use() else "cpu"
    if device not in _MEASURED:
        # Its own generator: a draw from the global one, made at a process's first step, would
        # shift every later dropout mask of a resumed run against the straight one.
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(size, size, device=device, generator=gen)
        b = torch.randn(size, size, device=device, generator=gen)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            a @ b
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        _MEASURED[device] = 2 * size**3 / best
    return _MEASURED[device]
