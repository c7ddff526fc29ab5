"""TrainBatch.from_flat (and from_sequences on top of it) against the row-by-row layout it
replaced (tests/rollout/object_gather.py)."""
import random

import pytest
import torch

from tests.rollout.object_gather import old_from_sequences
from verl_mcore.engine.batch import TrainBatch

VOCAB = 128_256
PAD = 7


def test_from_flat_equals_row_by_row_layout_and_shares_prompts():
    rng = random.Random(0)
    for _ in range(20):
        b = rng.randint(1, 12)
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(b)]
        responses = [[rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 4, 9]))] for _ in range(b)]
        want = old_from_sequences(prompts, responses, PAD)
        got = TrainBatch.from_sequences(prompts, responses, PAD)
        for field in ("input_ids", "prompt_lens", "seq_lens", "response_mask"):
            assert torch.equal(getattr(want, field), getattr(got, field)), field
    # Samples pointing at one prompt (prompt_of) get that prompt's tokens.
    ids = torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32)
    got = TrainBatch.from_flat(ids[:3], torch.tensor([2, 1]), ids[3:],
                               torch.tensor([1, 0, 1]), PAD, prompt_of=torch.tensor([1, 0, 0]))
    assert got.input_ids.tolist() == [[7, 8, PAD], [5, 6, PAD], [5, 6, 9]]
    assert got.response_mask.tolist() == [[1.0], [0.0], [1.0]]


def test_from_flat_names_inconsistent_buffers():
    with pytest.raises(ValueError, match="response_ids .* sum\\(response_lens\\)=3"):
        TrainBatch.from_flat(torch.tensor([1]), torch.tensor([1]), torch.tensor([2, 3]),
                             torch.tensor([3]), PAD)
    with pytest.raises(ValueError, match="prompt_of"):
        TrainBatch.from_flat(torch.tensor([1]), torch.tensor([1]), torch.tensor([2]),
                             torch.tensor([1]), PAD, prompt_of=torch.tensor([1]))


def test_concat_equals_the_batch_of_all_samples_at_once():
    rng = random.Random(1)
    for _ in range(10):
        parts, prompts, responses = [], [], []
        for _ in range(rng.randint(1, 4)):
            b = rng.randint(1, 5)
            p = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(b)]
            r = [[rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 4, 9]))] for _ in range(b)]
            parts.append(TrainBatch.from_sequences(p, r, PAD))
            prompts += p
            responses += r
        want = TrainBatch.from_sequences(prompts, responses, PAD)
        got = TrainBatch.concat(parts, PAD)
        for field in ("input_ids", "prompt_lens", "seq_lens", "response_mask"):
            assert torch.equal(getattr(want, field), getattr(got, field)), field


def test_concat_pads_optional_fields_and_wants_them_everywhere_or_nowhere():
    a = TrainBatch.from_sequences([[1, 2]], [[3, 4, 5]], PAD)
    b = TrainBatch.from_sequences([[1]], [[3]], PAD)
    a.advantages, b.advantages = torch.ones(1, 3), torch.full((1, 1), 2.0)
    got = TrainBatch.concat([a, b], PAD)
    assert got.advantages.tolist() == [[1.0, 1.0, 1.0], [2.0, 0.0, 0.0]]
    assert got.response_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert got.old_log_probs is None
    b.advantages = None
    with pytest.raises(ValueError, match=r"advantages is set in batches \[0\] but not"):
        TrainBatch.concat([a, b], PAD)
    with pytest.raises(ValueError, match="no batches"):
        TrainBatch.concat([], PAD)
