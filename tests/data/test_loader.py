"""Deterministic shuffle, data-parallel sharding and exact resume of the prompt loader."""
import pytest

from tests.data.files import gsm8k_rows, write_rows
from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import PromptLoader, RLHFDataset


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = write_rows(str(tmp_path_factory.mktemp("d") / "a.parquet"), gsm8k_rows(22), "parquet")
    return RLHFDataset(path, make_tiny_tokenizer(), DataConfig())


def take(loader, k):
    return [next(loader).indices for _ in range(k)]


def test_same_seed_same_order_other_seed_other_order(ds):
    a = take(PromptLoader(ds, 4, seed=3), 10)
    assert a == take(PromptLoader(ds, 4, seed=3), 10)
    assert a != take(PromptLoader(ds, 4, seed=4), 10)
    assert take(PromptLoader(ds, 4, shuffle=False), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_each_epoch_is_a_fresh_permutation_without_repeats(ds):
    loader = PromptLoader(ds, 4, seed=0)
    assert loader.batches_per_epoch == 5  # 22 // 4: the tail of 2 is dropped each epoch
    epoch0 = sum(take(loader, 5), [])
    epoch1 = sum(take(loader, 5), [])
    assert len(set(epoch0)) == 20 and len(set(epoch1)) == 20 and epoch0 != epoch1


def test_sharding_splits_each_global_batch(ds):
    whole = take(PromptLoader(ds, 6, seed=1), 7)
    ranks = [take(PromptLoader(ds, 6, seed=1, rank=r, world_size=3), 7) for r in range(3)]
    for step in range(7):
        assert sum((ranks[r][step] for r in range(3)), []) == whole[step]
    with pytest.raises(ValueError, match="do not split over 4"):
        PromptLoader(ds, 6, world_size=4)


@pytest.mark.parametrize("stop", [3, 5, 12])  # inside an epoch, at its end, a later epoch
def test_resume_sees_exactly_the_same_prompts(ds, stop):
    reference = PromptLoader(ds, 4, seed=7, rank=1, world_size=2)
    expected = take(reference, stop + 8)
    first = PromptLoader(ds, 4, seed=7, rank=1, world_size=2)
    assert take(first, stop) == expected[:stop]
    state = first.state_dict()
    resumed = PromptLoader(ds, 4, seed=7, rank=1, world_size=2)
    resumed.load_state_dict(dict(state))
    assert take(resumed, 8) == expected[stop:]
    # a resume on another number of ranks continues the same global batches
    other = [PromptLoader(ds, 4, seed=7, rank=r, world_size=4) for r in range(4)]
    for loader in other:
        loader.load_state_dict(dict(state))
    glob = [sum(parts, []) for parts in zip(*(take(l, 2) for l in other))]
    assert glob == take(PromptLoader(ds, 4, seed=7), stop + 2)[stop:]


def test_resume_refuses_a_different_ordering(ds):
    state = PromptLoader(ds, 4, seed=7).state_dict()
    with pytest.raises(ValueError, match="seed=7"):
        PromptLoader(ds, 4, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=4"):
        PromptLoader(ds, 2, seed=7).load_state_dict(state)


def test_validation_pass_covers_every_prompt_once(ds):
    shards = [list(PromptLoader(ds, 8, rank=r, world_size=3, shuffle=False, drop_last=False,
                                num_epochs=1)) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    seen = sorted(i for s in shards for b in s for i in b.indices)
    assert seen == list(range(22))


def test_batch_fields_and_padding(ds):
    batch = next(PromptLoader(ds, 4, shuffle=False))
    assert batch.column("category") == ["math"] * 4
    assert [r["reward_model"]["ground_truth"] for r in batch.rows] == ["0", "1", "2", "3"]
    batch.input_ids[1] = batch.input_ids[1][:3]
    ids, lengths = batch.padded(pad_token_id=0)
    assert ids.shape == (4, lengths.max()) and lengths.tolist()[1] == 3
    assert ids[1].tolist() == [0] * (ids.shape[1] - 3) + batch.input_ids[1]
    right, _ = batch.padded(pad_token_id=0, side="right")
    assert right[1, :3].tolist() == batch.input_ids[1]
