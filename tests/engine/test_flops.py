"""The FLOP count behind MFU, checked by hand on a small shape."""
from types import SimpleNamespace

import torch

from verl_mcore.engine.flops import matmul_params, peak_flops, sequence_flops

# 2 layers, hidden 8, 2 heads of 4 (d_attn 8), 1 KV group (d_kv 4), gated ffn 16, vocab 10.
CFG = SimpleNamespace(num_layers=2, hidden_size=8, num_attention_heads=2, kv_channels=4,
                      num_query_groups=1, ffn_hidden_size=16, gated_linear_unit=True)


def test_matmul_params_by_hand():
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 8 * 16 * 3  # qkv + proj + gated mlp = 576
    assert matmul_params(CFG, 10) == 2 * per_layer + 8 * 10


def test_sequence_flops_causal_attention_term():
    n = matmul_params(CFG, 10)
    # L = 3: 6 N L + 6 * layers * d_attn * L (L + 1)
    assert sequence_flops(CFG, 10, [3]) == 6 * n * 3 + 6 * 2 * 8 * 3 * 4
    assert sequence_flops(CFG, 10, [3], training=False) == 2 * n * 3 + 2 * 2 * 8 * 3 * 4
    # sums over sequences; packing does not change model FLOPs
    assert sequence_flops(CFG, 10, [3, 5]) == sequence_flops(CFG, 10, [3]) + sequence_flops(CFG, 10, [5])


def test_peak_by_device_name():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some CPU") is None


def test_measuring_the_matmul_ceiling_draws_nothing_from_the_global_generator(monkeypatch):
    """It runs at a process's first step: a global draw there would shift every later dropout
    mask of a resumed run against the straight one (LoRA dropout resumed inexactly)."""
    from verl_mcore.engine import flops

    monkeypatch.setattr(flops, "_MEASURED", {})
    before = torch.get_rng_state()
    assert flops.measured_matmul_ceiling(size=64, repeats=1) > 0
    assert torch.equal(torch.get_rng_state(), before)
