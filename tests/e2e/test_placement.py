"""Roles on their own ranks (issue 19): 4 gloo ranks, the actor on [0, 1] (DP=2), the critic
(PPO; GRPO has none, so there its reference takes that rank) on [2], a reward model on [3], against the colocated 4-rank run of the same seed and data (every
role on every rank, TP=2 × DP=2). GRPO and PPO, 3 steps each: the losses, scores and grad norms
agree within the CPU tolerance of the layout tests, and a run resumes across the two layouts
(placed from a colocated checkpoint, and the other way round) onto the same step 3.

Generation replicas match: colocated at TP_g = 2 there are 2 (ranks {0,1} and {2,3}); placed,
the actor set's 2 ranks at TP_g = 1 are 2 as well, with the same prompts and sampling seeds."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]

COLOCATED = ["parallel.tensor_model_parallel_size=2", "rollout.tensor_parallel_size=2"]
PLACED = {"ppo": ["parallel.tensor_model_parallel_size=1", "rollout.tensor_parallel_size=1",
                  "placement.actor=[0,1]", "placement.critic=[2]", "placement.reward_model=[3]"],
          "grpo": ["parallel.tensor_model_parallel_size=1", "rollout.tensor_parallel_size=1",
                   "placement.actor=[0,1]", "placement.reference=[2]", "placement.reward_model=[3]"]}
# Compared step by step; each from the set that computes it.
COMPARED = ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean",
            "reward/rm/mean", "reward/rule/mean", "critic/advantages/mean", "response_length/mean"]
WITH_CRITIC = ["critic/vf_loss", "critic/grad_norm", "critic/values/mean"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("placement")
    return make_tiny_model(str(root / "model")), make_tiny_model(str(root / "rm"), seed=5,
                                                                   reward_model=True)


def _overrides(models, run_dir, algo, layout, steps=3):
    model, rm = models
    sources = (f"[{{name: rm, type: reward_model, weight: 0.5, path: {rm}, dtype: fp32}}, "
               "{name: rule, type: rule, weight: 0.5}]")
    out = [f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
           "trainer.val_every=0", "checkpoint.save_every=2", "checkpoint.keep_last=0",
           f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]", "data.val_files=[]",
           f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py", f"reward.sources={sources}",
           "reward.num_workers=0", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
           "actor.micro_batch_size_per_gpu=2", "critic.micro_batch_size_per_gpu=2",
           "actor.use_kl_loss=true", "rollout.logprob_check.num_sequences=2", *layout]
    if algo == "grpo":
        return out + ["algorithm.adv_estimator=grpo", "rollout.n=2"]
    return out + ["algorithm.adv_estimator=gae", "rollout.n=1", "algorithm.lam=0.95",
                  "actor.micro_batch_size_per_gpu=1", "critic.micro_batch_size_per_gpu=1",
                  "critic.recompute_values=always"]  # the placed critic's order, colocated too


def _train(rank, world_size, overrides):
    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    return Trainer(Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)).fit()


def _rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _assert_same(a: dict, b: dict, keys, what: str):
    for k in keys:
        assert k in a and k in b, f"{what}: {k} missing"
        assert math.isclose(a[k], b[k], rel_tol=2e-4, abs_tol=2e-5), f"{what}: {k} {a[k]} vs {b[k]}"


def _run(overrides):
    assert run_on_ranks(_train, 4, args=(overrides,), timeout=900, fresh=True) == [0, 0, 0, 0]


def _resume_from(source: Path, target: Path, step: int):
    """A run directory holding only `source`'s checkpoints up to `step` (and its metrics rows)."""
    shutil.copytree(source / "checkpoints", target / "checkpoints")
    for role_dir in (target / "checkpoints").iterdir():
        for ckpt in role_dir.glob("step_*"):
            if int(ckpt.name.split("_")[1]) > step:
                shutil.rmtree(ckpt)
        (role_dir / "latest").write_text(f"step_{step:08d}\n")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_placed_roles_equal_the_colocated_run_and_resume_across_layouts(models, tmp_path, algo):
    keys = COMPARED + (WITH_CRITIC if algo == "ppo" else [])
    colocated, placed = tmp_path / "colocated", tmp_path / "placed"
    _run(_overrides(models, colocated, algo, COLOCATED))
    _run(_overrides(models, placed, algo, PLACED[algo]))
    a, b = _rows(colocated), _rows(placed)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in (1, 2, 3):
        _assert_same(a[step], b[step], keys, f"step {step}")
    # Each set's phases appear with the set's name; the reward model ran on its own rank.
    actor_set = "actor+reference" if algo == "ppo" else "actor"
    assert f"timing_s/{actor_set}/actor" in b[1] and "timing_s/reward_model/reward" in b[1]
    assert ("timing_s/critic/critic" in b[1]) == (algo == "ppo")
    assert ("timing_s/reference/ref" in b[1]) == (algo == "grpo")

    # Placed, resumed from the colocated run's step-2 checkpoint; and the other way round.
    for source, layout, name in ((colocated, PLACED[algo], "placed_from_colocated"),
                                 (placed, COLOCATED, "colocated_from_placed")):
        target = tmp_path / name
        _resume_from(source, target, 2)
        _run(_overrides(models, target, algo, layout))
        rows = _rows(target)
        assert sorted(rows) == [3], f"{name}: resumed at step 2"
        _assert_same(a[3], rows[3], keys, f"{name} step 3")
