"""The hardware's bound for a generation call, from measurements of the same run.

    bw = copy_bandwidth()            # bytes/s, a device-to-device copy (bytes read + written)
    flops = matmul_ceiling()         # bf16 dense matmul FLOP/s
    bound = generation_bound(arch, prompt_lens, new_tokens, bw, flops)
    share = bound.seconds / measured_seconds

Decode is bound by memory bandwidth: each decoding step reads every weight once (the output
layer's [V, h] included; the embedding lookup reads only the rows it needs) plus the KV cache of
every live sequence up to its current length, 2 (K, V) · layers · kv_heads · head_dim · dtype
bytes per token. Prefill is bound by the matmul ceiling: 2 FLOPs per linear weight per prompt
token, causal attention (2 · 2 · layers · heads · head_dim · s²/2 for s tokens) and the logits
of the prompt's last token, whose sample is each sequence's first new token. A sequence is live
in the decoding steps until it has its new tokens. Nothing else (sampling, the host, launches)
is in the bound: those are what a real engine adds to it.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Bound:
    decode_seconds: float  # weights + KV at copy bandwidth, summed over decoding steps
    prefill_seconds: float  # prompt FLOPs at the matmul ceiling
    weight_bytes: int  # read once per decoding step
    kv_bytes_per_token: int
    decode_steps: int

    @property
    def seconds(self) -> float:
        return self.decode_seconds + self.prefill_seconds


def kv_bytes_per_token(arch, dtype_bytes: int = 2) -> int:
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes


def weight_bytes(arch, dtype_bytes: int = 2, fp8: bool = False) -> int:
    """Bytes a decoding step reads: every decoder-layer weight, the final norm and the output
    layer ([V, h], the embedding itself when tied); the input embedding only by rows. fp8: the
    generation copy of rollout.dtype=fp8 (rollout/fp8_weights.py), its four linears per layer
    in e4m3 (1 byte a weight) with a 4-byte scale per output row, the rest in dtype_bytes."""
    h, f, hd = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    linear = h * (q + 2 * kv) + q * h + 3 * h * f  # qkv, proj, gate/up/down
    rows = (q + 2 * kv) + h + 2 * f + h  # their output channels
    other = 2 * h  # two norms
    if getattr(arch, "qkv_bias", False):
        other += q + 2 * kv
    linear_bytes = linear + 4 * rows if fp8 else dtype_bytes * linear
    return arch.num_layers * (linear_bytes + dtype_bytes * other) + dtype_bytes * (h + arch.vocab_size * h)


def prefill_flops(arch, prompt_len: int) -> float:
    h, f, hd = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    linear = arch.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * f)
    attention = 2 * 2 * arch.num_layers * arch.num_heads * hd * prompt_len * prompt_len / 2
    return 2 * linear * prompt_len + attention + 2 * arch.vocab_size * h  # + the last token's logits


def generation_bound(arch, prompt_lens: Sequence[int], new_tokens: Sequence[int] | int,
                     copy_bytes_per_s: float, matmul_flops_per_s: float,
                     dtype_bytes: int = 2, prefilled: Optional[Sequence[int]] = None,
                     fp8: bool = False) -> Bound:
    """The bound of generating new_tokens[i] tokens after prompt i, all sequences decoding
    together (as continuous batching keeps them while they last). prefilled: the prompts an
    engine must prefill (default: every sequence's; the distinct prompts where the n samples
    of a prompt share its prefill). fp8: the engine reads an FP8 generation copy
    (`weight_bytes`); prefill stays at the bf16 matmul ceiling (FP8 GEMMs could go faster: the
    bound is then generous to FP8 by the prefill's share)."""
    if isinstance(new_tokens, int):
        new_tokens = [new_tokens] * len(prompt_lens)
    w = weight_bytes(arch, dtype_bytes, fp8)
    per_token = kv_bytes_per_token(arch, dtype_bytes)
    steps = max(new_tokens) - 1  # the first new token of each sequence comes from its prefill
    decode_bytes = 0
    for step in range(1, steps + 1):  # step t makes token t + 1 after reading prompt + t tokens
        live = [p + step for p, n in zip(prompt_lens, new_tokens) if n > step]
        decode_bytes += w + per_token * sum(live)
    # Decode reads are read-only, the copy both reads and writes: bw counts both, as a read
    # stream at the same rate would.
    prefill = sum(prefill_flops(arch, p) for p in (prompt_lens if prefilled is None else prefilled))
    prefill /= matmul_flops_per_s
    return Bound(decode_seconds=decode_bytes / copy_bytes_per_s, prefill_seconds=prefill,
                 weight_bytes=w, kv_bytes_per_token=per_token, decode_steps=steps)


def _time_ms(fn, reps: int) -> float:
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(reps: int = 10, n: int = 2 * 1024**3) -> float:
    """Device-to-device copy of n bytes, (read + written) bytes / median time."""
    import torch

    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), reps)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms / 1e3)


def matmul_ceiling(n: int = 8192, reps: int = 10) -> float:
    """bf16 dense [n, n] @ [n, n] FLOP/s, median time (fresh random inputs)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b, reps)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms / 1e3)
