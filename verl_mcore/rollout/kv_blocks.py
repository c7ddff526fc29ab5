"""The native engine's paged KV cache: fixed-size blocks handed to sequences as they grow.

The cache is one tensor [layers, 2, blocks, block_size, groups, hd]. A sequence holds a list of
blocks (its block table row); its token at position p sits in block table[p // block_size], row
p % block_size. Memory is taken in proportion to the tokens in use, not slots x max length.

Blocks are reference-counted so the n samples of a prompt share the prompt's full blocks: they are
prefilled once, each sample then holds a reference, and a block returns to the free list when its
last holder finishes. The prompt's last, partly filled block is copied per sample (each writes its
own tokens after the prompt), so a block a sequence writes to is always its own.

Block 0 is a scratch block, never handed out: the decode step still runs for empty or finished
slots (a CUDA graph has a fixed batch), and their block table rows point there.
"""
from __future__ import annotations

import numpy as np

SCRATCH = 0


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    """Free list and reference counts of `num_blocks` blocks (host side; block 0 reserved)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"BlockPool: {num_blocks} blocks leaves none besides the scratch block")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        # Popped from the end: low block ids first, so runs reuse the same memory in the same order.
        self._free = list(range(num_blocks - 1, 0, -1))
        self.peak_used = 0

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} KV blocks wanted, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self.refs[out] = 1
        self.peak_used = max(self.peak_used, self.used)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder of each block."""
        self.refs[blocks] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one holder of each block; blocks nobody holds return to the free list."""
        for b in blocks:
            if self.refs[b] <= 0:
                raise RuntimeError(f"BlockPool: block {b} released more often than taken")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)
