"""Batch statistics that span data-parallel ranks: whitening and the in-reward KL measurement."""
import pytest
import torch
import torch.distributed as dist

from tests.algo.loss_inputs import loss_batch
from tests.multiproc import run_on_ranks
from verl_mcore.algo.advantages import compute_advantages, masked_whiten
from verl_mcore.algo.kl import FixedKLController, apply_kl_penalty


def _local_rows(rank, world_size, batch):
    per_rank = batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _body(rank, world_size):
    b = loss_batch(3)
    rows = _local_rows(rank, world_size, b["mask"].shape[0])
    m, x = b["mask"][rows], b["values"][rows]
    whitened = masked_whiten(x, m, group=dist.group.WORLD)
    gae_adv, _ = compute_advantages("gae", b["advantages"][rows], m, values=x, gamma=0.9, lam=0.8,
                                    group=dist.group.WORLD)
    _, info = apply_kl_penalty(b["advantages"][rows], b["log_prob"][rows], b["ref_log_prob"][rows], m,
                               FixedKLController(0.1), "k3", group=dist.group.WORLD)
    return whitened, gae_adv, info["current_kl"]


@pytest.mark.distributed
def test_whitening_and_kl_statistics_span_ranks():
    results = run_on_ranks(_body, world_size=2, timeout=120)
    b = loss_batch(3)
    m = b["mask"]
    whitened = masked_whiten(b["values"], m)
    gae_adv, _ = compute_advantages("gae", b["advantages"], m, values=b["values"], gamma=0.9, lam=0.8)
    _, info = apply_kl_penalty(b["advantages"], b["log_prob"], b["ref_log_prob"], m, FixedKLController(0.1), "k3")
    for rank, (w, g, kl) in enumerate(results):
        rows = _local_rows(rank, 2, m.shape[0])
        torch.testing.assert_close(w, whitened[rows], rtol=0, atol=1e-12)
        torch.testing.assert_close(g, gae_adv[rows], rtol=0, atol=1e-12)
        assert abs(kl - info["current_kl"]) < 1e-12
