"""Does this torch's flash attention read a paged KV cache, and at which block sizes?

    python bench/probe_paged_attention.py

Calls `torch.ops.aten._flash_attention_forward` with `block_table` (cache [blocks, block, groups,
hd], one query token per sequence, `seqused_k` keys each) for a few block sizes, against a dense
reference; then times the paged call against the contiguous-slot call at a decode shape (128
sequences x 2,048 keys, Qwen2.5-1.5B's 12 heads / 2 KV groups / hd 128) and against the bytes
of K/V it must read at the copy bandwidth. Prints one line per check.

    python bench/probe_paged_attention.py --sweep

instead times, at the engine's decode shapes (batch x keys of issue 22's settings), the "sequence"
flash call, csrc/paged_attention.cu and ops/triton_paged.py at several split counts (each one's own
choice marked),
each against its K/V bytes at the copy bandwidth: which split rule, and which mode, to take.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.roofline import _time_ms, copy_bandwidth  # noqa: E402
from verl_mcore.ops.decode import paged_attention, paged_attention_reference  # noqa: E402


def paged(q, kc, vc, table, used, scale):
    return paged_attention(q, kc, vc, table, used, scale, flash="paged")


def main() -> None:
    print("torch", torch.__version__)
    print(torch.ops.aten._flash_attention_forward.default._schema)
    dev, dt = "cuda", torch.bfloat16
    heads, groups, hd, scale = 12, 2, 128, 128 ** -0.5
    g = torch.Generator(device="cpu").manual_seed(0)
    for block in (16, 64, 128, 256):
        try:
            b, per = 5, 6
            nblocks = b * per + 3
            kc = torch.randn(nblocks, block, groups, hd, generator=g).to(dev, dt)
            vc = torch.randn(nblocks, block, groups, hd, generator=g).to(dev, dt)
            table = torch.randperm(nblocks, generator=g)[: b * per].view(b, per).to(dev, torch.int32)
            used = torch.tensor([1, block - 1, block + 1, 3 * block, per * block], dtype=torch.int32, device=dev)
            q = torch.randn(b, heads, hd, generator=g).to(dev, dt)
            got = paged(q, kc, vc, table, used, scale).float()
            err = (got - paged_attention_reference(q, kc, vc, table, used, scale).float()).abs().max().item()
            print(f"block {block}: ok, max error {err:.3g}")
        except Exception as e:  # noqa: BLE001 - the probe reports what fails
            print(f"block {block}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}")
    # timing at a decode shape
    b, keys, block = 128, 2048, 256
    per = keys // block
    kc = torch.randn(b * per, block, groups, hd, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    table = torch.randperm(b * per, device=dev).view(b, per).to(torch.int32)
    used = torch.full((b,), keys, dtype=torch.int32, device=dev)
    q = torch.randn(b, heads, hd, device=dev, dtype=dt)
    bw = copy_bandwidth()
    kv_bytes = 2 * b * keys * groups * hd * 2
    for label, fn in [("paged", lambda: paged(q, kc, vc, table, used, scale)),
                      ("contiguous slots", lambda: torch.ops.aten._flash_attention_forward(
                          q, kc.view(-1, groups, hd), vc.view(-1, groups, hd),
                          torch.arange(b + 1, dtype=torch.int32, device=dev),
                          torch.arange(b + 1, dtype=torch.int32, device=dev) * keys, 1, keys, 0.0, False, False,
                          scale=scale, seqused_k=used)[0])]:
        try:
            ms = _time_ms(fn, 50)
            print(f"{label}: {ms * 1e3:.1f} us for {kv_bytes / 1e6:.1f} MB of K/V = "
                  f"{kv_bytes / (ms / 1e3) / bw:.0%} of the copy bandwidth ({bw / 1e12:.2f} TB/s)")
        except Exception as e:  # noqa: BLE001
            print(f"{label}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}")


def sweep() -> None:
    from bench.bench_kernels import graph_time_ms
    from verl_mcore.ops import decode

    dev, dt = "cuda", torch.bfloat16
    heads, groups, hd, scale = 12, 2, 128, 128 ** -0.5
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, {sms} SMs; us per call "
          "(CUDA graph, two input sets alternating) and share of the copy bandwidth")
    for b, keys in ((128, 512), (128, 2048), (64, 2048), (512, 1024), (256, 2560)):
        kv_bytes = 2 * b * keys * groups * hd * 2
        line = [f"b {b:4d} x {keys:5d} keys ({kv_bytes / 1e6:6.0f} MB):"]
        whole = -(-keys // 256) * 256  # "sequence" mode: one block of the longest sequence, rounded
        sets = []
        for _ in range(2):
            kc = torch.randn(b + 1, whole, groups, hd, device=dev, dtype=dt)
            sets.append((torch.randn(b, heads, hd, device=dev, dtype=dt), kc, torch.randn_like(kc),
                         (torch.randperm(b, device=dev) + 1).view(b, 1).to(torch.int32),
                         torch.full((b,), keys, dtype=torch.int32, device=dev)))

        def timed(fn):
            ms = graph_time_ms(fn, sets, 5, calls_per_graph=10)
            return f"{ms * 1e3:7.1f} us {kv_bytes / (ms / 1e3) / bw:4.0%}"

        line.append("sequence flash " + timed(lambda q, kc, vc, t, n: decode.paged_attention(
            q, kc, vc, t, n, scale, flash="sequence")))
        if decode.kernel_available(sets[0][0]):
            chosen = decode.paged_kernel_splits(b, heads, groups, whole, sms)
            for splits in sorted({1, 2, 4, 8, 16, chosen}):
                if whole // splits < 64:
                    continue
                mark = "*" if splits == chosen else ""
                line.append(f"kernel/{splits}{mark} " + timed(
                    lambda q, kc, vc, t, n, s=splits: decode.extension().paged_attention(
                        q, kc, vc, t, n, scale, s, torch.cuda.current_stream().cuda_stream)))
        try:
            from verl_mcore.ops import triton_paged

            chosen = triton_paged.splits_for(b, groups, whole, sms)
            for splits in sorted({1, 2, 4, 8, chosen}):
                mark = "*" if splits == chosen else ""
                line.append(f"triton/{splits}{mark} " + timed(
                    lambda q, kc, vc, t, n, s=splits: triton_paged.paged_attention(q, kc, vc, t, n, scale, splits=s)))
        except Exception as e:  # noqa: BLE001 - the probe reports what fails
            line.append(f"triton: FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        print("  ".join(line), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sweep() if "--sweep" in sys.argv[1:] else main()
