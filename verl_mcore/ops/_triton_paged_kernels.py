"""The Triton kernels of ops/triton_paged.py (see its docstring). Imported only when they are
first used (triton_paged._kernels): Triton need not be installed for the rest of verl_mcore, and
TRITON_INTERPRET, read when `triton.jit` decorates, can be set before."""
import triton
import triton.language as tl


@triton.jit
def share_of(first, last, s, SPLITS: tl.constexpr, BN: tl.constexpr):
    """Keys [start, end) of split s of the keys [first, last): equal shares of whole tiles."""
    share = tl.cdiv(tl.cdiv(last - first, SPLITS), BN) * BN
    start = first + s * share
    return start, tl.minimum(start + share, last)

@triton.jit
def attend(q, k_ptr, v_ptr, table_row_ptr, g, start, end, scale_log2, ROWS: tl.constexpr,
           GROUPS: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, BN: tl.constexpr):
    """(max, sum, unnormalised acc) of the query rows q [ROWS, HD] over keys [start, end) of KV
    group g, each key's cache row looked up in one block-table row: an online softmax in base
    2 over tiles of BN keys, q kᵀ and p v as tl.dot."""
    d = tl.arange(0, HD)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HD], tl.float32)
    for n0 in range(start, end, BN):
        pos = n0 + tl.arange(0, BN)
        valid = pos < end
        page = tl.load(table_row_ptr + pos // PAGE, mask=valid, other=0)
        row = page.to(tl.int64) * PAGE + pos % PAGE
        off = (row * GROUPS + g)[:, None] * HD + d[None, :]
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k)) * scale_log2  # [ROWS, BN], fp32
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: the tile holds a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc

@triton.jit
def store_partial(acc_ptr, ml_ptr, base, m_i, l_i, acc, live, HD: tl.constexpr):
    d = tl.arange(0, HD)
    tl.store(acc_ptr + base[:, None] * HD + d[None, :], acc, mask=live[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=live)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=live)

@triton.jit
def partial(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, first_ptr, acc_ptr, ml_ptr, scale_log2, width,
            HEADS: tl.constexpr, GROUPS: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
            HD: tl.constexpr, PAGE: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
            HAS_FIRST: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    first = tl.load(first_ptr + b) if HAS_FIRST else 0  # keys before it: a shared prefix's
    start, end = share_of(first, tl.load(lens_ptr + b), s, SPLITS, BN)
    rows = tl.arange(0, R_PAD)
    head = g * R + rows
    live = rows < R
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (b * HEADS + head)[:, None] * HD + d[None, :], mask=live[:, None], other=0.0)
    m_i, l_i, acc = attend(q, k_ptr, v_ptr, table_ptr + b.to(tl.int64) * width, g, start, end, scale_log2,
                           R_PAD, GROUPS, HD, PAGE, BN)
    store_partial(acc_ptr, ml_ptr, (b * HEADS + head) * SPLITS + s, m_i, l_i, acc, live, HD)

@triton.jit
def prefix_partial(q_ptr, k_ptr, v_ptr, table_ptr, members_ptr, plen_ptr, acc_ptr, ml_ptr, scale_log2,
                   width, HEADS: tl.constexpr, GROUPS: tl.constexpr, R: tl.constexpr, N_MAX: tl.constexpr,
                   ROWS_PAD: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, BN: tl.constexpr,
                   SPLITS: tl.constexpr):
    """The first plen keys that the member sequences of one prefix group share (the same
    blocks, read from the first member's table), for the r query heads of every member as
    the rows of one tile: each shared K/V row is read once for the whole group."""
    grp = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    start, end = share_of(0, tl.load(plen_ptr + grp), s, SPLITS, BN)  # plen 0: no group in this row
    rows = tl.arange(0, ROWS_PAD)
    member = rows // R
    inside = member < N_MAX
    slot = tl.load(members_ptr + grp * N_MAX + member, mask=inside, other=-1)
    live = inside & (slot >= 0)
    slot = tl.where(live, slot, 0)
    head = g * R + rows % R
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (slot * HEADS + head)[:, None] * HD + d[None, :], mask=live[:, None], other=0.0)
    lead = tl.load(members_ptr + grp * N_MAX)
    lead = tl.where(lead >= 0, lead, 0)
    m_i, l_i, acc = attend(q, k_ptr, v_ptr, table_ptr + lead.to(tl.int64) * width, g, start, end, scale_log2,
                           ROWS_PAD, GROUPS, HD, PAGE, BN)
    store_partial(acc_ptr, ml_ptr, (slot * HEADS + head) * SPLITS + s, m_i, l_i, acc, live, HD)

@triton.jit
def combine(acc_ptr, ml_ptr, pacc_ptr, pml_ptr, first_ptr, out_ptr, HEADS: tl.constexpr, HD: tl.constexpr,
            SPLITS: tl.constexpr, S_PAD: tl.constexpr, HAS_PREFIX: tl.constexpr):
    """out = the log-sum-exp combine of a head's split partials (and, with a shared prefix,
    of its prefix group's), normalised."""
    bh = tl.program_id(0)  # sequence * heads + head
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, HD)
    have = s < SPLITS
    m = tl.load(ml_ptr + (bh * SPLITS + s) * 2, mask=have, other=float("-inf"))
    l = tl.load(ml_ptr + (bh * SPLITS + s) * 2 + 1, mask=have, other=0.0)
    acc = tl.load(acc_ptr + (bh * SPLITS + s)[:, None] * HD + d[None, :], mask=have[:, None], other=0.0)
    if HAS_PREFIX:
        prefixed = tl.load(first_ptr + bh // HEADS) > 0  # else its prefix partials were not written
        pm = tl.load(pml_ptr + (bh * SPLITS + s) * 2, mask=have & prefixed, other=float("-inf"))
        pl = tl.load(pml_ptr + (bh * SPLITS + s) * 2 + 1, mask=have & prefixed, other=0.0)
        pacc = tl.load(pacc_ptr + (bh * SPLITS + s)[:, None] * HD + d[None, :], mask=(have & prefixed)[:, None],
                       other=0.0)
        top = tl.maximum(tl.max(m, 0), tl.max(pm, 0))
        w = tl.where(l > 0, tl.exp2(m - top), 0.0)
        pw = tl.where(pl > 0, tl.exp2(pm - top), 0.0)
        num = tl.sum(acc * w[:, None], 0) + tl.sum(pacc * pw[:, None], 0)
        den = tl.sum(l * w, 0) + tl.sum(pl * pw, 0)
    else:
        top = tl.max(m, 0)
        w = tl.where(l > 0, tl.exp2(m - top), 0.0)  # empty shares (and no keys at all) weigh 0
        num = tl.sum(acc * w[:, None], 0)
        den = tl.sum(l * w, 0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out_ptr + bh * HD + d, out.to(out_ptr.dtype.element_ty))
