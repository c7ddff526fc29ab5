"""The trajectory type (rollout/batch.py Rollout): one batch from the engine's outputs to the
loss. Picking samples, joining batches and saving them keep every sample's tokens, per-token
fields, turns, rows and group with it, checked against the samples the engine gave; the learner's
view is laid out from what was sampled; the trajectory metrics appear only where they say
something."""
from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch

from tests.rollout.test_gather import INFO, PAD, VOCAB  # an injective stand-in tokenizer
from verl_mcore.data import PromptBatch
from verl_mcore.rollout.base import SampleOutput
from verl_mcore.rollout.batch import Rollout


def _batch(seed: int, prompts: int = 3, n: int = 2, mask: bool = True, versions=None):
    """A replica's batch: responses of 0-6 tokens, log-probs, a loss mask with holes (`mask`),
    per-token versions (`versions`: their base), turns 1-3."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi, k):
        return torch.randint(lo, hi, (k,), generator=g).tolist()

    batch = PromptBatch(indices=list(range(prompts)),
                        input_ids=[ints(3, VOCAB, 1 + i % 4) for i in range(prompts)],
                        rows=[{"prompt": seed * 100 + i} for i in range(prompts)])
    outs = []
    for p in range(prompts):
        for s in range(n):
            k = int(ints(0, 7, 1)[0])
            o = SampleOutput(p, s, ints(3, VOCAB, k), [-0.5 * t - seed for t in range(k)],
                             ["stop", "length", "aborted"][(p + s) % 3], turns=1 + (p * n + s) % 3)
            if mask and k >= 2:
                o.loss_mask = [1] + ints(0, 2, k - 1)
            if versions is not None:
                o.versions = [versions + t % 2 for t in range(k)]
            if s % 2:  # an environment's reward on some samples only
                o.reward = 0.25 * p - s
            outs.append(o)
    return batch, outs


def _samples(r: Rollout):
    """Each sample as the engine gave it: (prompt ids, response ids, row, finish, turns, group,
    per-token fields as lists)."""
    prompts, responses = r.token_ids(range(r.num_samples))
    ends = r.response_lens.cumsum(0).tolist()
    out = []
    for i in range(r.num_samples):
        lo, hi = ends[i] - int(r.response_lens[i]), ends[i]
        fields = {k: v[lo:hi].tolist() for k, v in r.token_fields.items()}
        reward = float(r.sampled_rewards[i])
        out.append((prompts[i], responses[i], r.rows[i], r.finish[i], int(r.turns[i]),
                    int(r.group_ids[i]), fields, None if math.isnan(reward) else reward))
    return out


def test_select_keeps_each_sample_whole_and_only_its_prompts():
    prompts, outs = _batch(1, prompts=4, n=3)
    r = Rollout.from_outputs(prompts, outs, VOCAB).for_learner(INFO)
    pick = [10, 2, 3, 11, 0]
    got = r.select(pick)
    want = _samples(r)
    assert _samples(got) == [want[i] for i in pick]
    assert len(got.prompt_rows) == 3  # prompts 0 and 3 (and 1): the used ones, once each
    assert got.responses == [r.responses[i] for i in pick]
    assert torch.equal(got.train.input_ids, r.train.input_ids[pick])
    assert torch.equal(got.engine_log_probs, r.engine_log_probs[pick])
    # The view laid out again from the picked samples holds the same tokens and mask.
    again = dataclasses.replace(got, train=None).for_learner(INFO)
    width = again.train.response_width
    assert torch.equal(again.train.response_mask, got.train.response_mask[:, :width])
    assert not bool(got.train.response_mask[:, width:].any())


def test_concat_renumbers_groups_and_fills_what_one_part_lacks():
    a = dataclasses.replace(Rollout.from_outputs(*_batch(2, versions=5), VOCAB), version=4)
    b = dataclasses.replace(Rollout.from_outputs(*_batch(3, mask=False), VOCAB), version=6)
    b.token_fields.pop("logprobs")
    joined = Rollout.concat([a, b], PAD)
    assert joined.version == 4  # the oldest part's
    assert joined.group_ids.tolist() == a.group_ids.tolist() + (b.group_ids + 3).tolist()
    assert "logprobs" not in joined.token_fields  # one part lacks them: no default exists
    sa, sb = _samples(a), _samples(b)
    for got, want, version in zip(_samples(joined), sa + sb, [None] * len(sa) + [6] * len(sb)):
        assert got[:5] == want[:5] and got[7] == want[7]
        fields = got[6]
        if version is None:  # a's own versions and mask
            assert fields["versions"] == want[6]["versions"]
            assert fields["loss_mask"] == want[6]["loss_mask"]
        else:  # b carried neither: its version on every token, every token trains
            assert fields["versions"] == [version] * len(want[1])
            assert fields["loss_mask"] == [1] * len(want[1])
    with pytest.raises(ValueError, match=r"scores is set in parts \[0\] and not in the others"):
        Rollout.concat([a.scored(torch.zeros(a.num_samples), {}), b], PAD)
    with pytest.raises(ValueError, match=r"train \(the learner's view: Rollout.for_learner\) is "
                                         r"set in parts \[1\]"):
        Rollout.concat([a, b.for_learner(INFO)], PAD)


def test_a_saved_batch_loads_whole_and_old_checkpoints_without_turns_load():
    prompts, outs = _batch(4, versions=1)
    r = dataclasses.replace(Rollout.from_outputs(prompts, outs, VOCAB), index=7, version=2,
                            greedy=Rollout.from_outputs(*_batch(5, n=1), VOCAB))
    buf = io.BytesIO()
    torch.save(r.state(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # plain tensors: nothing that executes code
    got = Rollout.from_state(saved, prompts.rows)
    assert (got.index, got.version, got.greedy.index, got.greedy.version) == (7, 2, 7, 2)
    assert _samples(got) == _samples(r)
    assert _samples(got.greedy)[0][:2] == _samples(r.greedy)[0][:2]
    p = len(r.prompt_lens)
    # Saved with turns, before sampled rewards were carried (2b9386c..0c01e50): P + 4B
    # integers; the turns kept, no sampled reward (NaN).
    four = dict(saved["part"], integers=saved["part"]["integers"][:p + 4 * r.num_samples])
    with_turns = Rollout.from_state(dict(saved, part=four), prompts.rows)
    assert with_turns.turns.tolist() == r.turns.tolist() and 1 < max(r.turns.tolist())
    assert bool(with_turns.sampled_rewards.isnan().all())
    # Before turns were carried: P + 3B integers; every sample one turn.
    saved["part"]["integers"] = saved["part"]["integers"][:p + 3 * r.num_samples]
    old = Rollout.from_state(saved, prompts.rows)
    assert old.turns.tolist() == [1] * r.num_samples
    saved["part"]["integers"] = saved["part"]["integers"][:-1]
    with pytest.raises(ValueError, match="batch 7 sampled ahead.*integers"):
        Rollout.from_state(saved, prompts.rows)


def test_trajectory_metrics_only_where_they_say_something():
    plain = Rollout.from_outputs(*_batch(6, mask=False), VOCAB)
    plain = dataclasses.replace(plain, turns=torch.ones(plain.num_samples, dtype=torch.int64))
    assert plain.trajectory_metrics(3) == {}  # one turn, no mask, the batch's version
    prompts, outs = _batch(7, versions=2)
    r = Rollout.from_outputs(prompts, outs, VOCAB)
    m = r.trajectory_metrics(5)
    trains = [(v, mask) for o in outs for v, mask in zip(o.versions, o.loss_mask or [1] * 9)]
    ages = [5 - v for v, mask in trains if mask]
    assert m["rollout/token_age/mean"] == pytest.approx(sum(ages) / len(ages))
    assert m["rollout/token_age/max"] == max(ages)
    assert m["rollout/token_version/min"] == min(v for v, mask in trains if mask)
    turns = [o.turns for o in outs]
    assert m["rollout/turns/mean"] == pytest.approx(sum(turns) / len(turns))
    assert m["rollout/turns/max"] == max(turns)
    holes = [mask for o in outs for mask in (o.loss_mask or [1] * len(o.token_ids))]
    assert m["rollout/masked_token_share"] == pytest.approx(1 - sum(holes) / len(holes))


def test_sampled_rewards_come_from_the_outputs():
    prompts, outs = _batch(9)
    got = [s[7] for s in _samples(Rollout.from_outputs(prompts, outs, VOCAB))]
    assert got == [o.reward for o in outs] and any(g is None for g in got)
    outs[1].reward = float("inf")
    with pytest.raises(ValueError, match="reward of prompt 0 sample 1 is inf"):
        Rollout.from_outputs(prompts, outs, VOCAB)


def test_bad_turns_name_the_sample():
    prompts, outs = _batch(8)
    outs[3].turns = -1
    with pytest.raises(ValueError, match=r"turns of \(prompt, sample\) \[\(1, 1\)\]"):
        Rollout.from_outputs(prompts, outs, VOCAB)


def test_concat_of_parts_sampled_with_other_weights_keeps_each_tokens_version():
    """Neither part carries per-token versions, but they were sampled with other weights: the
    joined batch's version is the oldest, and each token still says which weights sampled it
    (the learner's token ages see the mix). Parts of one version stay without the field."""
    a = dataclasses.replace(Rollout.from_outputs(*_batch(2, mask=False), VOCAB), version=4)
    b = dataclasses.replace(Rollout.from_outputs(*_batch(3, mask=False), VOCAB), version=6)
    joined = Rollout.concat([a, b], PAD)
    assert joined.version == 4
    want = [4] * a.num_tokens + [6] * b.num_tokens
    assert joined.token_field("versions").tolist() == want
    m = joined.trajectory_metrics(6)
    assert m["rollout/token_age/max"] == 2 and m["rollout/token_version/min"] == 4
    assert m["rollout/token_age/mean"] == pytest.approx(2 * a.num_tokens / len(want))
    same = Rollout.concat([a, dataclasses.replace(b, version=4)], PAD)
    assert "versions" not in same.token_fields
    assert not any(k.startswith("rollout/token_") for k in same.trajectory_metrics(4))


def test_concat_a_part_without_response_tokens_has_no_say_in_the_fields():
    """A part whose responses are all empty carries no log-probs (from_outputs: nothing to give),
    as an empty replica in the gather: joined with parts that carry them, the batch keeps the
    engine's log-probs (flat and the learner's [B, R]) instead of dropping them for everyone."""
    prompts, outs = _batch(10, prompts=2, n=2)
    for o in outs:
        o.token_ids, o.logprobs, o.loss_mask = [], [], None
    empty = Rollout.from_outputs(prompts, outs, VOCAB)
    assert "logprobs" not in empty.token_fields and empty.num_tokens == 0
    full = Rollout.from_outputs(*_batch(11), VOCAB)
    for parts in ([empty, full], [full, empty]):
        joined = Rollout.concat(parts, PAD)
        assert torch.equal(joined.logprobs, full.logprobs)
        views = Rollout.concat([p.for_learner(INFO) for p in parts], PAD)
        again = dataclasses.replace(views, train=None).for_learner(INFO)
        assert torch.equal(views.engine_log_probs, again.engine_log_probs)
        assert torch.equal(views.train.response_mask, again.train.response_mask)
    assert Rollout.concat([empty.for_learner(INFO)] * 2, PAD).engine_log_probs is None


def test_a_saved_batch_keeps_its_groups_and_refuses_too_few_rows():
    """Groups that are not one per prompt (from_samples' group ids) survive a checkpoint; a
    loader that hands back fewer dataset rows than the saved batch has prompts (another data
    file) fails at the load naming the batch, not later as an IndexError in the scorer."""
    pairs = Rollout.from_samples([([1], {"i": i}, [2, 3], "stop") for i in range(4)], VOCAB,
                                 group_ids=[0, 0, 1, 1])
    saved = dataclasses.replace(pairs, index=7).state()
    assert Rollout.from_state(saved, pairs.prompt_rows).group_ids.tolist() == [0, 0, 1, 1]
    del saved["part"]["group_ids"]  # a checkpoint from before: one group per prompt
    assert Rollout.from_state(saved, pairs.prompt_rows).group_ids.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="batch 7 sampled ahead.*4 prompts.*2 dataset rows"):
        Rollout.from_state(saved, pairs.prompt_rows[:2])


def test_select_refuses_a_mask_it_would_read_as_indices_0_and_1():
    r = Rollout.from_outputs(*_batch(12), VOCAB)
    keep = torch.tensor([True, False] * (r.num_samples // 2))
    with pytest.raises(ValueError, match="sample indices, not a mask.*nonzero"):
        r.select(keep)
    with pytest.raises(ValueError, match="sample indices, not a mask"):
        r.select(keep.tolist())
    assert _samples(r.select(keep.nonzero().flatten())) == _samples(r)[::2]


def test_sampled_rewards_of_another_float_dtype_cross_as_float64():
    """The wire carries the sampled rewards' float64 bits among the integers: float32 rewards
    (torch.tensor of a list of floats) viewed as int64 gave half as many, and every value after
    them was cut in the wrong place."""
    prompts, outs = _batch(13)
    r = Rollout.from_outputs(prompts, outs, VOCAB)
    rewards = torch.arange(r.num_samples, dtype=torch.float32) / 4
    r = dataclasses.replace(r, sampled_rewards=rewards)
    assert r.integers().numel() == len(r.prompt_lens) + 5 * r.num_samples
    got = Rollout.from_state(r.state(), prompts.rows)
    assert got.sampled_rewards.tolist() == rewards.tolist() and _samples(got) == _samples(r)


def test_the_response_text_is_what_the_model_wrote():
    """With a loss mask the decoded response leaves out the tokens of mask 0 (an observation
    that quotes the answer must not earn the reward); without one it is every token."""
    prompts, outs = _batch(10, mask=True)
    r = Rollout.from_outputs(prompts, outs, VOCAB).for_learner(INFO)
    for o, text in zip(outs, r.responses):
        mask = o.loss_mask or [1] * len(o.token_ids)
        assert text == " ".join(str(t) for t, m in zip(o.token_ids, mask) if m)
    plain = Rollout.from_outputs(*_batch(10, mask=False), VOCAB).for_learner(INFO)
    assert plain.responses == [" ".join(map(str, o.token_ids)) for o in _batch(10, mask=False)[1]]
