"""A Python callable as the rule source's scorer (RewardManager.from_config(score_fn=...), the
Python API's reward_fn): scored in this process, checked like a file's function."""
import pytest

from tests.reward import user_fns
from verl_mcore.config.schema import CustomClassConfig, RewardConfig
from verl_mcore.reward import RewardManager

ROW = {"data_source": "anything", "reward_model": {"ground_truth": "7"},
       "extra_info": {"index": 3}, "category": "chat"}


def test_a_callable_scores_in_this_process_with_the_scorer_arguments():
    seen = []
    offset = 0.5  # a closure: nothing a scoring worker could import

    def judge(data_source, response, ground_truth, extra_info):
        seen.append((data_source, response, ground_truth, extra_info))
        return {"score": float(response == ground_truth) + offset, "exact": 1.0}

    with RewardManager.from_config(RewardConfig(num_workers=0), score_fn=judge) as m:
        out = m.score(["7", "8"], [ROW, ROW])
    assert out.scores == [1.5, 0.5] and out.extras["rule/exact"] == [1.0, 1.0]
    assert seen[0] == ("anything", "7", "7", {"index": 3, "category": "chat"})
    # an unknown data_source is fine: the callable, not the built-in dispatch, scores it
    with RewardManager.from_config(RewardConfig(num_workers=0), score_fn=lambda *a: 2.0) as m:
        assert m.score(["x"], [ROW]).scores == [2.0]


def test_a_failing_callable_falls_back_like_a_files_function():
    def broken(data_source, response, ground_truth, extra_info):
        raise ZeroDivisionError("no")

    with RewardManager.from_config(RewardConfig(num_workers=0, fallback_score=-1.0),
                                   score_fn=broken) as m:
        out = m.score(["7"], [ROW])
    assert out.scores == [-1.0] and out.failed == [True] and out.metrics["reward/errors"] == 1.0
    assert "ZeroDivisionError: no" in out.first_failure[1]


def test_refused_with_workers_with_a_wrong_signature_and_with_custom_fn(tmp_path):
    with pytest.raises(ValueError, match="reward.num_workers=0"):
        RewardManager.from_config(RewardConfig(num_workers=2), score_fn=lambda *a: 1.0)
    with pytest.raises(ValueError, match="data_source, response, ground_truth, extra_info"):
        RewardManager.from_config(RewardConfig(num_workers=0), score_fn=lambda response: 1.0)
    path = user_fns.write(tmp_path)
    both = RewardConfig(num_workers=0, custom_fn=CustomClassConfig(path=path, name="length_reward"))
    with pytest.raises(ValueError, match="are both set"):
        RewardManager.from_config(both, score_fn=lambda *a: 1.0)
