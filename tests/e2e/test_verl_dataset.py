"""A verl-style dataset class (`_read_files_and_tokenize` over a raw Arrow export laid out as
Eurus-2-RL-Data's) named by data.custom_cls: the trainer trains 3 steps on its rows."""
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.data.files import EURUS_DATASET, eurus_rows, write_raw_arrow_export
from tests.e2e.test_trainer import _train
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _export(split: str, path: Path) -> str:
    """The quickstart's prompts as a raw Arrow export: each behind Eurus' system prompt."""
    rows = pq.read_table(ROOT / f"examples/data/quickstart_{split}.parquet").to_pylist()
    user = [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows]
    return write_raw_arrow_export(str(path), eurus_rows(user))


@pytest.mark.slow
def test_trains_three_steps_on_a_verl_style_dataset(tiny_model, tmp_path):
    (tmp_path / "eurus_dataset.py").write_text(EURUS_DATASET)
    train = _export("train", tmp_path / "eurus" / "train.arrow")
    val = _export("val", tmp_path / "eurus" / "validation.arrow")
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model}", f"trainer.run_dir={run_dir}", "trainer.total_steps=3",
        "trainer.val_every=3", "checkpoint.save_every=0", "rollout.n=2",
        f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.train_batch_size=4",
        # With the system prompt every row is over the quickstart's 16 tokens: the default
        # reader would keep no row, so training at all shows the subclass's rows are used.
        "data.truncation=filter",
        f"data.custom_cls.path={tmp_path / 'eurus_dataset.py'}",
        "data.custom_cls.name=EurusArrowDataset",
        f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py", "reward.num_workers=0",
        "actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=4",
    ]
    assert run_on_ranks(_train, 1, args=(overrides,), timeout=600, fresh=True) == [0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["critic/score/mean"])
        assert row["prompt_length/mean"] <= 16
    assert "val/eurus/repeat_digit/score/mean@1" in rows[2]
