"""The weight-sync check's default bound follows the actor's compute dtype: bf16 runs of a real
model (SmolLM2-135M-Instruct, one H100) differ from the trainer by up to 0.85 nats on a sampled
token with correct weights, which stopped GRPO at the old 0.5 (bench/RESULTS.md 2026-12-07)."""
import pytest

from verl_mcore.config import Config
from verl_mcore.config.schema import LOGPROB_CHECK_BOUND, logprob_check_bound
from verl_mcore.generation import rollout_as_run
from verl_mcore.rollout.sync_check import WeightSyncError, _verdict


@pytest.mark.parametrize("dtype, bound", [("fp32", 0.5), ("bf16", 2.0), ("fp16", 2.0)])
def test_default_bound_by_dtype(dtype, bound):
    cfg = Config.load(None, [f"actor.dtype={dtype}"])
    assert cfg.rollout.logprob_check.max_abs_diff is None
    assert logprob_check_bound(cfg) == bound == LOGPROB_CHECK_BOUND[dtype]
    # What the generation phase and its check read.
    assert rollout_as_run(cfg).logprob_check.max_abs_diff == bound


def test_an_explicit_bound_wins():
    cfg = Config.load(None, ["actor.dtype=bf16", "rollout.logprob_check.max_abs_diff=0.25"])
    assert rollout_as_run(cfg).logprob_check.max_abs_diff == 0.25


def test_the_real_models_bf16_difference_passes_and_wrong_weights_do_not():
    bf16 = logprob_check_bound(Config.load(None, ["actor.dtype=bf16"]))
    assert _verdict(0.8471, 0.0325, 59, bf16)["rollout/logprob_diff_max"] == 0.8471
    with pytest.raises(WeightSyncError, match="max_abs_diff=2.0"):
        _verdict(3.2, 1.1, 59, bf16)
    with pytest.raises(WeightSyncError):  # fp32 keeps the tight bound
        _verdict(0.8471, 0.0325, 59, logprob_check_bound(Config.load(None, ["actor.dtype=fp32"])))
