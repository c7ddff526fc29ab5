"""The weight-sync check of a colocated engine reads the step's own samples (generation.py):
no sampling for the check alone, and a broken repartition still stops every rank before any
rank trains on the batch it sampled."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_rollout_set import _overrides, model  # noqa: F401 - model: the fixture
from tests.multiproc import run_on_ranks
from verl_mcore.rollout.base import SampleOutput
from verl_mcore.rollout.sync_check import checked_outputs

ROOT = Path(__file__).resolve().parents[2]
# TP_t = 2 -> TP_g = 1: the engine's weights are a repartitioned copy, which the test corrupts.
LAYOUT = ["parallel.tensor_model_parallel_size=2", "rollout.tensor_parallel_size=1"]


def _out(prompt, sample, n_tokens):
    return SampleOutput(prompt, sample, list(range(n_tokens)), [-0.5] * n_tokens, "length")


def test_checked_outputs_take_one_sample_per_prompt_first_and_cut_them():
    outs = [_out(p, s, 5) for p in range(3) for s in range(2)]
    chosen = checked_outputs(outs, 4, 3)
    assert [(o.prompt_index, o.sample_index) for o in chosen] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert all(o.token_ids == [0, 1, 2] and len(o.logprobs) == 3 for o in chosen)
    assert [len(o.token_ids) for o in checked_outputs(outs, 2, 0)] == [5, 5]  # 0: whole
    assert outs[0].token_ids == [0, 1, 2, 3, 4]  # the batch's own samples are not cut


def _run(rank, world_size, overrides, corrupt_at):
    """Train with the engine's generate calls counted and, from step `corrupt_at` on, rank 1's
    generation weights corrupted after each repartition; (outcome, generate calls per step,
    steps whose actor update ran)."""
    import torch

    from tests.e2e.test_rollout_set import _train
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.repartition import Repartitioner
    from verl_mcore.learner import Learner
    from verl_mcore.trainer import Trainer

    calls, updated, step_now = {}, [], [0]
    original_generate, original_run, original_update = (NativeEngine.generate, Repartitioner.run,
                                                        Learner.update)

    def generate(self, prompt_ids, sampling):
        calls[step_now[0]] = calls.get(step_now[0], 0) + 1
        return original_generate(self, prompt_ids, sampling)

    def run(self):
        stats = original_run(self)
        if rank == 1 and corrupt_at is not None and step_now[0] >= corrupt_at:
            with torch.no_grad():
                for p in self.gen_params.values():
                    p.add_(0.5)
        return stats

    def update(self, step, role, batch, *args):
        updated.append(step)
        return original_update(self, step, role, batch, *args)

    original_step = Trainer.step

    def step(self, s):
        step_now[0] = s
        return original_step(self, s)

    NativeEngine.generate, Repartitioner.run = generate, run
    Learner.update, Trainer.step = update, step
    try:
        _train(rank, world_size, overrides, 0)
        outcome = "ok"
    except BaseException as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    finally:
        NativeEngine.generate, Repartitioner.run = original_generate, original_run
        Learner.update, Trainer.step = original_update, original_step
    return outcome, calls, updated


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"step"' in line]


@pytest.mark.distributed
def test_the_check_samples_nothing_of_its_own_and_stops_a_corrupted_sync(model, tmp_path):
    # A clean run: one generate call a step, the check's metrics in every step's row.
    clean = tmp_path / "clean"
    results = run_on_ranks(_run, 2, args=(_overrides(model, clean, *LAYOUT, steps=2), None),
                           timeout=240)
    for rank, (outcome, calls, updated) in enumerate(results):
        assert outcome == "ok", (rank, outcome)
        assert calls == {1: 1, 2: 1}, (rank, calls)  # no sampling for the check alone
        assert updated == [1, 2], rank
    rows = _rows(clean)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]

    # Rank 1's generation weights corrupted from step 2 on: both ranks stop in step 2 with the
    # check's error, and no rank ran step 2's update.
    broken = tmp_path / "broken"
    results = run_on_ranks(_run, 2, args=(_overrides(model, broken, *LAYOUT, steps=3), 2),
                           timeout=240)
    for rank, (outcome, _, updated) in enumerate(results):
        assert outcome.startswith("WeightSyncError"), (rank, outcome)
        assert "logprob_check.max_abs_diff" in outcome, (rank, outcome)
        assert updated == [1], (rank, updated)


@pytest.mark.gpu
def test_on_a_gpu_the_engine_keeps_its_cache_and_graphs_through_training(model, tmp_path):
    """The colocated engine on CUDA: step 1 frees its KV cache before training (no budget yet);
    from step 2 on the trainer's budget (a quarter of what training left free) keeps the tiny
    model's cache and CUDA graphs, and the check on the step's samples still holds."""
    import torch

    assert torch.cuda.is_available()
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "verl_mcore.train", "--config", "configs/quickstart.yaml",
            *_overrides(model, run_dir, "trainer.device=cuda", steps=3)]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    rows = {r["step"]: r for r in _rows(run_dir)}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["rollout/kept_cache_gb"] == 0
    for step in (2, 3):
        assert rows[step]["rollout/kept_cache_gb"] > 0, step
    for row in rows.values():
        assert row["rollout/cuda_graphs"] == 1
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
