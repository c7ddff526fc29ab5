"""rollout.correction read where it acts: Learner.off_policy (the actor's loss mask and weights,
the metrics), Learner.needs_old_log_probs (the old-log-prob pass), Sampler.sampling (the engine's
log-probs), the validation's errors. Each key's test fails if its reader is removed. CPU, < 1 s
after the imports."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_mcore.algo.off_policy import decoupled_weights, sequence_ratio_mask, token_ratio_mask
from verl_mcore.algo.policy_loss import truncated_is_weights
from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.learner import Learner
from verl_mcore.sampler import Sampler

ROOT = Path(__file__).resolve().parents[1]
# One on-policy optimizer step (16 prompts, mini-batch 16, one epoch): without a correction the
# update needs no old-log-prob pass.
ON_POLICY = ["actor.ppo_epochs=1", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16"]
CORRECTIONS = {
    "token_mask": ["rollout.correction.token_mask=1.5"],
    "seq_mask": ["rollout.correction.seq_mask=1.2"],
    "decoupled": ["rollout.correction.decoupled=true"],
    "decoupled_cap": ["rollout.correction.decoupled=true", "rollout.correction.decoupled_cap=1.3"],
    "tis_cap": ["rollout.tis_cap=1.5"],
}


def _cfg(*overrides: str) -> Config:
    return Config.load(str(ROOT / "configs/quickstart.yaml"), [*ON_POLICY, *overrides])


def _step(seed: int = 0):
    """(rollout, batch) stand-ins with what off_policy reads: [8, 6] log-probs whose ratios
    spread over about e^-1..e^1, a mask with a short row and a hole."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(8, 6, generator=g) * 3
    engine = old + torch.randn(8, 6, generator=g) * 0.5
    mask = torch.ones(8, 6)
    mask[1, 3:] = 0
    mask[4, 2] = 0
    batch = SimpleNamespace(old_log_probs=old, response_mask=mask, is_weights=None)
    return SimpleNamespace(engine_log_probs=engine), batch


def _off_policy(*overrides: str):
    rollout, batch = _step()
    metrics, actor_mask = Learner(_cfg(*overrides), None, "cpu", None).off_policy(rollout, batch)
    return metrics, actor_mask, batch, rollout


def test_token_mask_is_read():
    metrics, actor_mask, batch, rollout = _off_policy(*CORRECTIONS["token_mask"])
    want, _ = token_ratio_mask(batch.old_log_probs, rollout.engine_log_probs,
                               batch.response_mask, 1.5)
    assert actor_mask is not None and torch.equal(actor_mask, want)
    assert 0 < metrics["rollout/token_mask_fraction"] < 1 and batch.is_weights is None


def test_seq_mask_is_read():
    metrics, actor_mask, batch, rollout = _off_policy(*CORRECTIONS["seq_mask"])
    want, _ = sequence_ratio_mask(batch.old_log_probs, rollout.engine_log_probs,
                                  batch.response_mask, 1.2)
    assert actor_mask is not None and torch.equal(actor_mask, want)
    assert 0 < metrics["rollout/seq_mask_fraction"] < 1


def test_both_masks_multiply():
    _, both, batch, rollout = _off_policy("rollout.correction.token_mask=1.5",
                                          "rollout.correction.seq_mask=1.2")
    args = (batch.old_log_probs, rollout.engine_log_probs, batch.response_mask)
    assert torch.equal(both, token_ratio_mask(*args, 1.5)[0] * sequence_ratio_mask(*args, 1.2)[0])


@pytest.mark.parametrize("name, cap", [("decoupled", None), ("decoupled_cap", 1.3)])
def test_decoupled_and_its_cap_are_read(name, cap):
    metrics, actor_mask, batch, rollout = _off_policy(*CORRECTIONS[name])
    want, _ = decoupled_weights(batch.old_log_probs, rollout.engine_log_probs,
                                batch.response_mask, cap)
    assert actor_mask is None and torch.equal(batch.is_weights, want)
    assert (metrics["rollout/decoupled_capped_fraction"] > 0) == (cap is not None)


def test_tis_cap_alone_keeps_its_weights_and_exactly_its_metrics():
    """The drift recordings (tests/e2e/drift) hold these three keys for a tis_cap run: a
    correction must add none of its own there."""
    metrics, actor_mask, batch, rollout = _off_policy(*CORRECTIONS["tis_cap"])
    want, _ = truncated_is_weights(batch.old_log_probs, rollout.engine_log_probs,
                                   batch.response_mask, 1.5)
    assert torch.equal(batch.is_weights, want) and actor_mask is None
    assert sorted(metrics) == ["rollout/engine_vs_trainer_logp_diff",
                               "rollout/tis_clip_fraction", "rollout/tis_weight_mean"]


def test_tis_cap_with_a_mask_is_icepop():
    _, actor_mask, batch, _ = _off_policy("rollout.tis_cap=1.5",
                                      "rollout.correction.token_mask=1.5")
    assert batch.is_weights is not None and actor_mask is not None
    # Kept tokens are within [1/1.5, 1.5]: the cap truncates none of them.
    kept = actor_mask.bool()
    ratio = (batch.old_log_probs - _step()[0].engine_log_probs).exp()
    assert torch.allclose(batch.is_weights[kept], ratio[kept])


def test_a_correction_without_engine_log_probs_is_an_error():
    rollout, batch = _step()
    rollout.engine_log_probs = None
    with pytest.raises(ValueError, match="rollout.correction is on, but the rollout batch has no "
                                         "engine log-probs"):
        Learner(_cfg(*CORRECTIONS["seq_mask"]), None, "cpu", None).off_policy(rollout, batch)
    # tis_cap as before: nothing to weigh, nothing done
    assert Learner(_cfg(*CORRECTIONS["tis_cap"]), None, "cpu", None).off_policy(rollout, batch) \
        == ({}, None)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_each_correction_runs_the_old_log_prob_pass_and_asks_for_engine_log_probs(name):
    batch = SimpleNamespace(num_samples=16 * 8)  # train_batch_size x rollout.n
    info = SimpleNamespace(eos_token_ids=[2])
    plain = _cfg()
    assert not Learner(plain, None, "cpu", None).needs_old_log_probs(batch)
    assert not Sampler(plain, info, None).sampling(8, 1.0, 0).logprobs
    cfg = _cfg(*CORRECTIONS[name])
    assert Learner(cfg, None, "cpu", None).needs_old_log_probs(batch)
    assert Sampler(cfg, info, None).sampling(8, 1.0, 0).logprobs


@pytest.mark.parametrize("overrides, message", [
    (["rollout.correction.token_mask=1.0"], "rollout.correction.token_mask=1.0 must be > 1"),
    (["rollout.correction.seq_mask=0.5"], "rollout.correction.seq_mask=0.5 must be > 1"),
    (["rollout.correction.decoupled=true", "rollout.correction.decoupled_cap=0"],
     "rollout.correction.decoupled_cap=0.0 must be > 0"),
    (["rollout.correction.decoupled_cap=2.0"],
     "rollout.correction.decoupled_cap=2.0 caps the weights of the decoupled objective, which is "
     "off: set rollout.correction.decoupled=true"),
    (["rollout.correction.decoupled=true", "rollout.tis_cap=2.0"],
     "rollout.correction.decoupled=true weighs each token by pi_old / pi_engine itself, and "
     "rollout.tis_cap=2.0 would set the same weights"),
    (["rollout.correction.token_mask=2.0", "rollout.engine=vllm", "rollout.top_p=0.9"],
     "rollout.correction weighs tokens by the engine's log-probs, which vLLM gives for the "
     "top-p / top-k truncated distribution"),
    (["rollout.correction.tokens_mask=2.0"], "tokens_mask"),
])
def test_validation_names_the_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(*overrides), 1, data_files=False)
    assert message in str(e.value)


def test_the_corrections_pass_validation():
    validate(_cfg("rollout.correction.token_mask=2.0", "rollout.correction.seq_mask=1.1",
                  "rollout.tis_cap=2.0"), 1, data_files=False)
    validate(_cfg("rollout.correction.decoupled=true", "rollout.correction.decoupled_cap=3.0"), 1,
             data_files=False)


def test_partial_rollouts_run_the_old_log_prob_pass_in_the_learner_and_the_planner():
    """rollout.partial trains tokens of earlier weights: an on-policy-shaped update still
    recomputes its old log-probs, and the planner's phase-time model counts the pass."""
    from verl_mcore.plan_time import _needs_old_log_probs

    batch = SimpleNamespace(num_samples=16 * 8)
    plain, partial = _cfg(), _cfg("rollout.partial.enable=true")
    assert not Learner(plain, None, "cpu", None).needs_old_log_probs(batch)
    assert not _needs_old_log_probs(plain)
    assert Learner(partial, None, "cpu", None).needs_old_log_probs(batch)
    assert _needs_old_log_probs(partial)
