"""A mini-batch split into micro-batches (and over DP ranks) gives the unsplit loss and gradients."""
import pytest
import torch
import torch.distributed as dist

from tests.algo.loss_inputs import AGG_MODES, LOSSES, differentiable_input, loss_batch, run_loss
from tests.multiproc import run_on_ranks
from verl_mcore.algo.aggregation import global_denominators

BATCH, LENGTH = 8, 9


def _trimmed(inputs: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """The rows of one micro-batch, right-padding cut to its own longest response (at least 1),
    as a padded micro-batch would be built: the result must not depend on that padding."""
    mask = inputs["mask"][rows]
    valid_cols = mask.any(dim=0).nonzero()
    width = int(valid_cols.max()) + 1 if len(valid_cols) else 1
    return {k: v[rows, :width] for k, v in inputs.items()}


def _split_loss(name, inputs, leaf, mode, num_micro, denoms, row_offset=0):
    """Sum of micro-batch contributions (loss and diagnostics) over `num_micro` equal row chunks.

    `leaf` is the [rows, T] differentiable input; gradients accumulate into it.
    """
    rows = inputs["mask"].shape[0]
    size = rows // num_micro
    total, diag_total = 0.0, {}
    for k in range(num_micro):
        sl = slice(k * size, (k + 1) * size)
        part = _trimmed(inputs, sl)
        width = part["mask"].shape[1]
        loss, diag = run_loss(name, part, leaf[sl, :width], denoms, mode)
        total = total + loss
        for key_d, v in diag.items():
            diag_total[key_d] = diag_total.get(key_d, 0.0) + v
    return total, diag_total


def _full(name, mode, seed):
    inputs = loss_batch(seed, BATCH, LENGTH)
    leaf = inputs[differentiable_input(name)].clone().requires_grad_(True)
    loss, diag = run_loss(name, inputs, leaf, global_denominators(inputs["mask"]), mode)
    loss.backward()
    return inputs, loss.detach(), {k: v.detach() for k, v in diag.items()}, leaf.grad


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_microbatch_split_matches_full_batch(name, mode):
    inputs, full_loss, full_diag, full_grad = _full(name, mode, seed=0)
    denoms = global_denominators(inputs["mask"])
    for num_micro in (1, 2, 4):
        leaf = inputs[differentiable_input(name)].clone().requires_grad_(True)
        loss, diag = _split_loss(name, inputs, leaf, mode, num_micro, denoms)
        loss.backward()
        msg = f"{name} {mode} split into {num_micro}"
        torch.testing.assert_close(loss.detach(), full_loss, rtol=0, atol=1e-9, msg=msg)
        torch.testing.assert_close(leaf.grad, full_grad, rtol=0, atol=1e-9, msg=msg)
        for k, v in full_diag.items():
            torch.testing.assert_close(diag[k], v, rtol=0, atol=1e-9, msg=f"{msg}: {k}")


def _ranks_body(rank, world_size, dp_reduce):
    """Each rank holds half the rows, splits them into 2 micro-batches, and reduces as DP would.

    A shared scalar `w` enters every differentiable input (x + w * feature), standing in for model
    parameters: its gradient, reduced over ranks, must equal the unsplit gradient.
    """
    out = {}
    for name in LOSSES:
        for mode in AGG_MODES:
            inputs = loss_batch(0, BATCH, LENGTH)
            per_rank = BATCH // world_size
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            local = {k: v[rows] for k, v in inputs.items()}
            denoms = global_denominators(local["mask"], group=dist.group.WORLD, norm_len=LENGTH,
                                         dp_reduce=dp_reduce)
            w = torch.zeros((), dtype=torch.float64, requires_grad=True)
            feature = torch.linspace(-1, 1, LENGTH, dtype=torch.float64).expand(per_rank, LENGTH)
            leaf = local[differentiable_input(name)] + w * feature
            loss, diag = _split_loss(name, local, leaf, mode, 2, denoms)
            loss.backward()
            # Loss and diagnostics are reduced over DP exactly like the gradient.
            reduced = torch.stack([loss.detach(), w.grad] + [diag[k] for k in sorted(diag)])
            dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
            if dp_reduce == "mean":  # gloo has no AVG: sum, then divide, as an averaging DDP does
                reduced /= world_size
            out[(name, mode)] = reduced.tolist()
    return out


def _expected(name, mode):
    inputs = loss_batch(0, BATCH, LENGTH)
    w = torch.zeros((), dtype=torch.float64, requires_grad=True)
    feature = torch.linspace(-1, 1, LENGTH, dtype=torch.float64).expand(BATCH, LENGTH)
    leaf = inputs[differentiable_input(name)] + w * feature
    loss, diag = run_loss(name, inputs, leaf, global_denominators(inputs["mask"], norm_len=LENGTH), mode)
    loss.backward()
    return [loss.item(), w.grad.item()] + [diag[k].item() for k in sorted(diag)]


@pytest.mark.distributed
@pytest.mark.parametrize("dp_reduce", ["sum", "mean"])
def test_two_gloo_ranks_match_full_batch(dp_reduce):
    results = run_on_ranks(_ranks_body, world_size=2, args=(dp_reduce,), timeout=120)
    for (name, mode), got in results[0].items():
        assert results[1][(name, mode)] == got, "ranks disagree after the all-reduce"
        want = _expected(name, mode)
        assert len(got) == len(want)
        for g, e in zip(got, want):
            assert abs(g - e) <= 1e-9, f"{name} {mode} dp_reduce={dp_reduce}: {got} vs {want}"
