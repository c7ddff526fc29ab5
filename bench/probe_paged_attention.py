"""Does this torch's flash attention read a paged KV cache, and at which block sizes?

    python bench/probe_paged_attention.py

Calls `torch.ops.aten._flash_attention_forward` with `block_table` (cache [blocks, block, groups,
hd], one query token per sequence, `seqused_k` keys each) for a few block sizes, against a dense
reference; then times the paged call against the contiguous-slot call at a decode shape (128
sequences x 2,048 keys, Qwen2.5-1.5B's 12 heads / 2 KV groups / hd 128) and against the bytes
of K/V it must read at the copy bandwidth. Prints one line per check.
"""
from __future__ import annotations

import torch


def reference(q, kc, vc, table, used, scale):
    b, heads, hd = q.shape
    block, groups = kc.shape[1], kc.shape[2]
    out = torch.empty_like(q, dtype=torch.float32)
    for i in range(b):
        n = int(used[i])
        rows = table[i, : -(-n // block)].long()
        k = kc[rows].reshape(-1, groups, hd)[:n].float()
        v = vc[rows].reshape(-1, groups, hd)[:n].float()
        qg = q[i].view(groups, heads // groups, hd).float()
        s = torch.einsum("grd,ngd->grn", qg, k) * scale
        out[i] = torch.einsum("grn,ngd->grd", s.softmax(-1), v).reshape(heads, hd)
    return out


def paged(q, kc, vc, table, used, scale, splits=None):
    b = q.shape[0]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    max_k = table.shape[1] * kc.shape[1]
    kw = dict(scale=scale, seqused_k=used, block_table=table)
    if splits is not None:
        kw["num_splits"] = splits
    return torch.ops.aten._flash_attention_forward(q, kc, vc, cu_q, cu_q * max_k, 1, max_k, 0.0, False,
                                                   False, **kw)[0]


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
            err = (got - reference(q, kc, vc, table, used, scale)).abs().max().item()
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
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def timeit(fn, reps=50):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return sorted(ts)[len(ts) // 2]

    copy_ms = timeit(lambda: dst.copy_(src))
    bw = 2 * src.numel() / (copy_ms / 1e3)
    kv_bytes = 2 * b * keys * groups * hd * 2
    for label, fn in [("paged", lambda: paged(q, kc, vc, table, used, scale)),
                      ("contiguous slots", lambda: torch.ops.aten._flash_attention_forward(
                          q, kc.view(-1, groups, hd), vc.view(-1, groups, hd),
                          torch.arange(b + 1, dtype=torch.int32, device=dev),
                          torch.arange(b + 1, dtype=torch.int32, device=dev) * keys, 1, keys, 0.0, False, False,
                          scale=scale, seqused_k=used)[0])]:
        try:
            ms = timeit(fn)
            print(f"{label}: {ms * 1e3:.1f} us for {kv_bytes / 1e6:.1f} MB of K/V = "
                  f"{kv_bytes / (ms / 1e3) / bw:.0%} of the copy bandwidth ({bw / 1e12:.2f} TB/s)")
        except Exception as e:  # noqa: BLE001
            print(f"{label}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
