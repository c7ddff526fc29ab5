"""rollout.dtype: its values, the engines it serves, and the weight-sync check's bound it widens."""
import pytest

from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.config.schema import FP8_LOGPROB_ALLOWANCE, LOGPROB_CHECK_BOUND, logprob_check_bound
from verl_mcore.generation import rollout_as_run


@pytest.mark.parametrize("actor", ["fp32", "bf16", "fp16"])
def test_fp8_widens_the_default_bound_of_the_actors_dtype(actor):
    auto = Config.load(None, [f"actor.dtype={actor}"])
    fp8 = Config.load(None, [f"actor.dtype={actor}", "rollout.dtype=fp8"])
    assert auto.rollout.dtype == "auto"
    assert logprob_check_bound(auto) == LOGPROB_CHECK_BOUND[actor]
    assert logprob_check_bound(fp8) == LOGPROB_CHECK_BOUND[actor] + FP8_LOGPROB_ALLOWANCE
    # what the generation phase and its check read
    assert rollout_as_run(fp8).logprob_check.max_abs_diff == LOGPROB_CHECK_BOUND[actor] + 3.0


def test_an_explicit_bound_wins_over_the_fp8_default():
    cfg = Config.load(None, ["rollout.dtype=fp8", "rollout.logprob_check.max_abs_diff=0.75"])
    assert logprob_check_bound(cfg) == 0.75


BASE = ["model.path=/m", "data.train_files=[a.parquet]", "rollout.n=2", "rollout.dtype=fp8"]


def test_fp8_is_the_native_engines_and_other_values_are_refused():
    validate(Config.load(None, BASE), 1, data_files=False)
    with pytest.raises(ConfigError, match="rollout.dtype=fp8 is the native engine's.*rollout.engine=vllm"):
        validate(Config.load(None, BASE + ["rollout.engine=vllm"]), 1, data_files=False)
    with pytest.raises(ConfigError, match="rollout.dtype"):
        Config.load(None, ["rollout.dtype=bf16"])
