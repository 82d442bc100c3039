"""The MTP draft chain as static forwards, CUDA-graph captured per size bucket.

The eager chain (`MTPDrafter._autoregress`) runs its layer once per draft step over each sequence's
padded KV cache, rebuilding that padding at every step and launching every op from the host. Here
the exact rows' cache is padded once per propose into a bucket's static buffers [B, C + M - 1]
(batch bucket B, cache-length bucket C, M drafts): columns 0..C-1 hold the cache (the padding masked
off), column C + s - 1 takes the K/V of draft step s + 1. The whole chain, M greedy picks and M - 1
layer steps, is then one static function over those buffers: one graph replay on a GPU. A request's
drafts past its own count are zeros, as the eager chain leaves them; every sequence is computed alone
(attention and the layer's ops are per row), so its drafts are the eager chain's.

Speculative rows never reach the sequences' caches here (the eager chain appends them and the next
propose drops them): only the exact rows persist. Bitmasks (grammar-constrained drafts) take the
eager chain. On a CPU the same functions run without capture (`use_graphs=False`): that is how they
are tested against the eager chain.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specsplit.drafter_service.base import pick
from specsplit.drafter_service.graphs import _Replayable
from specsplit.drafter_service.heads import TargetHead
from specsplit.shared.cuda_graphs import batch_buckets, bucket_for
from specsplit.shared.layers import SelfAttention, grouped_attention, grouped_mask
from specsplit.shared.staging import HostStaging

# A bucket's static K/V rows, batch x (cache length + drafts - 1), at most: past it the eager chain (the
# SmolLM2 geometry's K and V at this size take 100 MiB in bf16; a Qwen3-8B-shaped layer's 512 MiB).
MAX_CHAIN_ROWS = 1 << 17


class _ChainBuffers:
    """The static inputs of one (batch, cache length) bucket, shared by its graphs of any draft count."""

    def __init__(self, model, batch: int, cache: int, max_drafts: int, device: torch.device) -> None:
        dec = model.cfg.decoder
        dtype = model.layer.eh_proj.weight.dtype
        width = cache + max_drafts - 1
        self.cache = cache
        self.last = torch.zeros(batch, dec.hidden_size, dtype=dtype, device=device)
        # [B, Hkv, W, D]: the layout grouped attention reads as it lies (no copy per query head)
        self.k = torch.zeros(batch, dec.num_key_value_heads, width, dec.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.groups = dec.num_attention_heads // dec.num_key_value_heads
        # cache columns: valid rows; chain columns: always visible (a step sees the ones written so far)
        self.visible = torch.ones(batch, width, dtype=torch.bool, device=device)
        self.meta = torch.zeros(2, batch, dtype=torch.long, device=device)  # anchor positions, draft counts


class ChainGraphs:
    """`MTPDrafter`'s draft chain for up to `max_batch` sequences and `max_drafts` drafts."""

    def __init__(self, model, table: torch.Tensor | None, *, max_batch: int, max_drafts: int, use_graphs: bool,
                 pool, staging: HostStaging) -> None:
        self.model, self.table, self.staging = model, table, staging
        self.max_drafts = max_drafts
        self.batches = batch_buckets(max_batch)
        self.use_graphs, self.pool = use_graphs, pool
        self._buffers: dict[tuple[int, int], _ChainBuffers] = {}
        # head key -> (batch, cache, drafts) -> its run; graphs read the head by address
        self._runs: dict[tuple, dict[tuple[int, int, int], _Replayable]] = {}
        self.replays = 0  # chains run through here (tests check the path was taken)

    def fits(self, batch: int, cache_rows: int) -> bool:
        """Whether a batch of `batch` sequences with caches of up to `cache_rows` rows takes a bucket."""
        size = bucket_for(batch, self.batches)
        return size is not None and size * (_cache_bucket(cache_rows) + self.max_drafts - 1) <= MAX_CHAIN_ROWS

    def forget(self, head: TargetHead) -> None:
        """Drop the graphs made over `head`, so its mappings can close."""
        self._runs.pop(_head_key(head), None)

    def __call__(self, head: TargetHead, last: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lengths: Sequence[int], positions: Sequence[int], counts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts from the anchors' outputs `last` [n, hidden] over the exact caches k/v [n, L, Hkv, D]
        (sequence i's first lengths[i] rows), anchors at `positions`, counts[i] drafts each: target ids
        and log-probabilities [n, max(counts)], zeros past a count. Views of static tensors: valid until
        the next call."""
        n, most = last.shape[0], max(counts)
        size = bucket_for(n, self.batches)
        cache = _cache_bucket(k.shape[1])
        key = (size, cache)
        if key not in self._buffers:
            self._buffers[key] = _ChainBuffers(self.model, size, cache, self.max_drafts, last.device)
        buffers = self._buffers[key]
        runs = self._runs.setdefault(_head_key(head), {})
        if (size, cache, most) not in runs:
            runs[(size, cache, most)] = _Replayable(lambda: self._chain(head, buffers, most), self.pool, self.use_graphs)
        pad = size - n
        self.staging.put_into(buffers.meta, [list(positions) + [0] * pad, list(counts) + [0] * pad])
        buffers.last[:n].copy_(last)
        buffers.k[:n, :, :k.shape[1]].copy_(k.transpose(1, 2))
        buffers.v[:n, :, :v.shape[1]].copy_(v.transpose(1, 2))
        columns = torch.arange(cache, device=last.device)
        buffers.visible[:n, :cache] = columns[None, :] < self.staging.put(list(lengths))[:, None]
        buffers.visible[n:, :cache] = False
        tokens, logps = runs[(size, cache, most)]()
        self.replays += 1
        return tokens[:n], logps[:n]

    def _chain(self, head: TargetHead, b: _ChainBuffers, most: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The static chain over bucket `b`: M picks, M - 1 layer steps."""
        model = self.model
        anchors, counts = b.meta
        hidden = b.last
        tokens, logps = [], []
        for step in range(1, most + 1):
            ids, logp = pick(model.logits(hidden, head), None)
            ids = ids if self.table is None else self.table[ids]
            tokens.append(ids)
            logps.append(logp)
            if step == most:
                break
            x = model.inputs(ids, hidden, head)
            cos, sin = model.rotary_emb(anchors + step, x.dtype)
            column = b.cache + step - 1
            hidden = model.layer(x, _chain_mixer(b, column, cos, sin))
        keep = torch.arange(most, device=anchors.device)[None, :] < counts[:, None]
        tokens, logps = torch.stack(tokens, 1), torch.stack(logps, 1)
        return torch.where(keep, tokens, 0), torch.where(keep, logps, 0.0)


def _chain_mixer(b: _ChainBuffers, column: int, cos: torch.Tensor, sin: torch.Tensor):
    """One new row per sequence at `column`: its K/V written there, attending columns 0..column."""

    def mix(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, cos, sin)  # [B, Hq, D]
        k, v = attn.key_value(x, cos, sin)  # [B, Hkv, D]
        b.k[:, :, column], b.v[:, :, column] = k, v
        out = grouped_attention(q[:, None], b.k[:, :, :column + 1], b.v[:, :, :column + 1],
                                grouped_mask(b.visible[:, None, :column + 1], b.groups), attn.scale)
        return attn.output(out[:, 0])

    return mix


def _cache_bucket(rows: int) -> int:
    """Cache lengths come in powers of two from 16."""
    return max(16, 1 << (rows - 1).bit_length())


def _head_key(head: TargetHead) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (head.embed, head.lm_head))
