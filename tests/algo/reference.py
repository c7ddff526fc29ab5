"""Slow references for tests/algo, written from the formulas with Python loops over floats.

Deliberately different in form from the library: GAE is the explicit sum over future valid
tokens, sums go through Python floats (float64), and group statistics scan the batch per row.
Inputs are torch tensors; outputs are nested Python lists or floats.
"""
from __future__ import annotations

import math

import torch


def rows(x: torch.Tensor) -> list[list[float]]:
    return x.detach().to(torch.float64).tolist()


def valid_positions(mask_row: list[float]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m != 0]


def random_batch(seed: int, batch: int = 8, length: int = 9) -> dict[str, torch.Tensor]:
    """Random float64 inputs with the awkward masks every check must survive.

    Row 0 has no valid token, row 1 a single one, row 2 holes in the middle of its response, the
    rest random lengths (some full) with random holes. Values and rewards at masked positions are
    NaN so that any read of them shows up. Groups: {0, 1, 2} mixed, {3} alone (size 1), {4, 5}
    with identical scores, the rest in random groups; the group ids are arbitrary integers.
    """
    assert batch >= 6 and length >= 6
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[1, 0] = True
    mask[2, :6] = torch.tensor([1, 1, 0, 0, 1, 1], dtype=torch.bool)
    for i in range(3, batch):
        n = int(torch.randint(1, length + 1, (1,), generator=g))
        mask[i, :n] = True
        holes = torch.rand(length, generator=g) < 0.2
        holes[0] = False
        mask[i] &= ~holes
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.1
    # An outcome reward on each row's last valid token, like a verifier score.
    for i in range(batch):
        pos = valid_positions(mask[i].tolist())
        if pos:
            rewards[i, pos[-1]] += float(torch.randint(0, 2, (1,), generator=g))
    ids = [11, 11, 11, -4, 7, 7] + [int(x) for x in torch.randint(100, 103, (batch - 6,), generator=g)]
    scores = torch.randn(batch, generator=g, dtype=torch.float64)
    scores[5] = scores[4]
    nan = float("nan")
    return {
        "mask": mask,
        "values": values.masked_fill(~mask, nan),
        "rewards": rewards.masked_fill(~mask, nan),
        "group_ids": torch.tensor(ids, dtype=torch.long),
        "scores": scores,
        "baseline_scores": torch.randn(batch, generator=g, dtype=torch.float64),
    }


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def gae(rewards, values, mask, gamma, lam):
    """A at the j-th valid token = sum_k (gamma*lam)^(k-j) * delta_k over the row's valid tokens,
    delta_k = r_k + gamma * V_{k+1} - V_k with V past the last valid token = 0."""
    adv, ret = [], []
    for r, v, m in zip(rows(rewards), rows(values), rows(mask)):
        pos = valid_positions(m)
        a_row, g_row = [0.0] * len(m), [0.0] * len(m)
        deltas = []
        for k, t in enumerate(pos):
            v_next = v[pos[k + 1]] if k + 1 < len(pos) else 0.0
            deltas.append(r[t] + gamma * v_next - v[t])
        for j, t in enumerate(pos):
            a = sum((gamma * lam) ** (k - j) * deltas[k] for k in range(j, len(pos)))
            a_row[t] = a
            g_row[t] = a + v[t]
        adv.append(a_row)
        ret.append(g_row)
    return adv, ret


def discounted_returns(rewards, mask, gamma):
    out = []
    for r, m in zip(rows(rewards), rows(mask)):
        pos = valid_positions(m)
        row = [0.0] * len(m)
        for j, t in enumerate(pos):
            row[t] = sum(gamma ** (k - j) * r[pos[k]] for k in range(j, len(pos)))
        out.append(row)
    return out


def whiten(x: list[list[float]], mask) -> list[list[float]]:
    m = rows(mask)
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if m[i][t] != 0]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((u - mean) ** 2 for u in vals) / (n - 1)
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [[(x[i][t] - mean) * scale if m[i][t] != 0 else 0.0 for t in range(len(x[i]))] for i in range(len(x))]


def _group(ids: list[int], i: int) -> list[int]:
    return [j for j in range(len(ids)) if ids[j] == ids[i]]


def _broadcast(per_seq: list[float], mask) -> list[list[float]]:
    return [[a if mm != 0 else 0.0 for mm in m] for a, m in zip(per_seq, rows(mask))]


def grpo(scores, group_ids, mask, norm_by_std=True, eps=1e-6):
    s, ids = scores.tolist(), group_ids.tolist()
    adv = []
    for i in range(len(s)):
        members = [s[j] for j in _group(ids, i)]
        n = len(members)
        if n == 1:
            adv.append(0.0)
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((u - mean) ** 2 for u in members) / (n - 1))
        adv.append((s[i] - mean) / (std + eps) if norm_by_std else s[i] - mean)
    return _broadcast(adv, mask)


def rloo(scores, group_ids, mask):
    s, ids = scores.tolist(), group_ids.tolist()
    adv = []
    for i in range(len(s)):
        others = [s[j] for j in _group(ids, i) if j != i]
        adv.append(s[i] - sum(others) / len(others) if others else 0.0)
    return _broadcast(adv, mask)


def sequence_scores(rewards, mask) -> list[float]:
    return [sum(r[t] for t in valid_positions(m)) for r, m in zip(rows(rewards), rows(mask))]


def reinforce_plus_plus_baseline(rewards, group_ids, mask):
    s, ids = sequence_scores(rewards, mask), group_ids.tolist()
    centred = []
    for i in range(len(s)):
        members = [s[j] for j in _group(ids, i)]
        centred.append(s[i] - sum(members) / len(members))
    return whiten(_broadcast(centred, mask), mask)


def remax(rewards, baseline_scores, mask):
    ret = discounted_returns(rewards, mask, 1.0)
    b = baseline_scores.tolist()
    m = rows(mask)
    adv = [[ret[i][t] - b[i] if m[i][t] != 0 else 0.0 for t in range(len(m[i]))] for i in range(len(m))]
    return adv, ret


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def aggregate(loss: list[list[float]], mask, mode: str, norm_len: float) -> float:
    """The mini-batch loss of each mode over the whole (unsplit) batch."""
    m = rows(mask)
    per_seq = []  # (sum of token losses, token count) of rows with a valid token
    for lrow, mrow in zip(loss, m):
        pos = valid_positions(mrow)
        if pos:
            per_seq.append((sum(lrow[t] for t in pos), len(pos)))
    if not per_seq:
        return 0.0
    n_tok = sum(n for _, n in per_seq)
    n_seq = len(per_seq)
    if mode == "token-mean":
        return sum(s for s, _ in per_seq) / n_tok
    if mode == "seq-mean-token-sum":
        return sum(s for s, _ in per_seq) / n_seq
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in per_seq) / n_seq
    if mode == "seq-mean-token-sum-norm":
        return sum(s / norm_len for s, _ in per_seq) / n_seq
    raise ValueError(mode)


def token_weights(mask, mode: str, norm_len: float) -> list[list[float]]:
    """d(mini-batch loss)/d(l_it) of each mode: the weight of every token's loss."""
    m = rows(mask)
    counts = [len(valid_positions(r)) for r in m]
    n_tok = sum(counts)
    n_seq = sum(1 for c in counts if c > 0)
    out = []
    for mrow, c in zip(m, counts):
        if mode == "token-mean":
            w = 1.0 / n_tok
        elif mode == "seq-mean-token-sum":
            w = 1.0 / n_seq
        elif mode == "seq-mean-token-mean":
            w = 1.0 / (max(c, 1) * n_seq)
        else:
            w = 1.0 / (n_seq * norm_len)
        out.append([w if mm != 0 else 0.0 for mm in mrow])
    return out


def token_mean(x: list[list[float]], mask) -> float:
    m = rows(mask)
    vals = [x[i][t] for i in range(len(m)) for t in valid_positions(m[i])]
    return sum(vals) / len(vals) if vals else 0.0


def ppo_tokens(logp, old_logp, adv, lo, hi, c):
    """Per-token (loss, clipped?, dual-clip active?) of PPO with dual clip."""
    loss, clipped, lower = [], [], []
    for lp_row, olp_row, a_row in zip(rows(logp), rows(old_logp), rows(adv)):
        lrow, crow, drow = [], [], []
        for lp, olp, a in zip(lp_row, olp_row, a_row):
            ratio = math.exp(min(max(lp - olp, -20.0), 20.0))
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - lo), 1 + hi)
            c1 = max(l1, l2)
            dual = -a * c
            value = min(c1, dual) if a < 0 else c1
            lrow.append(value)
            crow.append(1.0 if l2 > l1 else 0.0)
            drow.append(1.0 if (a < 0 and c1 > dual) else 0.0)
        loss.append(lrow)
        clipped.append(crow)
        lower.append(drow)
    return loss, clipped, lower


def gspo_tokens(logp, old_logp, adv, mask, lo, hi):
    """Per-token (loss, clipped?, d loss / d logp) of GSPO with the sequence-level ratio."""
    loss, clipped, grad = [], [], []
    for lp_row, olp_row, a_row, m_row in zip(rows(logp), rows(old_logp), rows(adv), rows(mask)):
        pos = valid_positions(m_row)
        log_s = sum(lp_row[t] - olp_row[t] for t in pos) / max(len(pos), 1)
        s = math.exp(min(log_s, 10.0))  # verl's clamp: above only, and no gradient past it
        lrow, crow, grow = [], [], []
        for a in a_row:
            u = -a * s
            cl = -a * min(max(s, 1 - lo), 1 + hi)
            lrow.append(max(u, cl))
            crow.append(1.0 if cl > u else 0.0)
            # Gradient through s_it = s * exp(logp - sg(logp)) is d/dlogp = s, only where the
            # unclipped term is the one that counts (inside the range they coincide).
            inside = 1 - lo <= s <= 1 + hi
            grow.append(-a * s if (inside or u >= cl) and log_s <= 10.0 else 0.0)
        loss.append(lrow)
        clipped.append(crow)
        grad.append(grow)
    return loss, clipped, grad


def value_tokens(values, old_values, returns, eps):
    loss, clipped = [], []
    for v_row, o_row, r_row in zip(rows(values), rows(old_values), rows(returns)):
        lrow, crow = [], []
        for v, o, r in zip(v_row, o_row, r_row):
            vc = o + min(max(v - o, -eps), eps)
            u, c = (v - r) ** 2, (vc - r) ** 2
            lrow.append(0.5 * max(u, c))
            crow.append(1.0 if c > u else 0.0)
        loss.append(lrow)
        clipped.append(crow)
    return loss, clipped


def kl_tokens(logp, ref_logp, kind: str) -> list[list[float]]:
    out = []
    for lp_row, rp_row in zip(rows(logp), rows(ref_logp)):
        row = []
        for lp, rp in zip(lp_row, rp_row):
            d = lp - rp
            if kind == "k1":
                row.append(d)
            elif kind == "abs":
                row.append(abs(d))
            elif kind == "k2":
                row.append(0.5 * d * d)
            else:  # k3: E_pi[ratio_ref/pi - 1 - log(ratio_ref/pi)], clamped
                x = min(max(-d, -20.0), 20.0)
                row.append(min(max(math.exp(x) - x - 1, -10.0), 10.0))
        out.append(row)
    return out
