"""CUDA graphs of the DFlash drafter's two per-step forwards, captured lazily per size bucket.

- The context forward (committed rows → features and per-layer K/V), bucketed on the step's row count.
- The block forward that proposes: [anchor, mask × (γ-1)] over each sequence's cached context, bucketed
  on batch size and context length. Each step gathers the batch's contexts into the bucket's padded
  buffers (one copy per column for the whole batch), replays, and reads the drafts back once.

Padding is masked by construction: padded context rows are invalid keys, padded sequences' outputs
are dropped, padded rows of the context forward are computed and ignored. A request with a grammar
bitmask takes the eager path. On a CPU the same static functions run without capture (`use_graphs=False`),
which is how they are tested against the eager drafter there.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specsplit.drafter_service.heads import TargetHead
from specsplit.shared.cuda_graphs import batch_buckets, bucket_for, capture
from specsplit.shared.staging import HostStaging

MIN_CONTEXT_BUCKET = 64


def length_buckets(limit: int, smallest: int = MIN_CONTEXT_BUCKET) -> list[int]:
    """Powers of two from `smallest` below `limit`, then `limit`."""
    sizes = []
    size = smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


class _Replayable:
    """A static function over its own buffers: captured on first call on a GPU, run directly otherwise."""

    def __init__(self, fn, pool, use_graphs: bool) -> None:
        self.fn, self.pool, self.use_graphs = fn, pool, use_graphs
        self.graph = None
        self.out = None

    def __call__(self):
        if not self.use_graphs:
            return self.fn()
        if self.graph is None:
            self.graph, self.out = capture(self.fn, self.pool)
        self.graph.replay()
        return self.out


class ContextGraphs:
    """`DFlashModel.context` for up to `max_rows` rows at once."""

    def __init__(self, model, *, max_rows: int, use_graphs: bool, pool) -> None:
        self.model = model
        self.buckets = length_buckets(max_rows, smallest=16)
        self.use_graphs, self.pool = use_graphs, pool
        self._runs: dict[int, tuple[torch.Tensor, torch.Tensor, _Replayable]] = {}

    def fits(self, rows: int) -> bool:
        return rows <= self.buckets[-1]

    def __call__(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """rows [n, feature_dim], positions [n] → feat [n, hidden], k/v [n, layers, Hkv, D] (views of
        static outputs: valid until the next call)."""
        n = rows.shape[0]
        size = bucket_for(n, self.buckets)
        if size not in self._runs:
            static_rows = torch.zeros((size, rows.shape[1]), dtype=rows.dtype, device=rows.device)
            static_pos = torch.zeros(size, dtype=torch.long, device=rows.device)
            run = _Replayable(lambda: self.model.context(static_rows, static_pos), self.pool, self.use_graphs)
            self._runs[size] = (static_rows, static_pos, run)
        static_rows, static_pos, run = self._runs[size]
        static_rows[:n].copy_(rows)
        static_pos[:n].copy_(positions)
        return tuple(t[:n] for t in run())


class _ProposeBuffers:
    """Static inputs of one (batch, context length) bucket and the block forward over them."""

    def __init__(self, model, head: TargetHead, table: torch.Tensor | None, batch: int, length: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        dec = model.cfg.decoder
        kv = (batch, length, dec.num_hidden_layers, dec.num_key_value_heads, dec.head_dim)
        self.model, self.head, self.table = model, head, table
        self.meta = torch.zeros(3, batch, dtype=torch.long, device=device)  # one copy per step fills all three
        self.anchors, self.positions, self.lengths = self.meta  # [B] each; lengths: context rows held
        self.k = torch.zeros(kv, dtype=dtype, device=device)  # [B, N, layers, Hkv, D]
        self.v = torch.zeros(kv, dtype=dtype, device=device)
        self.pos = torch.zeros(batch, length, dtype=torch.long, device=device)  # [B, N]

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts (target ids) and their log-probabilities, [B, γ-1] each."""
        from specsplit.drafter_service.dflash import BlockContext  # dflash imports this module

        cfg = self.model.cfg
        ids = torch.full((self.anchors.shape[0], cfg.block_size), cfg.mask_token_id, dtype=torch.long,
                         device=self.anchors.device)
        ids[:, 0] = self.anchors
        block = (F.embedding(ids, self.head.embed) * cfg.input_embedding_scale).to(self.k.dtype)
        valid = torch.arange(self.pos.shape[1], device=self.pos.device)[None, :] < self.lengths[:, None]
        hidden = self.model.block_hidden(block, self.positions, BlockContext(self.k, self.v, self.pos, valid))
        scores = torch.log_softmax(self.model.logits(hidden[:, 1:], self.head), dim=-1).max(dim=-1)
        drafts = scores.indices if self.table is None else self.table[scores.indices]
        return drafts, scores.values


class ProposeGraphs:
    """The block forward for up to `max_batch` sequences with up to `window` context rows each."""

    def __init__(self, model, table: torch.Tensor | None, *, max_batch: int, window: int,
                 device: torch.device, dtype: torch.dtype, use_graphs: bool, pool, staging: HostStaging) -> None:
        self.model, self.table, self.staging = model, table, staging
        self.device, self.dtype = device, dtype
        self.batches = batch_buckets(max_batch)
        self.lengths = length_buckets(window)
        self.use_graphs, self.pool = use_graphs, pool
        # Graphs read the target head by address, so each head (each connected target's, on one GPU)
        # has its own: head key -> (batch bucket, length bucket) -> buffers and their graph.
        self._runs: dict[tuple, dict[tuple[int, int], tuple[_ProposeBuffers, _Replayable]]] = {}

    def fits(self, batch: int, length: int) -> bool:
        return batch <= self.batches[-1] and length <= self.lengths[-1]

    def forget(self, head: TargetHead) -> None:
        """Drop the graphs (and buffers) made for `head`, so its mappings can close."""
        self._runs.pop(_head_key(head), None)

    def __call__(self, head: TargetHead, anchors: list[int], positions: list[int],
                 contexts: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """contexts: each sequence's `Rows` (columns k, v, pos). Returns drafts and log-probs [B, γ-1]
        on the device, for the first len(anchors) rows."""
        runs = self._runs.setdefault(_head_key(head), {})
        batch, lengths = len(anchors), [len(c) for c in contexts]
        key = (bucket_for(batch, self.batches), bucket_for(max(lengths), self.lengths))
        if key not in runs:
            buffers = _ProposeBuffers(self.model, head, self.table, *key, self.device, self.dtype)
            runs[key] = (buffers, _Replayable(buffers.run, self.pool, self.use_graphs))
        buffers, run = runs[key]
        pad = [0] * (key[0] - batch)  # padding sequences see no context
        buffers.meta.copy_(self.staging.put([anchors + pad, positions + pad, lengths + pad]))
        _gather_contexts(contexts, lengths, key[1], buffers, self.staging)
        drafts, logp = run()
        return drafts[:batch], logp[:batch]


def _head_key(head: TargetHead) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (head.embed, head.lm_head))


def _gather_contexts(contexts: Sequence, lengths: list[int], width: int, buffers: _ProposeBuffers,
                     staging: HostStaging) -> None:
    """Every sequence's context rows into the padded buffers: one concatenation and one scatter per
    column for the whole batch (rows past a sequence's length keep stale values; they are masked)."""
    dest = np.concatenate([np.arange(b * width, b * width + n) for b, n in enumerate(lengths)])
    dest = staging.put(dest)
    for name, static in (("k", buffers.k), ("v", buffers.v), ("pos", buffers.pos)):
        parts = [c[name] for c in contexts]
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        static.view(-1, *static.shape[2:]).index_copy_(0, dest, rows)

