"""Shared cases of tests/ops/test_triton_paged.py (on a GPU) and triton_paged_body.py (the CPU
interpreter)."""
import torch

from verl_mcore.ops import decode, triton_paged


# Cascade: sequences 0-6 share their first 3 blocks (at r = 12 more than the 5 members a group
# holds: two rows of the member table; one row at r <= 9), 7-8 their first block, 9 nothing;
# lengths from just past the prefix to the whole table.
def cascade_case(dtype, heads=24, groups=2, hd=32, page=16, width=6, splits=2, device="cpu"):
    """The largest difference of triton_paged.paged_attention with a cascade from the reference."""
    r = heads // groups
    n_max = triton_paged.cascade_members(r)
    b = 10
    g = torch.Generator().manual_seed(splits or 0)
    blocks = iter(torch.randperm(b * width, generator=g).add(1).tolist())
    shared = {0: [next(blocks) for _ in range(3)], 7: [next(blocks)]}
    table = torch.zeros(b, width, dtype=torch.int32)
    for i in range(b):
        lead = shared[0] if i < 7 else shared[7] if i < 9 else []
        table[i] = torch.tensor(lead + [next(blocks) for _ in range(width - len(lead))], dtype=torch.int32)
    kc = torch.randn(b * width + 1, page, groups, hd, generator=g).to(device, dtype)
    vc = torch.randn(b * width + 1, page, groups, hd, generator=g).to(device, dtype)
    lens = torch.randint(3 * page + 1, width * page + 1, (b,), dtype=torch.int32, generator=g)
    lens[0] = 3 * page + 1
    # rows of at most n_max members: 0-6 in one row or several (r = 12: 5 and 2), then 7-8
    rows = [(list(range(i, min(7, i + n_max))), 3 * page) for i in range(0, 7, n_max)] + [([7, 8], page)]
    members = torch.full((b, n_max), -1, dtype=torch.int32)
    plen = torch.zeros(b, dtype=torch.int32)
    for row, (chunk, keys) in enumerate(rows):
        members[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.int32)
        plen[row] = keys
    first = torch.tensor([3 * page] * 7 + [page] * 2 + [0], dtype=torch.int32)
    q = torch.randn(b, heads, hd, generator=g).to(device, dtype)
    table, lens, members, plen, first = (t.to(device) for t in (table, lens, members, plen, first))
    got = triton_paged.paged_attention(q, kc, vc, table, lens, hd ** -0.5, splits=splits,
                                       cascade=(members, plen, first))
    want = decode.paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5)
    return (got.float() - want.float()).abs().max().item()


