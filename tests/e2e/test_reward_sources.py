"""The trainer with every kind of reward source in one config (issue 19): 3 GRPO steps on the
quickstart model with a reward model (weight 0.5, a tiny Qwen2ForSequenceClassification made by
transformers), a rule source (0.3, the quickstart's function) and a batch reward class (0.2,
constructed once with its kwargs, reading the dataset's `category` column), routed metrics by
`category`. Every per-source and per-route metric is present each step, and the total is the
weighted sum of the sources."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]

JUDGE = '''
class Judge:
    """Even-category prompts: reward the share of even digits; odd ones, of odd digits."""

    def __init__(self, bonus):
        self.bonus = bonus

    def compute_reward(self, batch):
        out = []
        for text, category in zip(batch["responses"], batch["category"]):
            digits = [int(c) for c in text if c.isdigit()]
            want = 0 if category == "even" else 1
            share = sum(d % 2 == want for d in digits) / len(digits) if digits else 0.0
            out.append(share + self.bonus)
        return out
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import pyarrow.parquet as pq

    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("rewards")
    model = make_tiny_model(str(root / "model"))
    rm = make_tiny_model(str(root / "rm"), seed=5, reward_model=True)
    table = pq.read_table(ROOT / "examples/data/quickstart_train.parquet")
    truth = [r["ground_truth"] for r in table.column("reward_model").to_pylist()]
    table = table.append_column("category", [["even" if int(t) % 2 == 0 else "odd" for t in truth]])
    data = root / "train.parquet"
    pq.write_table(table, data)
    (root / "judge.py").write_text(JUDGE)
    return root, model, rm, data


def _train(rank, world_size, overrides):
    from verl_mcore.config import Config, validate
    from verl_mcore.trainer import Trainer

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
    validate(cfg, world_size)
    return Trainer(cfg).fit()


def test_reward_model_rule_and_class_weighted_with_route_metrics(setup):
    root, model, rm, data = setup
    run_dir = root / "run"
    sources = (f"[{{name: rm, type: reward_model, weight: 0.5, path: {rm}, dtype: fp32}}, "
               "{name: rule, type: rule, weight: 0.3}, "
               f"{{name: judge, type: custom, weight: 0.2, path: {root}/judge.py, function: Judge, "
               "kwargs: {bonus: 0.25}}]")
    overrides = [f"model.path={model}", f"trainer.run_dir={run_dir}", "trainer.total_steps=3",
                 f"data.train_files=[{data}]", "data.val_files=[]", "trainer.val_every=0",
                 f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py",
                 "reward.num_workers=1", f"reward.sources={sources}", "reward.route_by=category"]
    assert run_on_ranks(_train, 1, args=(overrides,), timeout=600, fresh=True) == [0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    batch = 16 * 8  # quickstart: data.train_batch_size x rollout.n
    for row in rows:
        needed = ["reward/rm/mean", "reward/rm/std", "reward/rule/mean", "reward/judge/mean",
                  "reward/score/mean", "critic/score/mean"]
        assert all(k in row and math.isfinite(row[k]) for k in needed), sorted(row)
        weighted = 0.5 * row["reward/rm/mean"] + 0.3 * row["reward/rule/mean"] + 0.2 * row["reward/judge/mean"]
        assert row["critic/score/mean"] == pytest.approx(weighted, abs=1e-5)
        assert row["reward/judge/mean"] >= 0.25  # its kwargs reached the constructor
        counts = {k: v for k, v in row.items() if k.startswith("reward/route/") and k.endswith("/count")}
        assert set(counts) <= {"reward/route/even/count", "reward/route/odd/count"} and counts
        assert sum(counts.values()) == batch
        means = sum(row[k.replace("/count", "/mean")] * v for k, v in counts.items()) / batch
        assert means == pytest.approx(row["critic/score/mean"], abs=1e-5)
        assert row["reward/failed"] == 0
