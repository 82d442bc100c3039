"""CUDA graphs of the DFlash drafter's two per-step forwards, captured lazily per size bucket.

- The context forward (committed rows → per-layer K/V written into their pool slots), bucketed on the
  step's row count.
- The block forward that proposes: [anchor, mask × (γ-1)] over each sequence's context, read in place
  from the pool through its block table; bucketed on batch size alone, since every table has the same
  width. A step copies anchors, positions and bases (one staged copy) and the batch's tables (one
  stack) into the bucket's buffers, replays, and reads the drafts back once: O(batch), whatever the
  contexts' lengths.

Padding is harmless by construction: padded rows of the context forward and padded sequences of the
block forward write their K/V into the pool's scratch block, and their outputs are dropped. A request
with a grammar bitmask takes the eager path. On a CPU the same static functions run without capture
(`use_graphs=False`), which is how they are tested against the eager drafter there.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from specsplit.drafter_service.context_pool import ContextPool
from specsplit.drafter_service.heads import TargetHead
from specsplit.kernels.chain_meta import commit_meta, propose_meta
from specsplit.kernels.row_max import row_max
from specsplit.kernels.workspace import arrival_counters
from specsplit.shared.cuda_graphs import batch_buckets, bucket_for, capture_serving, inlining
from specsplit.shared.fused import FusedWeights
from specsplit.shared.layers import embed_rows
from specsplit.shared.staging import HostStaging


def length_buckets(limit: int, smallest: int = 64) -> list[int]:
    """Powers of two from `smallest` below `limit`, then `limit`."""
    sizes = []
    size = smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


class _Replayable:
    """A static function over its own buffers: on a GPU run directly on its first call and captured on its
    second, run directly everywhere else.

    Captured while serving (`capture_serving`): a drafter service captures a bucket when one of its targets
    first uses it, and `torch.cuda.graph`'s device synchronize, garbage collection and emptied allocator
    cache around a capture would stall every other target's steps for tens of milliseconds. That capture
    runs nothing, so the function's kernels must have run once before (Triton compiles on first use):
    the first call, run directly, is that run."""

    def __init__(self, fn, pool, use_graphs: bool) -> None:
        self.fn, self.pool, self.use_graphs = fn, pool, use_graphs
        self.graph = None
        self.out = None
        self.ran = False

    def __call__(self):
        if not self.use_graphs or inlining():  # (inlined: its kernels go into a capture around it)
            return self.fn()
        if self.graph is None:
            if not self.ran:
                self.ran = True
                return self.fn()
            outputs = []
            self.graph = capture_serving(lambda: outputs.append(self.fn()), self.pool)
            (self.out,) = outputs
        self.graph.replay()
        return self.out


class ContextGraphs:
    """`DFlashModel.context` for up to `max_rows` rows at once, writing K/V into the pool."""

    def __init__(self, model, context_pool: ContextPool, *, max_rows: int, use_graphs: bool, pool,
                 fused: bool = False) -> None:
        self.model, self.context_pool = model, context_pool
        self.fused = fused  # run `model.context_into` (a few launches a layer) instead of context + write
        self.buckets = length_buckets(max_rows, smallest=16)
        self.use_graphs, self.pool = use_graphs, pool
        self._runs: dict[int, tuple[torch.Tensor, torch.Tensor, _Replayable]] = {}  # rows, meta, its run

    def __call__(self, rows: torch.Tensor, positions: np.ndarray, slots: np.ndarray, staging: HostStaging) -> None:
        """rows [n, feature_dim] at host `positions` [n] → their K/V into the pool's `slots` [n] (distinct).
        Positions and slots reach the graph's inputs in one copy (`staging`), the rows in another."""
        n = rows.shape[0]
        static_rows, meta, run = self._buffers(bucket_for(n, self.buckets), rows)
        # Rows past n are a previous step's: written again where they were, they could land on a slot
        # since reused, so they go to scratch (position 0).
        host = np.zeros((2, meta.shape[1]), dtype=np.int64)
        host[0, :n], host[1, :n] = positions, slots
        host[1, n:] = self.context_pool.scratch * self.context_pool.block_size
        staging.put_into(meta, host)
        static_rows[:n].copy_(rows)
        run()

    def _buffers(self, size: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Replayable]:
        """The static rows, positions/slots and run of the bucket of `size` rows (made on first use)."""
        if size not in self._runs:
            static_rows = torch.zeros((size, rows.shape[1]), dtype=rows.dtype, device=rows.device)
            meta = torch.zeros(2, size, dtype=torch.long, device=rows.device)  # positions, slots
            cp, model = self.context_pool, self.model
            if self.fused:
                forward = lambda: model.context_into(static_rows, meta[0], cp.k, cp.v, meta[1])  # noqa: E731
            else:
                forward = lambda: cp.write(meta[1], *model.context(static_rows, meta[0]))  # noqa: E731
            run = _Replayable(forward, self.pool, self.use_graphs)
            self._runs[size] = (static_rows, meta, run)
        return self._runs[size]

    def fed_ring(self, rows: torch.Tensor, positions: torch.Tensor, count: int, stacked: torch.Tensor,
                 periods: torch.Tensor) -> None:
        """`__call__` for a chained step's rows [B * count, feature_dim], sequence b's from positions[b] on (on
        the device: the host does not know them yet), into their slots through the rings of tables `stacked`
        [B, W] (`periods` [B] positions each): no host copy, nothing waits. The positions and slots are
        written in one launch on a GPU (`kernels.chain_meta`)."""
        n = rows.shape[0]
        static_rows, meta, run = self._buffers(bucket_for(n, self.buckets), rows)
        commit_meta(positions, count, stacked, periods, self.context_pool.block_size,
                    self.context_pool.scratch * self.context_pool.block_size, meta)
        static_rows[:n].copy_(rows)
        run()


class _ProposeBuffers:
    """Static inputs of one batch bucket and the paged block forward over them."""

    def __init__(self, model, head: TargetHead, table: torch.Tensor | None, context_pool: ContextPool,
                 batch: int, width: int, window: int, fused: list[FusedWeights] | None) -> None:
        device = context_pool.k.device
        self.model, self.head, self.table, self.context_pool, self.window = model, head, table, context_pool, window
        self.fused = fused
        self.meta = torch.zeros(3, batch, dtype=torch.long, device=device)  # one copy per step fills all three
        self.anchors, self.positions, self.bases = self.meta  # [B] each
        # [B, γ]: each block's ids, the anchor then mask tokens (only the anchors change between replays)
        self.ids = torch.full((batch, model.cfg.block_size), model.cfg.mask_token_id, dtype=torch.long, device=device)
        self.tables = torch.full((batch, width), context_pool.scratch, dtype=torch.int32, device=device)
        # Arrival counters of the drafts' one-launch row max (kernels.workspace), this graph's own.
        self.workspace = arrival_counters(batch * model.cfg.block_size, device)
        self.last_tables: list[torch.Tensor] = []  # the sequences' tables now in `tables`, in order

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy drafts (target ids) and their logits, [B, γ-1] each, and all logits [B, γ-1, V]."""
        from specsplit.drafter_service.dflash import PagedContext  # dflash imports this module

        cfg, pool = self.model.cfg, self.context_pool
        self.ids[:, 0] = self.anchors
        block = embed_rows(self.head.embed, self.ids)
        if cfg.input_embedding_scale != 1.0:  # a multiply by 1 is exact: no launch for it
            block = block * cfg.input_embedding_scale
        block = block.to(pool.k.dtype)
        context = PagedContext(pool.k, pool.v, self.tables, self.bases, self.window)
        hidden = self.model.block_hidden_paged(block, self.positions, context, self.fused)
        # The argmax alone: a draft's log-probability (a softmax over the vocabulary per draft) is
        # computed from these outputs only when a request asks for it (`GraphDrafts.logp`).
        logits = self.model.logits(hidden[:, 1:], self.head)
        values, indices = (t.view(logits.shape[:2]) for t in row_max(logits.flatten(0, 1), self.workspace))
        drafts = indices if self.table is None else self.table[indices]
        return drafts, values, logits


@dataclasses.dataclass(frozen=True)
class GraphDrafts:
    """A propose graph's outputs (its static tensors: read them before the next replay)."""

    tokens: torch.Tensor  # [B, γ-1] greedy drafts, target ids
    best: torch.Tensor  # [B, γ-1] float32: their logits
    logits: torch.Tensor  # [B, γ-1, V] float32

    def logp(self) -> torch.Tensor:
        """The drafts' log-probabilities [B, γ-1]: max - logsumexp, as `pick` computes them."""
        return self.best - torch.logsumexp(self.logits, dim=-1)


class ProposeGraphs:
    """The paged block forward for up to `max_batch` sequences."""

    def __init__(self, model, table: torch.Tensor | None, context_pool: ContextPool, scratch_table: torch.Tensor,
                 *, max_batch: int, window: int, use_graphs: bool, pool, staging: HostStaging,
                 fused: list[FusedWeights] | None = None) -> None:
        self.model, self.table, self.context_pool, self.staging = model, table, context_pool, staging
        self.fused = fused  # the layers' concatenated projections: the block forward runs fused layers
        self.scratch_table = scratch_table  # [width] int32: a padded sequence's, all scratch
        self.batches = batch_buckets(max_batch)
        self.window = window
        self.use_graphs, self.pool = use_graphs, pool
        # Graphs read the target head by address, so each head (each connected target's, on one GPU)
        # has its own: head key -> batch bucket -> buffers and their graph.
        self._runs: dict[tuple, dict[int, tuple[_ProposeBuffers, _Replayable]]] = {}

    def forget(self, head: TargetHead) -> None:
        """Drop the graphs (and buffers) made for `head`, so its mappings can close."""
        self._runs.pop(_head_key(head), None)

    def __call__(self, head: TargetHead, anchors: list[int], positions: list[int], bases: list[int],
                 tables: Sequence[torch.Tensor]) -> "GraphDrafts":
        """One sequence per anchor, at `positions`, its table relative to `bases` (see `PagedContext`).
        Returns the drafts on the device, valid until the next replay."""
        batch = len(anchors)
        buffers, run = self._buffers(head, batch)
        pad = buffers.meta.shape[1] - batch  # padded sequences sit at position 0 of the scratch table
        self.staging.put_into(buffers.meta, [anchors + [0] * pad, positions + [0] * pad, bases + [0] * pad])
        self._set_tables(buffers, tables)
        drafts, best, logits = run()
        return GraphDrafts(drafts[:batch], best[:batch], logits[:batch])

    def fed_chain(self, head: TargetHead, anchors: torch.Tensor, positions: torch.Tensor, periods: torch.Tensor,
                  tables: Sequence[torch.Tensor]) -> "GraphDrafts":
        """`__call__` with anchors and positions [B] already on the device (a chained step's: the last verify's
        picks, where the host does not know them yet), each ring's base from its `periods` [B]; the inputs
        written in one launch on a GPU (`kernels.chain_meta`). Returns every output (the greedy drafts [B, γ-1]
        and, for a draft tree's candidates, the logits), valid until the next replay."""
        batch = anchors.shape[0]
        buffers, run = self._buffers(head, batch)
        propose_meta(anchors, positions, self.window, periods, buffers.meta)
        if inlining() and not self._bound(buffers, tables):
            # a capture would bake this stack of today's tables into every replay
            raise RuntimeError("a chained step's tables must be bound (`bind`) before its capture")
        self._set_tables(buffers, tables)
        drafts, best, logits = run()
        return GraphDrafts(drafts[:batch], best[:batch], logits[:batch])

    def bind(self, head: TargetHead, tables: Sequence[torch.Tensor]) -> None:
        """Put these sequences' tables into their bucket's buffers now, on the host's side of a step, so
        that a step captured or replayed after it (`fed` inlined in a whole chained step's graph) finds
        them in place."""
        buffers, _ = self._buffers(head, len(tables))
        self._set_tables(buffers, tables)

    @staticmethod
    def _bound(buffers: _ProposeBuffers, tables: Sequence[torch.Tensor]) -> bool:
        return len(tables) == len(buffers.last_tables) and all(a is b for a, b in zip(tables, buffers.last_tables))

    def _buffers(self, head: TargetHead, batch: int) -> tuple[_ProposeBuffers, _Replayable]:
        runs = self._runs.setdefault(_head_key(head), {})
        size = bucket_for(batch, self.batches)
        if size not in runs:
            buffers = _ProposeBuffers(self.model, head, self.table, self.context_pool, size,
                                      self.scratch_table.shape[0], self.window, self.fused)
            runs[size] = (buffers, _Replayable(buffers.run, self.pool, self.use_graphs))
        return runs[size]

    def _set_tables(self, buffers: _ProposeBuffers, tables: Sequence[torch.Tensor]) -> None:
        """The sequences' tables into the bucket's, padded with the scratch table. A table is never
        written after it is made (a ring's change makes a new one), so the same tables in the same order
        as last time are in place already; held here, none can be freed and another made at its address."""
        if not self._bound(buffers, tables):
            pad = buffers.tables.shape[0] - len(tables)
            torch.stack([*tables, *[self.scratch_table] * pad], out=buffers.tables)
            buffers.last_tables = list(tables)


def _head_key(head: TargetHead) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (head.embed, head.lm_head))
