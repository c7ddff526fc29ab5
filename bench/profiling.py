"""Where GPU time goes: a torch.profiler trace of one region, summarised as text.

    with kernel_profile("actor update", path="out/profile_actor.txt"):
        actor.update(batch)

writes (and prints) the region's wall time, its summed kernel time by category (matmul, attention,
norm, elementwise, ...) and the top kernels by total device time. Kernels replayed from CUDA graphs
are included (CUPTI sees them). Profiling adds host overhead, so time regions elsewhere; this only
says how the device time splits.
"""
from __future__ import annotations

import contextlib
import re
import time
from typing import Optional

import torch

# First match wins; patterns are matched against the lower-cased kernel name.
CATEGORIES = [
    ("matmul", r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul|wgmma"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("logprob kernel", r"lpe_|logprob"),
    ("norm", r"norm"),
    ("softmax", r"softmax"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("reduction", r"reduce|sum_kernel|max_kernel|argmax|cumsum|scan"),
    ("copy / cast", r"copy|cast|convert|memcpy|memset|fill|cat|index|gather|scatter"),
    ("elementwise", r"elementwise|vectorized|unrolled|silu|mul|add|pow|exp|rsqrt"),
    ("communication", r"nccl"),
]


def categorise(name: str) -> str:
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other"


def summarise(events, wall_s: float, label: str, top: int = 30) -> str:
    """Text summary of the profiler's key_averages() `events` over a region of `wall_s`."""
    from torch.autograd import DeviceType

    rows = []  # device-side events only: CPU ops also report their kernels' time
    for e in events:
        if e.device_type == DeviceType.CUDA and e.self_device_time_total:
            rows.append((e.key, e.self_device_time_total / 1e6, e.count))
    total = sum(r[1] for r in rows)
    by_cat: dict[str, list] = {}  # category -> [device seconds, kernel launches]
    for name, secs, count in rows:
        acc = by_cat.setdefault(categorise(name), [0.0, 0])
        acc[0] += secs
        acc[1] += count
    lines = [f"## profile: {label}",
             f"wall {wall_s * 1e3:.1f} ms; summed device time {total * 1e3:.1f} ms "
             f"({total / wall_s:.0%} of wall; < 100% = idle gaps or overlap)", "",
             "| category | device ms | share | kernels |", "|---|---|---|---|"]
    for cat, (secs, count) in sorted(by_cat.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {cat} | {secs * 1e3:.1f} | {secs / max(total, 1e-12):.1%} | {count} |")
    lines += ["", f"| top {top} kernels | calls | device ms | share |", "|---|---|---|---|"]
    for name, secs, count in sorted(rows, key=lambda r: -r[1])[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{short}` | {count} | {secs * 1e3:.2f} | {secs / max(total, 1e-12):.1%} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def kernel_profile(label: str, path: Optional[str] = None, top: int = 30):
    """Profile the body's CUDA kernels; print the summary and write it to `path` (appended)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        yield
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    text = summarise(prof.key_averages(), wall, label, top)
    print(text)
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")
