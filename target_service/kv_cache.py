"""A paged KV cache: fixed-size blocks from one pool, a block table per sequence (vLLM's PagedAttention layout).

A position p of a sequence lives in row `p % block_size` of block `table[p // block_size]`; its *slot*
is `block * block_size + row`, an index into the pool viewed as [num_blocks * block_size, Hkv, D].
The torch path here (slots + index_copy / index_select) is the reference a fused kernel must match;
such a kernel reads `k_pool`, `v_pool` and `block_table(seq_id)` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specsplit.kernels.kv_move import move_rows
from specsplit.shared.errors import AlreadyExists, CapacityExceeded, InvalidRequest, StateConflict, UnknownSequence
from specsplit.shared.memory import zeroed


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # positions reserved: 0..length-1 may be written and read
    table: torch.Tensor | None = None  # [len(blocks)] int32 on the cache device, rebuilt lazily


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim, num_blocks, block_size) <= 0:
            raise InvalidRequest("PagedKVCache dimensions must all be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pool = zeroed(shape, dtype=dtype, device=device)
        self.v_pool = zeroed(shape, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: blocks come out in order 0, 1, ...
        self._seqs: dict[int, _Sequence] = {}

    @property
    def device(self) -> torch.device:
        return self.k_pool.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pool.dtype

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    # ---- sequence bookkeeping -----------------------------------------------------------------

    def allocate(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise AlreadyExists(f"KV cache already holds sequence {seq_id}")
        self._seqs[seq_id] = _Sequence()

    def free(self, seq_id: int) -> None:
        self._free.extend(reversed(self._get(seq_id).blocks))
        del self._seqs[seq_id]

    def length(self, seq_id: int) -> int:
        return self._get(seq_id).length

    def reserve(self, seq_id: int, length: int) -> None:
        """Grow the sequence to hold positions 0..length-1; never shrinks. All or nothing."""
        seq = self._get(seq_id)
        needed = self.blocks_for(length) - len(seq.blocks)
        if needed > len(self._free):
            raise CapacityExceeded(
                f"sequence {seq_id} needs {needed} more KV blocks for {length} positions; "
                f"{len(self._free)} of {self.num_blocks} are free"
            )
        if needed > 0:
            seq.blocks.extend(self._free.pop() for _ in range(needed))
            seq.table = None
        seq.length = max(seq.length, length)

    def reserve_batch(self, seq_ids: list[int], firsts: list[int], lengths: list[int]) -> None:
        """Grow each sequence to `lengths[i]` positions, or none of them; a sequence's batch may start
        (`firsts[i]`) anywhere up to its current length."""
        needed = 0
        for seq_id, first, length in zip(seq_ids, firsts, lengths):
            held = self.length(seq_id)
            if first > held:
                raise StateConflict(f"sequence {seq_id} holds {held} positions; a batch cannot start at {first}")
            needed += max(0, self.blocks_for(length) - self.blocks_for(held))
        if needed > self.num_free_blocks:
            raise CapacityExceeded(f"the batch needs {needed} more KV blocks; {self.num_free_blocks} are free")
        for seq_id, length in zip(seq_ids, lengths):
            self.reserve(seq_id, length)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep positions 0..length-1; blocks wholly past them go back to the pool."""
        seq = self._get(seq_id)
        if not 0 <= length <= seq.length:
            raise InvalidRequest(f"cannot truncate sequence {seq_id} of length {seq.length} to {length}")
        keep = self.blocks_for(length)
        if keep < len(seq.blocks):
            self._free.extend(reversed(seq.blocks[keep:]))
            del seq.blocks[keep:]
            seq.table = None
        seq.length = length

    def blocks(self, seq_id: int) -> list[int]:
        """The sequence's block ids, in position order (a copy)."""
        return list(self._get(seq_id).blocks)

    def block_lists(self, seq_ids: list[int]) -> list[list[int]]:
        """Each sequence's block ids, in position order: the cache's own lists, to read, not to change."""
        return [self._get(seq_id).blocks for seq_id in seq_ids]

    def block_table(self, seq_id: int) -> torch.Tensor:
        """[blocks_for(length)] int32 block ids on the cache device."""
        seq = self._get(seq_id)
        if seq.table is None:
            seq.table = torch.tensor(seq.blocks, dtype=torch.int32, device=self.device)
        return seq.table

    def _get(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(f"KV cache holds no sequence {seq_id}") from None

    # ---- slots: where positions live in the pool ---------------------------------------------

    def slots(self, seq_id: int, positions: torch.Tensor) -> torch.Tensor:
        """[n] int64 pool rows of `positions` [n]; the caller guarantees 0 <= positions < length."""
        table = self.block_table(seq_id).to(torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def context_slots(self, seq_id: int, length: int) -> torch.Tensor:
        """[length] int64 pool rows of positions 0..length-1."""
        self._check_range(seq_id, length)
        return self.slots(seq_id, torch.arange(length, device=self.device))

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [n, Hkv, D] into pool rows `slots` [n] of `layer`."""
        self._flat(self.k_pool, layer).index_copy_(0, slots, k.to(self.dtype))
        self._flat(self.v_pool, layer).index_copy_(0, slots, v.to(self.dtype))

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [n, Hkv, D] from pool rows `slots` [n] of `layer`."""
        return (self._flat(self.k_pool, layer).index_select(0, slots),
                self._flat(self.v_pool, layer).index_select(0, slots))

    def _flat(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        return pool[layer].view(-1, *pool.shape[3:])  # [num_blocks * block_size, Hkv, D]

    # ---- by position (checked; the model uses slots computed once per forward) --------------

    def write(self, layer: int, seq_id: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [n, Hkv, D] at `positions` [n] of a sequence, which must lie within its reserved length."""
        if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < self.length(seq_id)):
            raise CapacityExceeded(
                f"positions {int(positions.min())}..{int(positions.max())} lie outside the "
                f"{self.length(seq_id)} positions reserved for sequence {seq_id}"
            )
        if k.shape != v.shape or k.shape[0] != positions.shape[0] or k.shape[1:] != self.k_pool.shape[3:]:
            raise InvalidRequest(f"k/v must be [{positions.shape[0]}, {', '.join(map(str, self.k_pool.shape[3:]))}]")
        self.write_slots(layer, self.slots(seq_id, positions.to(self.device)), k, v)

    def move(self, seq_id: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Every layer's k/v of a sequence's positions `src` copied to positions `dst` (all read before any is
        written): a verified tree's accepted path moved to the positions its tokens take."""
        if len(src) != len(dst):
            raise InvalidRequest(f"move takes as many destinations as sources: {len(src)} and {len(dst)}")
        if not src:
            return
        held = self.length(seq_id)
        if min(*src, *dst) < 0 or max(*src, *dst) >= held:
            raise InvalidRequest(f"move: positions must lie within the {held} sequence {seq_id} holds")
        if len(set(dst)) != len(dst):
            raise InvalidRequest("move: two sources to one destination")
        from_slots, to_slots = (self.slots(seq_id, torch.tensor(list(p), dtype=torch.long, device=self.device))
                                for p in (src, dst))
        for layer in range(self.num_layers):
            self.write_slots(layer, to_slots, *self.read_slots(layer, from_slots))

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, group: int | None = None) -> None:
        """Every layer's k/v of pool rows `src` [n] copied to rows `dst` [n] on the device, all read before any
        is written (a chained tree step's accepted paths; no host reads, so a capture can hold it). The caller
        owns the rows: no checks here, and rows meant for nothing go scratch to scratch. One launch on a GPU
        (`kernels.kv_move`); `group`, where the moves come a sequence's path at a time (its length), lets each
        sequence's be made apart."""
        move_rows(self.k_pool, self.v_pool, src, dst, group)

    def gather(self, layer: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [length, Hkv, D] of positions 0..length-1 of a sequence."""
        return self.read_slots(layer, self.context_slots(seq_id, length))

    def _check_range(self, seq_id: int, length: int) -> None:
        if not 0 <= length <= self.length(seq_id):
            raise CapacityExceeded(
                f"{length} positions requested of sequence {seq_id}, which holds {self.length(seq_id)}"
            )
