"""The off-policy corrections in GRPO runs (algo/off_policy.py, Learner.off_policy): 2 steps of the
quickstart's tiny model on 1 CPU rank, the engine's log-probs skewed by a known amount per token
(skewed_logprobs.py, a rollout.generate_fn) so that the corrections act on a known share of the
tokens. Recorded in the rank by wrapping Learner.off_policy and Learner.update: the log-probs the
corrections read, and the response mask and weights the actor's update trained on, which must be
exactly the batch's mask times the corrections' masks and their weights. Two runs, ~10 s:
truncated IS with both masks (IcePop's form: token_mask=k with tis_cap=k), and AReaL's decoupled
objective with a cap."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.algo.off_policy import decoupled_weights, sequence_ratio_mask, token_ratio_mask
from verl_mcore.algo.policy_loss import truncated_is_weights

ROOT = Path(__file__).resolve().parents[2]
SHIFT = 0.3  # skewed_logprobs: |log ratio| is 0, 0.3 or 0.6 by token id

RUNS = {
    "tis_and_masks": ["rollout.tis_cap=1.5", "rollout.correction.token_mask=1.5",
                      "rollout.correction.seq_mask=1.1"],
    "decoupled": ["rollout.correction.decoupled=true", "rollout.correction.decoupled_cap=1.5"],
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _train_recording(rank, world_size, overrides):
    """fit's exit code, and per step what the corrections read and what the actor trained on."""
    from verl_mcore.config import Config, validate
    from verl_mcore.learner import Learner
    from verl_mcore.trainer import Trainer

    seen: list[dict] = []
    off_policy, update = Learner.off_policy, Learner.update

    def record_off_policy(self, rollout, batch):
        seen.append({"old": batch.old_log_probs.clone(), "engine": rollout.engine_log_probs.clone(),
                     "mask": batch.response_mask.clone()})
        return off_policy(self, rollout, batch)

    def record_update(self, step, role, batch, *args):
        if role == "actor":
            w = batch.is_weights
            seen[-1].update(actor_mask=batch.response_mask.clone(),
                            is_weights=None if w is None else w.clone())
        return update(self, step, role, batch, *args)

    Learner.off_policy, Learner.update = record_off_policy, record_update
    try:
        cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
        validate(cfg, world_size)
        return Trainer(cfg).fit(), seen
    finally:
        Learner.off_policy, Learner.update = off_policy, update


def _run(tiny_model, run_dir, extra):
    overrides = [f"model.path={tiny_model}", f"trainer.run_dir={run_dir}", "trainer.total_steps=2",
                 "trainer.val_every=0", "data.val_files=[]", "checkpoint.save_every=0",
                 "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                 "actor.micro_batch_size_per_gpu=16", "reward.num_workers=0",
                 f"rollout.generate_fn.path={ROOT}/tests/e2e/skewed_logprobs.py",
                 "rollout.generate_fn.name=skewed",
                 f"rollout.generate_fn.kwargs={{shift: {SHIFT}}}",
                 *extra]
    [(code, seen)] = run_on_ranks(_train_recording, 1, args=(overrides,), timeout=300)
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(seen) == 2
    return rows, seen


def _ratio_bounds(row):
    """The skew reached the learner: every ratio within e^(+-0.6), up to the engine's and the
    trainer's own difference (fp32)."""
    assert math.exp(-2 * SHIFT) * (1 - 1e-4) <= row["rollout/ratio_min"] <= 1.0
    assert 1.0 <= row["rollout/ratio_max"] <= math.exp(2 * SHIFT) * (1 + 1e-4)


def test_truncated_is_and_both_masks_in_a_grpo_run(tiny_model, tmp_path):
    rows, seen = _run(tiny_model, tmp_path / "run", RUNS["tis_and_masks"])
    for row, s in zip(rows, seen):
        args = (s["old"], s["engine"], s["mask"])
        want = token_ratio_mask(*args, 1.5)[0] * sequence_ratio_mask(*args, 1.1)[0]
        # Exactly these tokens trained: the rejected ones left the actor's batch.
        assert torch.equal(s["actor_mask"], want)
        assert 0 < want.sum() < s["mask"].sum()
        assert torch.equal(s["is_weights"], truncated_is_weights(*args, 1.5)[0])
        keys = ["rollout/token_mask_fraction", "rollout/token_mask_seq_fraction",
                "rollout/seq_mask_fraction", "rollout/seq_mask_token_fraction",
                "rollout/seq_ratio_mean", "rollout/masked_token_fraction",
                "rollout/tis_weight_mean", "rollout/tis_clip_fraction"]
        assert all(math.isfinite(row[k]) for k in keys), row
        # token_mask rejects the tokens skewed by 0.6 (ratio e^0.6 > 1.5), keeps those by 0.3.
        assert 0 < row["rollout/token_mask_fraction"] < 1
        out = 1 - float(want.sum()) / float(s["mask"].sum())
        assert row["rollout/masked_token_fraction"] == pytest.approx(out, rel=1e-6)
        assert row["rollout/masked_token_fraction"] >= max(row["rollout/token_mask_fraction"],
                                                           row["rollout/seq_mask_token_fraction"])
        _ratio_bounds(row)
        assert "rollout/decoupled_weight_mean" not in row
    assert any(0 < r["rollout/seq_mask_fraction"] < 1 for r in rows)


def test_decoupled_objective_in_a_grpo_run(tiny_model, tmp_path):
    rows, seen = _run(tiny_model, tmp_path / "run", RUNS["decoupled"])
    for row, s in zip(rows, seen):
        assert torch.equal(s["actor_mask"], s["mask"])  # weights only: every token trains
        weights, _ = decoupled_weights(s["old"], s["engine"], s["mask"], 1.5)
        assert torch.equal(s["is_weights"], weights)
        # The tokens skewed by 0.6 one way weigh e^0.6 = 1.82 > 1.5: capped to 0.
        assert 0 < row["rollout/decoupled_capped_fraction"] < 1
        assert row["rollout/decoupled_weight_max"] <= 1.5
        assert math.isfinite(row["rollout/decoupled_weight_mean"])
        _ratio_bounds(row)
        assert "rollout/masked_token_fraction" not in row and "rollout/tis_weight_mean" not in row
