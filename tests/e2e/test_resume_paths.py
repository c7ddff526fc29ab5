"""Resuming the trainer from checkpoint.load_path, on the tiny quickstart model (1 rank, PPO).

Run X: critic warmup 1 and a checkpoint every step, so step 1's actor checkpoint is saved before
the actor's first optimizer step. Run Y starts from X's step 1 (load_path into another run's
directory: the critic comes from X too) and must log X's step 2 exactly. Then Y is started again
with the same command line, as a Slurm requeue would: it continues from its own step 2, and the
metrics rows a dead attempt left past that step are dropped.
"""
import json
import os

import pytest

from tests.e2e.test_trainer import ROOT, _overrides
from tests.multiproc import run_on_ranks


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _timed(key):
    """Timings and throughputs: different in every run."""
    return key == "time" or key.startswith(("timing_s/", "perf/")) or key.endswith(
        ("/tokens_per_s", "/mfu"))


def _body(rank, world_size, model_dir, tmp_path):
    from megatron.core import parallel_state

    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    def start(cfg):  # a new process would start with no parallel state
        parallel_state.destroy_model_parallel()
        return Trainer(cfg)

    def config(run_dir, *extra):
        overrides = _overrides(model_dir, run_dir, "ppo", (1, 1, 1)) + [
            "critic.warmup_steps=1", "checkpoint.save_every=1", "trainer.val_every=0",
            "trainer.total_steps=2", *extra]
        return Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)

    x, y = f"{tmp_path}/x", f"{tmp_path}/y"
    out = {"x_code": start(config(x)).fit()}
    y_config = config(y, f"checkpoint.load_path={x}/checkpoints/actor/step_00000001")
    out["y_code"] = start(y_config).fit()
    out["x"], out["y"] = _rows(x), _rows(y)

    # A dead attempt of Y got to step 7 and was killed mid-row.
    with open(os.path.join(y, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 7}) + "\n" + '{"step": 8, "actor/pg')
    requeued = start(y_config)
    out["requeue_step"] = requeued.step_index
    requeued.finish()
    out["y_after_requeue"] = _rows(y)
    return out


@pytest.mark.slow
def test_load_path_from_another_run_then_requeue(tiny_model, tmp_path):
    [r] = run_on_ranks(_body, 1, args=(tiny_model, str(tmp_path)), timeout=600, fresh=True)
    assert r["x_code"] == 0 and r["y_code"] == 0
    x2 = r["x"][1]
    [y2] = r["y"]
    assert x2["step"] == y2["step"] == 2
    # Bitwise the uninterrupted run's step 2 (timings aside), critic and actor updates included.
    same = {k for k in x2 if not _timed(k)}
    assert "actor/pg_loss" in same and "critic/vf_loss" in same
    assert {k: y2[k] for k in same} == {k: x2[k] for k in same}
    # The requeue continued from Y's own step 2, not from load_path's step 1.
    assert r["requeue_step"] == 2
    assert r["y_after_requeue"] == r["y"]
