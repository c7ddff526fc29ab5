"""RoPE inverse frequencies exactly as Hugging Face computes them, installed into a GPTModel.

megatron-core 0.16.1's RotaryEmbedding knows Llama-3 scaling only with low/high frequency factors
1 and 4 and original context 8192 hard-coded (`_apply_scaling`); only `factor` is an argument.
Checkpoints that use other values would silently get different positions, so we compute the
frequencies here for every supported rope type and overwrite the model's `inv_freq`.
"""
from __future__ import annotations

import math

import torch

from verl_mcore.models.hf_config import RopeSpec


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32) for `rope` (HF's formulas, same op order)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.type == "default":
        return inv_freq
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type != "llama3":
        raise ValueError(f"rope_inv_freq: unknown rope type {rope.type!r}")
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band in
    # between interpolated smoothly in 1/wavelength.
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def install_rope(model: torch.nn.Module, rope: RopeSpec, head_dim: int) -> None:
    """Replace the GPTModel's RoPE frequencies with HF's (before its first forward: megatron
    caches the embedding per sequence length)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise ValueError("install_rope: the model has no rotary_pos_emb (position_embedding_type "
                         "must be 'rope')")
    rotary.forward.cache_clear()
    rotary.inv_freq = rope_inv_freq(rope, head_dim).to(rotary.inv_freq.device)
