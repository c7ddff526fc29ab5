"""Token sampling from full-vocabulary logits, with counter-based random numbers.

Each sequence draws one uniform number per step, a pure function of (seed, sequence key, step)
(`uniforms`), and picks its token by inverting the CDF of its (temperature-scaled, top-k / top-p
truncated) distribution. So a sequence's samples depend on neither the batch it shares nor the slot
it sits in, and every rank that holds the same logits picks the same token.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from verl_mcore.ops._extension import extension

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit (wrapping math)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sequence_keys(seed: int, prompt_index: np.ndarray, sample_index: np.ndarray) -> np.ndarray:
    """uint64 key per sequence from the call's seed and its (prompt, sample) indices."""
    with np.errstate(over="ignore"):
        base = _mix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) + _GOLDEN)
        k = _mix64(base ^ (prompt_index.astype(np.uint64) * _GOLDEN))
        return _mix64(k ^ (sample_index.astype(np.uint64) + np.uint64(1)))


def uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """One float64 in [0, 1) per sequence for decoding step `steps` (53 random bits)."""
    with np.errstate(over="ignore"):
        bits = _mix64(keys ^ _mix64(steps.astype(np.uint64) * _GOLDEN + np.uint64(1)))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def keys_to_tensor(keys: np.ndarray, device: torch.device | str | None = None) -> torch.Tensor:
    """`sequence_keys` as an int64 tensor of the same bits (what `uniforms_device` reads)."""
    return torch.from_numpy(np.ascontiguousarray(keys, dtype=np.uint64).view(np.int64)).to(device)


def uniforms_device(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`uniforms` by torch ops on the keys' device, bit for bit: keys [b] int64 (the uint64 bits,
    `keys_to_tensor`), steps [b] int64 -> [b] float64. No host sync, no data-dependent shapes:
    it can run inside a captured CUDA graph. On a GPU with the csrc/ extension: one kernel in
    uint64 arithmetic (the torch ops below are ~60 small kernels, ~0.1 ms a decoding step)."""
    if keys.is_cuda:
        ext = extension()
        if ext is not None and hasattr(ext, "uniforms"):
            return ext.uniforms(keys.contiguous(), steps.contiguous(),
                                torch.cuda.current_stream(keys.device).cuda_stream)
    return uniforms_torch(keys, steps)


def uniforms_torch(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`uniforms_device` by torch ops alone (any device; the CUDA kernel's oracle)."""
    bits = _mix64_device(keys ^ _mix64_device(_mul_add_device(steps, int(_GOLDEN), 1)))
    return _shr(bits, 11).to(torch.float64) * (1.0 / (1 << 53))


# uint64 arithmetic on int64 tensors that hold the same bits. Signed overflow is undefined in the
# C++ of torch's kernels (and its uint64 tensors have no shifts or adds), so a product is formed
# from 16-bit limbs whose partial sums stay below 2^35, and a right shift masks off the copies of
# the sign bit that torch's arithmetic >> brings in.


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of the 64 bits by 0 < k < 64."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mul_add_device(x: torch.Tensor, c: int, a: int = 0) -> torch.Tensor:
    """(x * c + a) mod 2^64 for the bits of x and constants 0 <= c < 2^64, 0 <= a < 2^16."""
    x = x.to(torch.int64).contiguous()
    # [..., 4] 16-bit limbs, least significant first (torch's CPUs and GPUs are little-endian)
    limbs = x.view(torch.uint16).view(*x.shape, 4).to(torch.int64)
    c0, c1, c2, c3 = ((c >> (16 * j)) & 0xFFFF for j in range(4))
    # r_k = sum over i + j = k of x_i c_j < 4 * 2^32 (k < 4: the rest is a multiple of 2^64)
    r = limbs * c0
    r[..., 1:].add_(limbs[..., :3], alpha=c1)
    r[..., 2:].add_(limbs[..., :2], alpha=c2)
    r[..., 3:].add_(limbs[..., :1], alpha=c3)
    if a:
        r[..., 0].add_(a)
    for k in range(3):  # carries; each limb's own 16 bits stay
        r[..., k + 1].add_(r[..., k] >> 16)
    # int64 -> uint16 keeps the low 16 bits (a defined, modular conversion)
    return r.to(torch.uint16).view(torch.int64).squeeze(-1)


def _mix64_device(x: torch.Tensor) -> torch.Tensor:
    """`_mix64` on int64 tensors holding uint64 bits."""
    x = _mul_add_device(x ^ _shr(x, 30), 0xBF58476D1CE4E5B9)
    x = _mul_add_device(x ^ _shr(x, 27), 0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[token] [b] (float32) for logits [b, V]; T = 1 for greedy (T = 0)."""
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample_with_logprobs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                         u: Optional[torch.Tensor], logprobs: bool
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`sample`, and with `logprobs` the tokens' `token_logprobs`. On a GPU with the csrc/ extension,
    when nothing truncates the distribution (greedy, or top_k off and top_p 1: the RL default),
    one kernel (csrc/sampling.cu) that reads the logits twice instead of ~20 torch kernels over
    float32 copies of them. Its draws are `sample`'s up to float rounding at CDF boundaries (the
    sums run in another order): the same distribution; greedy is torch's argmax exactly. A row
    with a NaN or infinite logit gets its argmax."""
    vocab = logits.shape[-1]
    whole = temperature == 0.0 or (not 0 < top_k < vocab and top_p >= 1.0)
    if whole and logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and \
            logits.dtype in (torch.bfloat16, torch.float16, torch.float32):
        ext = extension()
        if ext is not None and hasattr(ext, "sample"):
            tokens, logp = ext.sample(logits, vocab, float(temperature),
                                      None if temperature == 0.0 else u.to(torch.float64).contiguous(),
                                      torch.cuda.current_stream(logits.device).cuda_stream)
            return tokens, logp if logprobs else None
    tokens = sample(logits, temperature, top_p, top_k, u)
    return tokens, token_logprobs(logits, tokens, temperature) if logprobs else None


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
           u: Optional[torch.Tensor]) -> torch.Tensor:
    """Tokens [b] (int64) from logits [b, V] (the real vocabulary only: padding rows cut off).

    temperature 0: argmax. Otherwise the token is drawn with uniforms `u` [b] from
    softmax(logits / T) restricted to the top_k largest and to the smallest prefix (by
    probability) whose mass reaches top_p.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits if temperature == 1.0 else logits.float() / temperature
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    vocab = probs.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k == vocab and top_p >= 1.0:
        return _invert_cdf_blocked(probs, u)
    # Sorted descending: keep the first k, and the tokens whose preceding mass < top_p (the most
    # likely token always stays).
    sorted_p, order = torch.topk(probs, k, dim=-1) if k < vocab else probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        before = sorted_p.cumsum(dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    pick = _invert_cdf(sorted_p.cumsum(dim=-1), u)
    return order.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


def _invert_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first cdf entry above u * total, per row (cdf [b, n] non-decreasing)."""
    return _search(cdf, (u.to(cdf.device, torch.float64) * cdf[:, -1].double()).to(cdf.dtype))


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first cdf entry above `target` [b]; never an entry without mass."""
    pick = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    pick = pick.clamp_(max=cdf.shape[-1] - 1)
    # A zero-probability entry cannot be picked, except by rounding at the very end of the CDF
    # (or, in the blocked inversion, of a block whose running sum and block sum round apart):
    # step back to the last entry with mass.
    last_nonzero = (cdf < cdf[:, -1:]).sum(dim=-1)
    return torch.minimum(pick, last_nonzero)


_BLOCK = 256


def _invert_cdf_blocked(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse CDF of probs [b, V] at u [b] in two levels: the block of _BLOCK entries where
    the running mass crosses u * total, then the entry inside it. Same draw as one flat cumsum up to
    float rounding, but over a 150k vocabulary it avoids a full-width scan and its search (the
    sampler's largest cost in a decode step)."""
    b, vocab = probs.shape
    nblocks = -(-vocab // _BLOCK)
    if nblocks * _BLOCK != vocab:
        probs = torch.nn.functional.pad(probs, (0, nblocks * _BLOCK - vocab))
    blocks = probs.view(b, nblocks, _BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [b, nblocks]
    total = block_cdf[:, -1]
    target = (u.to(probs.device, torch.float64) * total.double()).to(probs.dtype)
    j = _search(block_cdf, target)  # a block with mass
    before = torch.where(j > 0, block_cdf.gather(-1, (j - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1),
                         torch.zeros_like(total))
    inner = blocks.gather(1, j.view(b, 1, 1).expand(b, 1, _BLOCK)).squeeze(1)  # [b, _BLOCK]
    return j * _BLOCK + _search(before.unsqueeze(-1) + inner.cumsum(dim=-1), target)
