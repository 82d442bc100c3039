"""The DFlash drafter's context K/V: one paged pool for all sequences, a ring of blocks per sequence.

Layout (vLLM's PagedAttention, as `kernels.paged_attention` reads it): position x of a sequence lives
in row `x % block_size` of block `table[x // block_size]`; its *slot* is `block * block_size + row`, an
index into a layer's pool viewed as [blocks * block_size, Hkv, D].

A sequence sees only the last W positions (the ctx window), so it owns a ring of R blocks rather than
blocks for its whole budget: logical block j is physical block `ring[j % R]`, and position x shares its
slot with x ± R·block_size only. A propose reads positions p-W..p+γ-1 (the window and the γ block rows,
p the anchor's position) at once; with R·block_size ≥ W + γ those are distinct slots, so what it reads
was never overwritten. Older positions are overwritten as the window slides.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specsplit.shared.errors import CapacityExceeded
from specsplit.shared.memory import zeroed

BLOCK_SIZE = 16  # positions per block


def ring_size(window: int, gamma: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks a sequence needs to read a window of `window` positions and a γ-row block at once."""
    return -(-(window + gamma) // block_size)


class ContextPool:
    """K and V pools [layers, num_blocks + 1, block_size, Hkv, D] and a stack of free blocks.

    The block past `num_blocks` is scratch, never handed out: the padded rows of a static forward write
    their K/V there. Pools start zeroed, so a slot read before it is written holds finite values (the
    attention masks such slots, but a 0 weight times NaN would still be NaN).
    """

    def __init__(self, num_blocks: int, *, layers: int, kv_heads: int, head_dim: int, block_size: int = BLOCK_SIZE,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.k = zeroed(shape, dtype=dtype, device=device)
        self.v = zeroed(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: blocks come out in order 0, 1, ...

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ring_size(self, window: int, gamma: int) -> int:
        return ring_size(window, gamma, self.block_size)

    def take(self, count: int) -> list[int]:
        """`count` blocks, or CapacityExceeded with none taken."""
        if count > len(self._free):
            raise CapacityExceeded(f"the drafter's context pool has {len(self._free)} of {self.num_blocks} "
                                   f"blocks free; a sequence needs {count}")
        return [self._free.pop() for _ in range(count)]

    def give(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))

    def slots(self, ring: Sequence[int], positions: np.ndarray) -> np.ndarray:
        """Slots [n] of `positions` [n] in the sequence owning `ring` (host arithmetic: no device work)."""
        blocks = np.asarray(ring, dtype=np.int64)[(positions // self.block_size) % len(ring)]
        return blocks * self.block_size + positions % self.block_size

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [layers, n, Hkv, D] into `slots` [n] of every layer (slots distinct, or scratch)."""
        self._flat(self.k).index_copy_(1, slots, k)
        self._flat(self.v).index_copy_(1, slots, v)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [layers, n, Hkv, D] of `slots` [n]."""
        return self._flat(self.k).index_select(1, slots), self._flat(self.v).index_select(1, slots)

    def _flat(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.view(pool.shape[0], -1, *pool.shape[3:])  # [layers, blocks * block_size, Hkv, D]
