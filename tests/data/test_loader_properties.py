"""Loader invariants over random sizes (hypothesis): sharding partitions each global batch,
an epoch never repeats a sample, and a resume at any step continues identically."""
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_mcore.data import PromptBatch, PromptLoader


class IndexOnly:
    """Just enough of a dataset for the loader: its length and batches of indices."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def get_batch(self, indices):
        return PromptBatch(list(indices), [[] for _ in indices], [{} for _ in indices])


@st.composite
def layouts(draw):
    world = draw(st.integers(1, 4))
    batch = world * draw(st.integers(1, 5))
    n = draw(st.integers(batch, 60))
    return n, batch, world, draw(st.integers(0, 3 * (n // batch) + 2)), draw(st.integers(0, 99))


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_sharding_epochs_and_resume(layout):
    n, batch, world, stop, seed = layout
    ds = IndexOnly(n)
    steps = stop + 2 * (n // batch) + 1
    full = PromptLoader(ds, batch, seed=seed)
    global_batches = [next(full).indices for _ in range(steps)]
    per_epoch = n // batch
    for e in range(steps // per_epoch):
        epoch = sum(global_batches[e * per_epoch:(e + 1) * per_epoch], [])
        assert len(set(epoch)) == len(epoch) == per_epoch * batch
    loaders = [PromptLoader(ds, batch, seed=seed, rank=r, world_size=world) for r in range(world)]
    for step in range(stop):
        assert sum((next(l).indices for l in loaders), []) == global_batches[step]
    resumed = [PromptLoader(ds, batch, seed=seed, rank=r, world_size=world) for r in range(world)]
    for l, old in zip(resumed, loaders):
        l.load_state_dict(old.state_dict())
    for step in range(stop, steps):
        shards = [next(l).indices for l in resumed]
        assert len({len(s) for s in shards}) == 1
        assert sum(shards, []) == global_batches[step]
