"""Prompt batches: deterministic shuffling, data-parallel sharding, and a resumable position.

    loader = PromptLoader(dataset, batch_size=cfg.data.train_batch_size, rank=r, world_size=w,
                          seed=data_seed(cfg), shuffle=cfg.data.shuffle)  # config/seeds.py
    for batch in loader:          # this rank's share of each global batch; epochs roll over
        ...
    state = loader.state_dict()   # save with the checkpoint; load_state_dict(state) resumes

Order: epoch e visits the samples in `default_rng([seed, e]).permutation(len(dataset))` (or in
file order without shuffling) and cuts that order into global batches of `batch_size`; rank r
takes the r-th contiguous slice of each global batch. The global batches depend only on
(dataset, seed, batch_size), not on the world size, so a run resumed on a different number of
ranks still sees exactly the prompts it would have seen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class PromptBatch:
    """Prompts of one batch, unpadded.

    indices    [batch]              dataset sample indices (stable: they identify the prompt)
    input_ids  [batch][len_i]       token ids after the chat template, each len_i <= max_prompt_length
    rows       [batch] dicts        every column of the sample's row as a Python object: prompt,
                                    data_source, ability, reward_model, extra_info and any extra
                                    column such as category — the reward functions receive these
    """

    indices: list[int]
    input_ids: list[list[int]]
    rows: list[dict]

    def __len__(self) -> int:
        return len(self.indices)

    def column(self, name: str, default: Any = None) -> list:
        return [row.get(name, default) for row in self.rows]

    def padded(self, pad_token_id: int, side: str = "left") -> tuple["torch.Tensor", "torch.Tensor"]:
        """(ids [batch, max_len] int64, lengths [batch] int64); left padding by default, as
        generation wants: every prompt then ends at the same position."""
        import torch

        lengths = torch.tensor([len(ids) for ids in self.input_ids], dtype=torch.int64)
        width = int(lengths.max()) if len(self) else 0
        out = torch.full((len(self), width), pad_token_id, dtype=torch.int64)
        for i, ids in enumerate(self.input_ids):
            if ids:
                row = torch.tensor(ids, dtype=torch.int64)
                if side == "left":
                    out[i, width - len(ids):] = row
                elif side == "right":
                    out[i, :len(ids)] = row
                else:
                    raise ValueError(f"side={side!r}: 'left' or 'right'")
        return out, lengths


class BatchSource(Protocol):
    """What the loader reads of its dataset (data.dataset.RLHFDataset): its size and a batch of
    given rows."""

    def __len__(self) -> int: ...

    def get_batch(self, indices: Sequence[int]) -> PromptBatch: ...


class PromptLoader:
    """Iterates this rank's share of global prompt batches; see the module docstring for order.

    drop_last=True (training): every global batch is full; the incomplete tail of an epoch is
    not used in that epoch. drop_last=False (validation): the last batch is smaller and split as
    evenly as possible over the ranks (some ranks may get one sample fewer).
    num_epochs=None repeats forever (the trainer counts steps); an int stops after that many.
    """

    def __init__(self, dataset: "BatchSource", batch_size: int, *, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, seed: int = 1,
                 drop_last: bool = True, num_epochs: Optional[int] = None):
        n = len(dataset)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if shuffle and not isinstance(seed, int):
            raise ValueError(f"PromptLoader: seed={seed!r}; shuffling needs an int (data.seed, or "
                             "the one config/seeds.data_seed derives from trainer.seed)")
        if drop_last and batch_size % world_size:
            raise ValueError(f"data.train_batch_size={batch_size} prompts do not split over "
                             f"{world_size} data-parallel ranks; make it a multiple of {world_size}")
        if drop_last and n < batch_size:
            raise ValueError(f"the dataset has {n} prompts, fewer than one batch of "
                             f"data.train_batch_size={batch_size}")
        self.dataset, self.batch_size = dataset, batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last, self.num_epochs = shuffle, seed, drop_last, num_epochs
        self.batches_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        self.epoch = 0
        self.batch_in_epoch = 0  # the next batch to hand out
        self._order_epoch, self._order = -1, np.arange(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.dataset)
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(n)
                           if self.shuffle else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def global_indices(self, epoch: int, batch: int) -> np.ndarray:
        """Sample indices of global batch `batch` of `epoch` (all ranks together)."""
        start = batch * self.batch_size
        return self._epoch_order(epoch)[start:start + self.batch_size]

    def __iter__(self) -> "PromptLoader":
        return self

    def __next__(self) -> PromptBatch:
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        chosen = self.global_indices(self.epoch, self.batch_in_epoch)
        mine = np.array_split(chosen, self.world_size)[self.rank]
        self.batch_in_epoch += 1
        return self.dataset.get_batch(mine.tolist())

    def next_global(self) -> PromptBatch:
        """The next global batch whole (every rank's share, in rank order), advancing as
        `next` does: a saved batch of every replica's samples takes its rows from it."""
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        chosen = self.global_indices(self.epoch, self.batch_in_epoch)
        self.batch_in_epoch += 1
        return self.dataset.get_batch(chosen.tolist())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size,
                "num_samples": len(self.dataset)}

    @staticmethod
    def rebatch(state: dict, batch_size: int) -> dict:
        """A saved position for another data.train_batch_size: the same epoch, resuming at the
        batch that holds the first prompt not yet handed out (the order within an epoch does
        not depend on the batch size), so at most batch_size - 1 prompts are handed out again."""
        done = int(state["batch_in_epoch"]) * int(state["batch_size"])  # prompts of this epoch
        return dict(state, batch_size=batch_size, batch_in_epoch=done // batch_size)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position. The ordering inputs must match: a different dataset
        size, seed or batch size would silently change which prompts come next."""
        for key, mine in [("num_samples", len(self.dataset)), ("seed", self.seed),
                          ("shuffle", self.shuffle), ("batch_size", self.batch_size)]:
            if state.get(key) != mine:
                raise ValueError(f"cannot resume the prompt loader: the checkpoint has "
                                 f"{key}={state.get(key)!r}, this run has {mine!r} (same data "
                                 f"files, data.seed, data.shuffle and data.train_batch_size needed)")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
