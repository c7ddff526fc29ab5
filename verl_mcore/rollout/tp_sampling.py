"""Token sampling from vocab-parallel logits, without gathering them.

`sample_vocab_parallel` draws what `sampling.sample` draws on the gathered logits (same uniform u
per sequence, same CDF order), but each rank of the TP group reads only its own shard
[b, V_local] and the ranks exchange a few numbers per row, never [b, V]. Per call, for b rows
over TP ranks (collectives are over the TP group; sizes in float64/int64 numbers):

    every call   all-gather of each shard's (max, sum exp(z - max), first argmax)    TP x 3b
    greedy       nothing more: the largest max wins, ties to the lowest rank (lowest id)
    T > 0, no top-k / top-p (vocabulary-order CDF): the shard whose mass interval holds u * Z
                 inverts its own CDF; one all-reduce of (token, z), zeros elsewhere    2b
    top-k        all-gather of each shard's k best order keys; every rank merges them and
                 applies top-p (if set) to the merged k                                 TP x kb
    top-p alone  two searches over the sampling order (below): the end of the nucleus, then
                 the token at u * its mass; a round is one all-reduce of the mass
                 before _CUTS cut points, ceil((32 + id bits) / 8) rounds per search   _CUTS x b
                 (a 152k vocabulary: 18 id bits, 7 rounds, so 14 all-reduces of 256b)

The sampling order (descending probability) is encoded as one int64 key per token: the float32
scaled logit's order-preserving bits (descending) above the token id (ascending). Keys are unique,
so `topk` and sorts over them are deterministic, a key carries its token and logit, and the
top-p searches are bisections over integers: "the first cut c whose preceding mass reaches X",
with 256 cut points per round (radix-256 search over the key space).

Equality with `sample` on the gathered logits. Every rank returns the same tokens and log-probs
(each decision is taken on all-gathered or all-reduced numbers, or by one rank and all-reduced).
Greedy tokens are exactly torch.argmax's. Sampled tokens: the masses here are float64 (exp, sums,
cumulative sums), `sample`'s float32 in another summation order, so the two agree except where
u * Z falls within float32 rounding (~1e-7 relative, more over long CDFs) of a boundary between
two tokens' CDF intervals. Tokens whose float32 probabilities tie are ordered here by scaled
logit, then id; `sample` orders them as torch.topk / sort happen to (the same CDF, other
interval order): the draws can differ only where u lands in such a tied group. Log-probs are
computed in float64 and rounded to float32: within float32 rounding of `token_logprobs`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_mcore.rollout.sampling import _invert_cdf, _search

_CUTS = 256  # cut points per round of the top-p searches: 8 bits of the key per all-reduce
_SIGN = 0x7FFFFFFF


def sample_vocab_parallel(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                          u: Optional[torch.Tensor], *, vocab_size: int, group,
                          logprobs: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Tokens [b] (int64) and, if `logprobs`, log softmax(logits / T)[token] [b] (float32; T = 1
    for greedy), on every rank of `group`, from this rank's shard logits [b, V_local].

    The shards are megatron's vocab-parallel layout: rank r of `group` holds ids
    [r * V_local, (r + 1) * V_local); ids >= vocab_size (padding) get no mass. temperature,
    top_p, top_k and u [b] (float64 uniforms; None for greedy) as for `sampling.sample`.
    """
    width = logits.shape[-1]
    first = dist.get_rank(group) * width
    ids = torch.arange(first, first + width, device=logits.device)
    # The scaled logits exactly as `sample` computes them (float32); + 0.0 turns -0.0 into +0.0
    # (equal probabilities: the order keys must not tell them apart).
    z = logits.float() if temperature in (0.0, 1.0) else logits.float() / temperature
    z = z.masked_fill(ids >= vocab_size, float("-inf")) + 0.0
    top, shard_max, shard_mass, shard_argmax = _gather_stats(z, ids, group)
    total = shard_mass.sum(dim=-1)  # Z [b], the shards in rank (= vocabulary) order
    k = top_k if 0 < top_k < vocab_size else vocab_size
    if temperature == 0.0:
        # torch.argmax takes the first maximum: the lowest rank among the shards that hold it.
        tokens = shard_argmax.gather(-1, shard_max.argmax(dim=-1, keepdim=True)).squeeze(-1)
        z_tok = top
    elif k == vocab_size and top_p >= 1.0:
        tokens, z_tok = _invert_vocab_order(z, ids, top, shard_mass, u, group)
    elif k < vocab_size:
        tokens, z_tok = _top_k(z, ids, top, total, u, k, top_p, vocab_size, group)
    else:
        tokens, z_tok = _top_p(z, ids, top, total, u, top_p, vocab_size, group)
    if not logprobs:
        return tokens, None
    return tokens, (z_tok - top - total.log()).float()


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """x [..., n] from every rank -> [..., TP * n], rank-major along the last dim."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _gather_stats(z: torch.Tensor, ids: torch.Tensor, group):
    """One all-gather of each shard's (max, sum exp(z - max), first argmax id) -> the global
    max [b] (float64; every mass is exp(z - it)) and, per row and shard [b, TP], the shard's max,
    its mass sum exp(z - global max) and its argmax id (int64)."""
    j = z.argmax(dim=-1, keepdim=True)  # the first maximum, as torch.argmax on the full row
    m = z.gather(-1, j).double()  # [b, 1]
    base = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # -inf: a padding-only shard
    mass = torch.exp(z.double() - base).sum(dim=-1, keepdim=True)
    everyone = _all_gather(torch.stack([m, mass, ids[j].double()]), group)  # [3, b, TP]
    shard_max, shard_mass, shard_argmax = everyone.unbind(0)
    top = shard_max.max(dim=-1).values
    shard_mass = shard_mass * torch.exp(shard_max - top.unsqueeze(-1))  # exp(-inf) = 0: no mass
    return top, shard_max, shard_mass, shard_argmax.long()


def _invert_vocab_order(z, ids, top, shard_mass, u, group):
    """The vocabulary-order CDF at u * Z: the first shard whose cumulative mass passes it inverts
    its own part; one all-reduce hands (token, z) from that shard to every rank."""
    rank = dist.get_rank(group)
    upto = shard_mass.cumsum(dim=-1)  # [b, TP]: mass of the shards 0..r
    target = u.to(upto) * upto[:, -1]
    owner = _search(upto, target)  # never a shard without mass
    before = upto[:, rank - 1] if rank > 0 else torch.zeros_like(target)
    cdf = torch.exp(z.double() - top.unsqueeze(-1)).cumsum(dim=-1)  # [b, V_local]
    # Where rounding puts the target past this shard's own total, _search takes its last token
    # with mass.
    j = _search(cdf, target - before).unsqueeze(-1)
    picked = torch.stack([ids[j.squeeze(-1)].double(), z.gather(-1, j).squeeze(-1).double()])
    picked = torch.where(owner == rank, picked, torch.zeros_like(picked))  # [2, b]
    dist.all_reduce(picked, group=group)
    return picked[0].long(), picked[1]


def _top_k(z, ids, top, total, u, k, top_p, vocab_size, group):
    """The k first tokens of the sampling order are among the shards' own k first: all-gather
    those keys [b, TP * k], merge, then truncate to top_p and invert as `sample` does."""
    keys = _order_keys(z, ids, vocab_size)
    mine = keys.topk(min(k, keys.shape[-1]), dim=-1, largest=False).values
    # Padding keys sort last, and the real ones among the candidates are at least k.
    best = _all_gather(mine, group).topk(k, dim=-1, largest=False).values  # [b, k] in order
    tokens, z_best = _decode(best, vocab_size)
    mass = torch.exp(z_best - top.unsqueeze(-1))
    if top_p < 1.0:
        before = mass.cumsum(dim=-1) - mass
        mass = mass.masked_fill(before >= top_p * total.unsqueeze(-1), 0.0)
    pick = _invert_cdf(mass.cumsum(dim=-1), u).unsqueeze(-1)
    return tokens.gather(-1, pick).squeeze(-1), z_best.gather(-1, pick).squeeze(-1)


def _top_p(z, ids, top, total, u, top_p, vocab_size, group):
    """Top-p over the whole vocabulary, as two searches over cuts c of the key space, with
    F(c) = the mass of the tokens whose key < c (monotone in c):

        nucleus mass P = F(first c with F(c) >= top_p * Z)   (its last token's mass crosses top_p)
        token          = the key c - 1 for the first c with F(c) > u * P
    """
    keys, order = _order_keys(z, ids, vocab_size).sort(dim=-1)
    mass = torch.exp(z.double() - top.unsqueeze(-1)).gather(-1, order)
    cum = F.pad(mass.cumsum(dim=-1), (1, 0))  # [b, V_local + 1]: mass of this shard's j first

    def mass_before(cuts: torch.Tensor) -> torch.Tensor:
        """F at cuts [b, n], summed over the shards."""
        before = cum.gather(-1, torch.searchsorted(keys, cuts))
        dist.all_reduce(before, group=group)
        return before

    key_bits = 32 + _id_bits(vocab_size)
    _, nucleus = _first_cut(mass_before, top_p * total, key_bits, strict=False)
    # u < 1, but u * P may round to P: the target stays below P, so the token is the nucleus's
    # last one with mass at most (never one after it, never a token without mass).
    below = torch.nextafter(nucleus, torch.zeros_like(nucleus))
    target = torch.minimum(u.to(nucleus) * nucleus, below)
    cut, _ = _first_cut(mass_before, target, key_bits, strict=True)
    return _decode(cut - 1, vocab_size)


def _first_cut(mass_before, target: torch.Tensor, key_bits: int, strict: bool):
    """Per row, the first cut c in [1, 2**key_bits] with F(c) >= target (> if strict), and F(c):
    radix-_CUTS bisection, one `mass_before` call (one all-reduce) per 8 bits. 2**key_bits (no
    key reaches it) when no cut reaches the target."""
    # F(0) = 0 misses every target here: top_p * Z > 0 (for >=), u * P >= 0 (for >).
    lo = torch.zeros_like(target, dtype=torch.long)
    size, at = 1 << key_bits, None
    steps = torch.arange(1, _CUTS + 1, device=target.device)
    while size > 1:
        step = max(size // _CUTS, 1)
        cuts = lo.unsqueeze(-1) + step * steps[: size // step]  # the last one is lo + size
        f = mass_before(cuts)
        reached = f > target.unsqueeze(-1) if strict else f >= target.unsqueeze(-1)
        j = (~reached).sum(dim=-1, keepdim=True).clamp(max=cuts.shape[-1] - 1)
        at = f.gather(-1, j).squeeze(-1)
        lo, size = lo + j.squeeze(-1) * step, step  # the cut sought is in (lo, lo + size]
    return lo + 1, at


def _id_bits(vocab_size: int) -> int:
    return max(1, (vocab_size - 1).bit_length())


def _order_keys(z: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 keys [b, V_local] whose ascending order is the sampling order: z (float32) falling,
    then the id rising. Key = (order of z's bits, descending) << id bits | id; padding ids get
    2**(32 + id bits), after every real key."""
    id_bits = _id_bits(vocab_size)
    bits = z.view(torch.int32).long()
    rising = torch.where(bits < 0, bits ^ _SIGN, bits)  # sign-magnitude -> rising with z
    keys = ((_SIGN - rising) << id_bits) | ids  # _SIGN - rising in [0, 2**32)
    return keys.masked_fill(ids >= vocab_size, 1 << (32 + id_bits))


def _decode(keys: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order keys -> (token ids int64, their z as float64)."""
    id_bits = _id_bits(vocab_size)
    rising = _SIGN - (keys >> id_bits)
    bits = torch.where(rising < 0, rising ^ _SIGN, rising)
    return keys & ((1 << id_bits) - 1), bits.int().view(torch.float32).double()
