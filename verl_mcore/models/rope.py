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


# ------------------------------------------------------------------ packed (THD) RoPE, no host syncs
#
# megatron-core 0.16.1 applies RoPE to packed sequences in `_apply_rotary_pos_emb_thd`, which
# reads the sequence lengths back to the host (`cu_seqlens.tolist()`, and `.item()` per sequence
# in one branch) to slice the frequency table, for the queries and again for the keys of every
# layer: two host syncs per layer per micro-batch (72 for a 36-layer model), each of which drains
# the GPU queue, so the CPU can never run ahead of the GPU. It also recomputes cos/sin of the same
# packed frequencies in every call. `apply_rotary_pos_emb` below computes each token's position
# on the device (searchsorted over cu_seqlens), gathers the frequencies, and keeps cos/sin for the
# micro-batch (every layer passes the same cu_seqlens and frequency tensors); the rotation is
# megatron's formula, so the result is bit for bit the same. Everything other than the plain
# case (CP, interleaved, MLA, mscale, partial rotary, TE's fused RoPE) goes to megatron.

# Recent (cu_seqlens, freqs, key, cos, sin): q and k of every layer of a micro-batch reuse one
# entry each. Tensors are matched by identity plus their version counter, so an in-place change
# of cu_seqlens is never served stale values.
_thd_cache: list = []
_THD_CACHE_SIZE = 4


def thd_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token inside its sequence, `[total]`, computed on cu_seqlens'
    device without reading it back: token j belongs to sequence i = #{ends <= j} and sits at
    j - cu_seqlens[i] (empty sequences are skipped by construction)."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
    return tokens - cu_seqlens.index_select(0, seq)


def _thd_cos_sin(cu_seqlens: torch.Tensor, freqs: torch.Tensor, total: int, dtype: torch.dtype):
    """cos and sign-folded sin `[total, 1, d]` in `dtype` for the packed tokens (cached)."""
    # Inference mode is in the key: its tensors cannot be saved for a later backward.
    key = (cu_seqlens._version, freqs._version, total, dtype, torch.is_inference_mode_enabled())
    for cu_ref, freqs_ref, k, cos, sin in _thd_cache:
        if cu_ref is cu_seqlens and freqs_ref is freqs and k == key:
            return cos, sin
    if freqs.size(0) == total:
        # megatron's "exact mapping" branch (freqs has one row per packed token, each sequence
        # reading from its own offset) amounts to token j taking row j.
        packed = freqs[:total]
    else:
        packed = freqs.index_select(0, thd_positions(cu_seqlens, total))  # [total, 1, 1, d]
    # Same ops on the same [total, 1, 1, d] tensor as megatron (mscale is 1 here).
    cos = torch.cos(packed).to(dtype)
    sin = torch.sin(packed)
    # rotate_half(t) * sin = cat(-t2, t1) * sin = cat(t2, t1) * cat(-sin1, sin2): folding the sign
    # into sin (exact) leaves one cat per call instead of a neg and a cat.
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)
    cos, sin = cos.view(total, 1, -1), sin.view(total, 1, -1)
    _thd_cache.append((cu_seqlens, freqs, key, cos, sin))
    del _thd_cache[:-_THD_CACHE_SIZE]
    return cos, sin


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None,
                         mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """megatron's `apply_rotary_pos_emb` (same signature); packed THD input `t [T, heads, d]`
    with `freqs [max_seqlen, 1, 1, d]` takes the sync-free path (see above)."""
    plain_thd = (
        cu_seqlens is not None and cp_group is not None and cp_group.size() == 1
        and not config.apply_rope_fusion and not config.rotary_interleaved
        and not config.multi_latent_attention and mscale == 1.0
        and t.dim() == 3 and freqs.dim() == 4 and freqs.shape[1] == freqs.shape[2] == 1
        and freqs.shape[-1] == t.shape[-1] and t.shape[-1] % 2 == 0
    )
    if not plain_thd:
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens,
                                               mscale=mscale, cp_group=cp_group)
    cos, sin = _thd_cos_sin(cu_seqlens, freqs, t.shape[0], t.dtype)
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((t2, t1), dim=-1) * sin


def install_packed_rope() -> None:
    """Route megatron's attention (megatron.core.transformer.attention imported
    `apply_rotary_pos_emb` by name) through `apply_rotary_pos_emb` above. Idempotent; megatron's
    own function stays in rope_utils, where everything but the plain THD case goes."""
    from megatron.core.transformer import attention

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
