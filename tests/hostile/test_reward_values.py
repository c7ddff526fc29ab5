"""A reward that is not a finite number (a string, a bool, None, NaN, inf, 1e38) is a failed score,
logged with its sample and data source; a batch that mostly fails stops the run naming the first
failure."""
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.config.schema import CustomClassConfig, RewardConfig, RewardSourceConfig
from verl_mcore.reward import RewardManager
from verl_mcore.reward.manager import RewardFailureError
from verl_mcore.reward.scorers import InvalidScore, check_result

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", [
    "0.75", b"1", True, np.bool_(True), torch.tensor(True), None, float("nan"), float("inf"), -float("inf"),
    1e38,  # finite in float32, but its square overflows the batch statistics
    3.5e38,  # finite in float64, inf in float32
    10 ** 400,  # an int too large for a float
    [0.5], np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), {"score": "1"}, {"score": float("nan")},
])
def test_not_a_usable_number(value):
    with pytest.raises(InvalidScore):
        check_result(value)


@pytest.mark.parametrize("value, expected", [
    (0.5, 0.5), (-3, -3.0), (np.float32(0.25), 0.25), (np.int64(2), 2.0), (torch.tensor(0.5), 0.5),
    (1e15, 1e15), ({"score": 1, "acc": 1.0}, 1.0),
])
def test_numbers_pass(value, expected):
    assert check_result(value)[0] == expected


VALUES = '''
import math


def score(data_source, response, ground_truth, extra_info):
    return {"str": "0.75", "bool": True, "none": None, "nan": math.nan, "inf": math.inf,
            "big": 1e38, "ok": 0.5}[response]
'''


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_values_fail_their_sample_and_name_the_first(tmp_path, caplog, workers):
    path = tmp_path / "values.py"
    path.write_text(VALUES)
    cfg = RewardConfig(custom_fn=CustomClassConfig(path=str(path), name="score"),
                       num_workers=workers, fallback_score=-1.0)
    responses = ["ok", "str", "bool", "none", "nan", "inf", "big", "ok"]
    rows = [{"data_source": f"src{i}"} for i in range(8)]
    with RewardManager.from_config(cfg) as m, \
            caplog.at_level(logging.WARNING, logger="verl_mcore.reward.manager"):
        out = m.score(responses, rows, indices=list(range(10, 18)))
    assert out.scores == [0.5] + [-1.0] * 6 + [0.5]
    assert out.failed == [False] + [True] * 6 + [False]
    assert out.metrics["reward/invalid"] == 6 and out.metrics["reward/errors"] == 0
    assert out.first_failure[0] == 11
    assert ("6 of 8 samples failed in this batch (0 errors, 0 timeouts, 6 invalid values)"
            in caplog.text)
    assert ("the first: sample 11 (data_source='src1'), source 'rule', scorer reward.custom_fn "
            f"{path}:score: "
            "invalid: a scorer must return a number or {'score': number, ...}, got str '0.75'"
            in caplog.text)


def test_reward_model_values_are_checked_too():
    class NaNModel:
        def score_batch(self, prompt_ids, response_ids):
            return [1.0, math.nan]

    cfg = RewardConfig(sources=[RewardSourceConfig(name="rm", type="reward_model", path="x")],
                       num_workers=0)
    with RewardManager.from_config(cfg, {"rm": NaNModel()}) as m:
        out = m.score(["a", "b"], [{}, {}], prompt_ids=[[1], [1]], response_ids=[[2], [2]])
    assert out.failed == [False, True] and out.metrics["reward/invalid"] == 1
    assert "scorer the reward model 'rm' (reward.sources[0]): invalid" in out.first_failure[1]


def _manager(**kw):
    return RewardManager.from_config(RewardConfig(num_workers=0, **kw))


def test_mostly_failures_stop_the_run():
    with _manager() as m:
        m.check_failures(4, 8, (3, "sample 3 ..."))  # 0.5 is not above the default 0.5
        with pytest.raises(RewardFailureError) as e:
            m.check_failures(5, 8, (3, "sample 3 (data_source='x'): invalid: ..."))
    msg = str(e.value)
    assert "5 of 8 samples of this batch failed to score, more than reward.max_failed_fraction=0.5" in msg
    assert "the first: sample 3 (data_source='x')" in msg and "(1.0: never stop)" in msg
    with _manager(max_failed_fraction=1.0) as m:
        m.check_failures(8, 8, (0, "all"))
    with _manager(max_failed_fraction=0.0) as m, pytest.raises(RewardFailureError):
        m.check_failures(1, 100, (0, "one"))


def test_timeouts_count_as_failures(tmp_path):
    # What reward.timeout_s=0 did silently (109 of 128 samples timed out, exit 0).
    path = tmp_path / "slow.py"
    path.write_text("import time\n\ndef score(*args):\n    time.sleep(5)\n    return 1.0\n")
    cfg = RewardConfig(custom_fn=CustomClassConfig(path=str(path), name="score"), num_workers=1,
                       timeout_s=0.2)
    with RewardManager.from_config(cfg) as m:
        out = m.score(["a", "b"], [{}, {}])
        assert out.metrics["reward/timeouts"] == 2
        with pytest.raises(RewardFailureError, match=r"the first: sample 0 .*timeout: no result "
                                                     r"after reward.timeout_s=0.2 s"):
            m.check_failures(sum(out.failed), 2, out.first_failure)


def _string_reward_body(rank, world_size, model_dir, tmp_path):
    """The trainer with a reward that returns "0.75": it stops at step 1 naming the sample."""
    from tests.e2e.test_trainer import _overrides
    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    path = Path(tmp_path) / "string_reward.py"
    path.write_text("def score(data_source, response, ground_truth, extra_info=None):\n"
                    "    return '0.75'\n")
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), _overrides(
        model_dir, f"{tmp_path}/run", "grpo", (1, 1, 1)) + [
        f"reward.custom_fn.path={path}", "reward.custom_fn.name=score", "trainer.val_every=0"])
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    except RewardFailureError as e:
        return str(e)
    finally:
        trainer.finish()
    return None


def test_the_trainer_stops_when_every_reward_is_a_string(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    [msg] = run_on_ranks(_string_reward_body, 1, args=(model, str(tmp_path)), timeout=300)
    assert msg is not None, "the run did not stop"
    assert msg.startswith("8 of 8 samples of this batch failed to score")
    assert "the first: sample 0 (data_source=" in msg and "got str '0.75'" in msg
    assert f"scorer reward.custom_fn {tmp_path}/string_reward.py:score: invalid" in msg, msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or \
        (tmp_path / "run" / "metrics.jsonl").read_text() == ""  # no step was recorded
