"""DAPO's overlong handling in the trainer (algo/overlong.py): 2 GRPO steps of the quickstart's
tiny model with reward.overlong_buffer and actor.mask_truncated_samples on. Its random weights
run most responses to the 8-token limit, so both act every step. One rank, ~15 s."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
OVERLONG = ["reward/overlong/penalty_mean", "reward/overlong/fraction",
            "actor/masked_truncated_fraction"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _train(rank, world_size, overrides):
    from verl_mcore.config import Config, validate
    from verl_mcore.trainer import Trainer

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
    validate(cfg, world_size)
    return Trainer(cfg).fit()


def test_overlong_penalty_and_masking_metrics_in_a_grpo_run(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"model.path={tiny_model}", f"trainer.run_dir={run_dir}", "trainer.total_steps=2",
                 "trainer.val_every=0", "data.val_files=[]", "checkpoint.save_every=0",
                 "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                 "actor.micro_batch_size_per_gpu=4",
                 "reward.num_workers=0", "data.max_response_length=8",
                 "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                 "reward.overlong_buffer.penalty_factor=0.5", "actor.mask_truncated_samples=true"]
    assert run_on_ranks(_train, 1, args=(overrides,), timeout=300) == [0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in OVERLONG), row
        clipped = row["response_length/clip_ratio"]
        # Exactly the samples cut at the limit leave the actor's loss.
        assert row["actor/masked_truncated_fraction"] == clipped
        # And they do leave it: the update is one on-policy step (ratio 1, token-mean), whose
        # pg_loss over every sample would be minus the mean advantage of all tokens (critic/
        # advantages/mean); over the kept ones it is not (penalised, their advantages are low).
        if 0 < clipped < 1:
            assert abs(row["actor/pg_loss"] + row["critic/advantages/mean"]) > 0.05, row
        # Those have 8 tokens, past the buffer's start (8 - 4): penalised by the full factor.
        assert row["reward/overlong/fraction"] >= clipped
        assert row["reward/overlong/penalty_mean"] <= -0.5 * clipped + 1e-7
        # The training scores are the rule's plus the penalty.
        assert row["critic/score/mean"] == pytest.approx(
            row["reward/rule/mean"] + row["reward/overlong/penalty_mean"], abs=1e-6)
    assert any(r["response_length/clip_ratio"] > 0 for r in rows)  # the test saw truncation
