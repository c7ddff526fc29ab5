"""Experiences and ExperienceBuffer on rollouts built by the trainer's own make_rollout: a
concatenation is the batch of all the samples at once, mini-batches and samples keep each
prompt's group whole, and draws are the same for the same seed (every rank's)."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from verl_mcore.api import ExperienceBuffer, Experiences
from verl_mcore.build import ModelInfo
from verl_mcore.config import Config
from verl_mcore.rollout.batch import make_rollout
from verl_mcore.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def policy():
    tok = build_tokenizer()
    return SimpleNamespace(info=ModelInfo(SimpleNamespace(vocab_size=len(tok)), tok, None, None))


def _samples(first_prompt: int, prompts: int, n: int):
    """(prompt ids, row, response ids, finish) for `prompts` prompts x n samples, and group ids
    0..prompts-1; lengths differ so that the batches' widths differ."""
    out, groups = [], []
    for p in range(prompts):
        for s in range(n):
            k = first_prompt + p
            out.append(([1, 2, 3][:1 + k % 3], {"id": k}, [4 + s] * (1 + (k + s) % 4), "stop"))
            groups.append(p)
    return out, groups


def _experiences(policy, first_prompt, prompts, n=2, version=0, cfg=None):
    samples, groups = _samples(first_prompt, prompts, n)
    rollout = make_rollout(samples, groups, policy.info)
    scores = torch.arange(len(samples), dtype=torch.float32) + 100 * first_prompt
    rollout = dataclasses.replace(rollout, version=version)
    return Experiences(rollout.scored(scores, {"rule/exact": [float(i) for i in range(len(samples))]}),
                       {"m": 1.0}, cfg or Config(), policy)


def test_concat_is_the_batch_of_all_samples(policy):
    a, b = _experiences(policy, 0, 2), _experiences(policy, 2, 3)
    both = Experiences.concat([a, b])
    samples, _ = _samples(0, 5, 2)
    whole = make_rollout(samples, [i // 2 for i in range(10)], policy.info)
    for name in ("input_ids", "prompt_lens", "seq_lens", "response_mask"):
        assert torch.equal(getattr(both.rollout.train, name), getattr(whole.train, name)), name
    assert both.rollout.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # apart, in order
    assert [r["id"] for r in both.rollout.rows] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert both.scores.tolist() == a.scores.tolist() + b.scores.tolist()
    assert both.extras["rule/exact"] == a.extras["rule/exact"] + b.extras["rule/exact"]
    assert both.num_prompts == 5 and both.num_samples == 10 and both.metrics == {}


def test_concat_refuses_other_policies_and_settings(policy):
    a = _experiences(policy, 0, 2)
    other = SimpleNamespace(info=policy.info)
    with pytest.raises(ValueError, match="another Policy"):
        Experiences.concat([a, _experiences(other, 2, 2)])
    hotter = Config.load(None, ["rollout.temperature=0.5"])
    with pytest.raises(ValueError, match="other rollout.\\* settings"):
        Experiences.concat([a, _experiences(policy, 2, 2, cfg=hotter)])
    with pytest.raises(ValueError, match="the buffer is empty"):
        ExperienceBuffer().batch()


def test_mini_batches_keep_groups_whole_and_cover_the_buffer(policy):
    buffer = ExperienceBuffer()
    buffer.add(_experiences(policy, 0, 3, n=3))
    buffer.add(_experiences(policy, 3, 2, n=3))
    assert len(buffer) == 15 and buffer.num_prompts == 5
    for shuffle in (False, True):
        minis = list(buffer.mini_batches(2, shuffle=shuffle, seed=7))
        assert [m.num_prompts for m in minis] == [2, 2, 1]
        seen = []
        for m in minis:
            ids = m.rollout.group_ids.tolist()
            assert all(ids.count(g) == 3 for g in ids)  # every group whole
            assert ids == sorted(ids, key=ids.index)    # and its samples consecutive
            seen += [r["id"] for r in m.rollout.rows[::3]]
        assert sorted(seen) == [0, 1, 2, 3, 4]
        if not shuffle:
            assert seen == [0, 1, 2, 3, 4]
    assert [m.num_prompts for m in buffer.mini_batches(2, drop_last=True)] == [2, 2]
    same = [[r["id"] for r in m.rollout.rows] for m in buffer.mini_batches(2, shuffle=True, seed=7)]
    again = [[r["id"] for r in m.rollout.rows] for m in buffer.mini_batches(2, shuffle=True, seed=7)]
    assert same == again


def test_sample_draws_whole_groups_by_seed(policy):
    buffer = ExperienceBuffer()
    buffer.add(_experiences(policy, 0, 6))
    first = buffer.sample(3)
    assert first.num_prompts == 3 and first.num_samples == 6
    assert len({r["id"] for r in first.rollout.rows}) == 3  # without replacement
    fresh = ExperienceBuffer()
    fresh.add(_experiences(policy, 0, 6))
    assert fresh.sample(3).scores.tolist() == first.scores.tolist()  # call 0: seed 0 on every rank
    assert buffer.sample(3, seed=0).scores.tolist() == first.scores.tolist()
    with pytest.raises(ValueError, match="holds 6 prompts"):
        buffer.sample(7)
    buffer.clear()
    assert len(buffer) == 0


def test_select_groups_and_errors(policy):
    exp = _experiences(policy, 0, 3)
    picked = exp.select_groups([2, 0])
    assert [r["id"] for r in picked.rollout.rows] == [2, 2, 0, 0]
    assert picked.scores.tolist() == [4.0, 5.0, 0.0, 1.0]
    assert picked.extras["rule/exact"] == [4.0, 5.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="none of the groups"):
        exp.select_groups([9])
    with pytest.raises(TypeError, match="takes Experiences"):
        ExperienceBuffer().add(exp.rollout)


def test_selected_groups_keep_their_engine_log_probs(policy):
    """RolloutWorker.generate hands out the engine's log-probs (the weight-sync check asks for
    them): a mini-batch or a sample must carry its own rows of them, which the update compares
    with the old log-probs (Learner.off_policy; rollout.tis_cap weighs by them)."""
    import dataclasses

    exp = _experiences(policy, 0, 3)
    width = exp.rollout.train.response_mask.shape[1]
    engine = torch.arange(exp.num_samples * width, dtype=torch.float32).view(-1, width)
    exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, engine_log_probs=engine))
    picked = exp.select_groups([2, 0])
    rows = [4, 5, 0, 1]  # group 2's samples, then group 0's
    assert torch.equal(picked.rollout.engine_log_probs, engine[rows])
    buffer = ExperienceBuffer()
    buffer.add(exp)
    for mini in buffer.mini_batches(2):
        assert mini.rollout.engine_log_probs.shape[0] == mini.num_samples
