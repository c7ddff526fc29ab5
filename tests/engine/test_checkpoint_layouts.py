"""Real dist checkpoints on 2 gloo ranks: save at one layout, resume at another; async save.

The oracle is the run that did not stop: train 2 steps at TP=2, save, train the 3rd step there;
a run at another layout that loads the checkpoint and trains the 3rd step on the same batch must
give the same loss (≤1e-5; different TP sums in a different order). That checks model, optimizer
(Adam moments, step count) and LR schedule together: each of them changes step 3's loss.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os

import pytest
import torch

from tests.multiproc import run_on_ranks

TIMEOUT = 600


@contextlib.contextmanager
def _children_allowed():
    """Pool ranks are daemonic processes, which multiprocessing forbids to start children, and
    megatron's checkpoint writer starts some (a spawn Manager, forked writers). Real ranks
    (torchrun, srun, our subprocess script) are not daemonic."""
    config = multiprocessing.current_process()._config
    old = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = old


def _batches():
    from tests.distributed import tiny_gpt
    from tests.engine import checkpoint_trainer as ct

    return tiny_gpt.make_batches(seed=7, steps=3, global_batch=ct.GLOBAL_BATCH)


def _save_at_tp2(rank, world_size, root):
    from megatron.core import parallel_state

    from tests.engine import checkpoint_trainer as ct
    from verl_mcore.engine.checkpoint import Checkpointer

    ct.seed_everything(0)
    batches = _batches()
    chunks, optimizer, scheduler = ct.build(tp=2)
    losses = [ct.train_step(chunks, optimizer, scheduler, b) for b in batches[:2]]
    with _children_allowed():
        path = Checkpointer(root).save(2, chunks, optimizer, scheduler, {"step": 2})
    losses.append(ct.train_step(chunks, optimizer, scheduler, batches[2]))
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    return {"losses": losses, "path": path, "lr": optimizer.param_groups[0]["lr"]}


def _resume_at(rank, world_size, root, tp, pp):
    from megatron.core import parallel_state

    from tests.engine import checkpoint_trainer as ct
    from verl_mcore.engine.checkpoint import Checkpointer

    ct.seed_everything(0)
    chunks, optimizer, scheduler = ct.build(tp=tp, pp=pp)
    with _children_allowed():
        loaded = Checkpointer(root).load(chunks, optimizer, scheduler)
    assert parallel_state.get_pipeline_model_parallel_world_size() == pp
    loss = ct.train_step(chunks, optimizer, scheduler, _batches()[2])
    return {"loss": loss, "step": loaded.step, "extra": loaded.extra_state,
            "rng_restored": loaded.rng_restored, "lr": optimizer.param_groups[0]["lr"],
            "scheduler_steps": scheduler.num_steps}


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_tp2"))
    results = run_on_ranks(_save_at_tp2, 2, (root,), timeout=TIMEOUT)
    return root, results[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)], ids=["tp1_dp2", "pp2"])
def test_tp2_checkpoint_resumes_at_other_layouts(tp2_checkpoint, tp, pp):
    root, saved = tp2_checkpoint
    assert os.path.basename(saved["path"]) == "step_00000002"
    results = run_on_ranks(_resume_at, 2, (root, tp, pp), timeout=TIMEOUT)
    for r in results:
        assert r["step"] == 2 and r["extra"] == {"step": 2}
        assert r["rng_restored"] is False  # another layout: no rank has a counterpart
        assert r["scheduler_steps"] == 3
        assert r["lr"] == saved["lr"]
        assert abs(r["loss"] - saved["losses"][2]) <= 1e-5, (r["loss"], saved["losses"])
    # Not vacuous: step 3 differs from steps 1 and 2.
    assert abs(saved["losses"][2] - saved["losses"][1]) > 1e-4


def _async_save_then_load(rank, world_size, root):
    from tests.engine import checkpoint_trainer as ct
    from verl_mcore.engine import checkpoint

    ct.seed_everything(0)
    batches = _batches()
    chunks, optimizer, scheduler = ct.build()
    ct.train_step(chunks, optimizer, scheduler, batches[0])
    with _children_allowed():
        saver = checkpoint.Checkpointer(root, async_save=True)
        saver.save(1, chunks, optimizer, scheduler, {"step": 1})
        # Training goes on while the writer runs; the checkpoint must hold step-1 values.
        expected = {k: v.detach().clone() for k, v in chunks[0].module.state_dict().items()
                    if isinstance(v, torch.Tensor)}
        ct.train_step(chunks, optimizer, scheduler, batches[1])
        committed_early = checkpoint.find_latest_checkpoint(root)
        saver.close()
        committed = checkpoint.find_latest_checkpoint(root)
        fresh, fresh_opt, fresh_sched = ct.build()
        loaded = checkpoint.load_checkpoint(committed, fresh, fresh_opt, fresh_sched)
    got = fresh[0].module.state_dict()
    same = all(torch.equal(got[k], v) for k, v in expected.items())
    return {"early": committed_early, "committed": committed, "same": same, "step": loaded.step}


@pytest.mark.slow
def test_async_save_commits_on_finalize_with_values_of_its_step(tmp_path):
    results = run_on_ranks(_async_save_then_load, 2, (str(tmp_path),), timeout=TIMEOUT)
    for r in results:
        # A save is never visible before its commit (the writer may or may not have finished
        # before the check, but only maybe_finalize/close commits).
        assert r["early"] is None
        assert os.path.basename(r["committed"]) == "step_00000001"
        assert r["same"] and r["step"] == 1


def _two_roles_async_save_then_load(rank, world_size, root):
    """PPO's case: actor and critic, each with its Checkpointer as RunCheckpoints builds them,
    saved asynchronously at the same step, both writes in flight at once."""
    from tests.engine import checkpoint_trainer as ct
    from verl_mcore.engine import checkpoint

    ct.seed_everything(0)
    batches = _batches()
    roles = {}
    for name in ("actor", "critic"):
        # Models of different layouts (as actor and critic are): their write results differ.
        chunks, optimizer, scheduler = ct.build(bf16=name == "critic")
        ct.train_step(chunks, optimizer, scheduler, batches[0 if name == "actor" else 1])
        roles[name] = (chunks, optimizer, scheduler)
    out = {}
    with _children_allowed():
        savers = {name: checkpoint.Checkpointer(os.path.join(root, name), async_save=True) for name in roles}
        expected = {}
        for name in ("critic", "actor"):  # RunCheckpoints' order; the critic's writes end first
            chunks, optimizer, scheduler = roles[name]
            savers[name].save(1, chunks, optimizer, scheduler, {"step": 1})
            expected[name] = {k: v.detach().clone() for k, v in chunks[0].module.state_dict().items()
                              if isinstance(v, torch.Tensor)}
        for name in ("actor", "critic"):  # RunCheckpoints.close's order
            savers[name].close()
        for name in roles:
            fresh, fresh_opt, fresh_sched = ct.build(bf16=name == "critic")
            checkpoint.load_checkpoint(checkpoint.find_latest_checkpoint(os.path.join(root, name)),
                                       fresh, fresh_opt, fresh_sched)
            got = fresh[0].module.state_dict()
            out[name] = all(torch.equal(got[k], v) for k, v in expected[name].items())
    return out


@pytest.mark.slow
def test_two_roles_saved_async_at_one_step_both_load(tmp_path):
    """Each save gets its own write-results queue (Checkpointer._own_write_results): with
    megatron's one process-wide queue the two saves took each other's results and the actor's
    checkpoint did not load (UnpicklingError)."""
    results = run_on_ranks(_two_roles_async_save_then_load, 2, (str(tmp_path),), timeout=TIMEOUT)
    for r in results:
        assert r == {"actor": True, "critic": True}, r


def _load_with_mismatched_config(rank, world_size, root):
    from megatron.core import parallel_state

    from tests.distributed import tiny_gpt
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.engine.checkpoint import Checkpointer

    cpu_compat.install()
    parallel_state.initialize_model_parallel(1, 2)
    # parallel_state says PP=2, the config PP=1: every stage builds all layers. Unchecked, this
    # reaches dist_checkpointing, which raises "Invalid access pattern" on rank 0 only and
    # leaves rank 1 waiting in a collective.
    model = tiny_gpt.build_model(tiny_gpt.make_config(tp=1, pp=1))
    try:
        Checkpointer(root).load([model])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_model_built_for_another_layout_fails_on_every_rank(tp2_checkpoint):
    root, _ = tp2_checkpoint
    errors = run_on_ranks(_load_with_mismatched_config, 2, (root,), timeout=TIMEOUT)
    for rank, error in enumerate(errors):
        assert error is not None and f"rank {rank}" in error
        assert "pipeline_model_parallel_size=1 but its process groups have 2" in error


def _resume_same_layout(rank, world_size, root, bf16, sharding):
    from tests.engine import checkpoint_trainer as ct
    from verl_mcore.engine.checkpoint import Checkpointer

    ct.seed_everything(0)
    batches = _batches()
    chunks, optimizer, scheduler = ct.build(bf16=bf16)
    ct.train_step(chunks, optimizer, scheduler, batches[0])
    with _children_allowed():
        Checkpointer(root, optimizer_sharding=sharding).save(1, chunks, optimizer, scheduler)
    expected = [ct.train_step(chunks, optimizer, scheduler, b) for b in batches[1:]]
    chunks, optimizer, scheduler = ct.build(bf16=bf16)
    with _children_allowed():
        loaded = Checkpointer(root).load(chunks, optimizer, scheduler)
    got = [ct.train_step(chunks, optimizer, scheduler, b) for b in batches[1:]]
    adam = optimizer.chained_optimizers[0].optimizer
    steps = sorted({float(state["step"]) for state in adam.state.values()})
    return {"expected": expected, "got": got, "rng": loaded.rng_restored, "steps": steps}


@pytest.mark.slow
@pytest.mark.parametrize("bf16,sharding", [(False, "dp_reshardable"), (True, "fully_reshardable")],
                         ids=["fp32_dp_reshardable", "bf16_fully_reshardable"])
def test_resume_at_same_layout_is_bitwise(tmp_path, bf16, sharding):
    results = run_on_ranks(_resume_same_layout, 2, (str(tmp_path), bf16, sharding),
                           timeout=TIMEOUT)
    for r in results:
        assert r["rng"] is True
        assert r["got"] == r["expected"]
        # Every parameter counts its own Adam steps (1 before the save + 2 after); a step tensor
        # shared between parameters would read 1 + 2 * num_params.
        assert r["steps"] == [3.0]
