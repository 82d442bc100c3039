"""The MTP propose as one static forward, CUDA-graph captured per size bucket.

A propose first builds the exact rows committed since the last one (each pair (h_{i-1}, x_i) up to
the anchor: the layer's K/V for the cache, and the anchor's output), then drafts M tokens by
autoregressing the layer on its own outputs. The eager path (`MTPDrafter._exact_inputs`, `_extend`,
`_autoregress`) pads every cache at every layer step and launches each op from the host: some hundred
launches a propose. Here the sequences' caches are copied once per propose into a bucket's static
buffers [B, C + P + M - 1] (batch bucket B, cache-length bucket C, P = max drafts + 2 pending pairs,
M drafts): columns 0..C-1 hold the cache (its padding masked off), columns C..C+P-1 the pending
pairs' K/V (causal among themselves), column C + P + s - 1 draft step s + 1's. The pending pairs, the M
greedy picks and the M - 1 layer steps between them are one static function: one graph replay on a
GPU. The pending pairs' K/V but the anchor's then go to the sequences' caches (the exact rows); a
request's drafts past its own count are zeros, as the eager chain leaves them. Every sequence is
computed alone (attention and the layer's ops are per row), so its drafts are the eager path's.

A sequence with more than P pending pairs (after a prefill or a catch-up) has its oldest built eagerly
first. Bitmasks (grammar-constrained drafts) take the eager path. On a CPU the same functions run
without capture (`use_graphs=False`): that is how they are tested against the eager path.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from specsplit.drafter_service.base import pick
from specsplit.drafter_service.graphs import _Replayable
from specsplit.drafter_service.heads import TargetHead
from specsplit.shared.cuda_graphs import batch_buckets, bucket_for
from specsplit.shared.layers import SelfAttention, grouped_attention, grouped_mask
from specsplit.shared.ragged import ragged_arange
from specsplit.shared.staging import HostStaging

# A bucket's static K/V rows, batch x (cache length + pending pairs + drafts - 1), at most: past it the eager path (the
# SmolLM2 geometry's K and V at this size take 100 MiB in bf16; a Qwen3-8B-shaped layer's 512 MiB).
MAX_CHAIN_ROWS = 1 << 17


class _ChainBuffers:
    """The static inputs of one (batch, cache length) bucket, shared by its graphs of any draft count."""

    def __init__(self, model, batch: int, cache: int, prefix: int, max_drafts: int, device: torch.device) -> None:
        dec = model.cfg.decoder
        dtype = model.layer.eh_proj.weight.dtype
        self.cache, self.prefix = cache, prefix
        width = cache + prefix + max_drafts - 1
        # the pending pairs: target rows h [B, P, hidden]; tokens [B, P + 1], the pending rows' then
        # the anchor's (written at column n by the graph: pair j pairs h[j] with token j + 1)
        self.h = torch.zeros(batch, prefix, dec.hidden_size, dtype=dtype, device=device)
        self.tok = torch.zeros(batch, prefix + 1, dtype=torch.long, device=device)
        # [B, Hkv, W, D]: the layout grouped attention reads as it lies (no copy per query head)
        self.k = torch.zeros(batch, dec.num_key_value_heads, width, dec.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.groups = dec.num_attention_heads // dec.num_key_value_heads
        # anchor positions, draft counts, pending pairs, anchor tokens, cached rows: one copy a propose
        self.meta = torch.zeros(5, batch, dtype=torch.long, device=device)


class ChainGraphs:
    """`MTPDrafter`'s propose (pending pairs, then the draft chain) for up to `max_batch` sequences and
    `max_drafts` drafts."""

    def __init__(self, model, table: torch.Tensor | None, *, max_batch: int, max_drafts: int, use_graphs: bool,
                 pool, staging: HostStaging) -> None:
        self.model, self.table, self.staging = model, table, staging
        self.max_drafts = max_drafts
        self.prefix = max_drafts + 2  # pending pairs a propose builds in the graph: all drafts accepted, + 1
        self.batches = batch_buckets(max_batch)
        self.use_graphs, self.pool = use_graphs, pool
        self._buffers: dict[tuple[int, int], _ChainBuffers] = {}
        # head key -> (batch, cache, drafts) -> its run; graphs read the head by address
        self._runs: dict[tuple, dict[tuple[int, int, int], _Replayable]] = {}
        self.replays = 0  # chains run through here (tests check the path was taken)

    def fits(self, batch: int, cache_rows: int) -> bool:
        """Whether a batch of `batch` sequences with caches of up to `cache_rows` rows takes a bucket."""
        size = bucket_for(batch, self.batches)
        return size is not None and \
            size * (_cache_bucket(cache_rows) + self.prefix + self.max_drafts - 1) <= MAX_CHAIN_ROWS

    def forget(self, head: TargetHead) -> None:
        """Drop the graphs made over `head`, so its mappings can close."""
        self._runs.pop(_head_key(head), None)

    def __call__(self, head: TargetHead, pending_h: Sequence[torch.Tensor], pending_tok: Sequence[torch.Tensor],
                 anchor_tokens: Sequence[int], k: Sequence[torch.Tensor], v: Sequence[torch.Tensor],
                 positions: Sequence[int], counts: Sequence[int]) -> ChainOut:
        """Per sequence: its pending target rows [n, hidden] and tokens [n] (1 <= n <= P; pair j is
        (h[j], token j + 1), the last pair's token the anchor's), its cache k/v [L, Hkv, D], anchor
        position and draft count. Views of static tensors: valid until the next call."""
        n, most = len(positions), max(counts)
        size = bucket_for(n, self.batches)
        cached = [part.shape[0] for part in k]
        cache = _cache_bucket(max(cached))
        key = (size, cache)
        if key not in self._buffers:
            self._buffers[key] = _ChainBuffers(self.model, size, cache, self.prefix, self.max_drafts,
                                               pending_h[0].device)
        b = self._buffers[key]
        runs = self._runs.setdefault(_head_key(head), {})
        if (size, cache, most) not in runs:
            runs[(size, cache, most)] = _Replayable(lambda: self._chain(head, b, most), self.pool, self.use_graphs)
        pad = [0] * (size - n)
        pairs = [part.shape[0] for part in pending_h]
        self.staging.put_into(b.meta, [list(positions) + pad, list(counts) + pad, pairs + pad,
                                       list(anchor_tokens) + pad, cached + pad])
        self._fill(b, pending_h, pending_tok, k, v, pairs, cached)
        tokens, logps = runs[(size, cache, most)]()
        self.replays += 1
        built = slice(cache, cache + self.prefix)
        return ChainOut(tokens[:n], logps[:n], b.k[:n, :, built].transpose(1, 2), b.v[:n, :, built].transpose(1, 2))

    def _fill(self, b: _ChainBuffers, pending_h: Sequence[torch.Tensor], pending_tok: Sequence[torch.Tensor],
              k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], pairs: list[int], cached: list[int]) -> None:
        """The sequences' pending rows and caches into the bucket's buffers (row i for sequence i). One
        sequence: four plain copies. Several: each kind of row concatenated and scattered by (sequence,
        column) indices that reach the device in one copy, a fixed number of launches for any batch
        (padding the parts first would copy each sequence's rows one by one)."""
        if len(pairs) == 1:
            b.h[0, :pairs[0]].copy_(pending_h[0])
            b.tok[0, :pairs[0]].copy_(pending_tok[0])
            if cached[0]:
                b.k[0, :, :cached[0]].copy_(k[0].transpose(0, 1))
                b.v[0, :, :cached[0]].copy_(v[0].transpose(0, 1))
            return
        counts = np.asarray(pairs + cached, dtype=np.int64)
        owners = np.repeat(np.tile(np.arange(len(pairs), dtype=np.int64), 2), counts)
        index = self.staging.put(np.stack([owners, ragged_arange(counts)]))
        split = sum(pairs)
        row, column = index[0, :split], index[1, :split]
        b.h[row, column] = torch.cat(list(pending_h))
        b.tok[row, column] = torch.cat(list(pending_tok))
        if split < index.shape[1]:
            row, column = index[0, split:], index[1, split:]
            b.k[row, :, column] = torch.cat(list(k))
            b.v[row, :, column] = torch.cat(list(v))

    def _chain(self, head: TargetHead, b: _ChainBuffers, most: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The static propose over bucket `b`: the pending pairs, then M picks and M - 1 layer steps."""
        model = self.model
        anchors, counts, pairs, anchor_tokens, cached = b.meta
        batch, prefix, hidden_size = b.h.shape
        device = anchors.device
        rows = torch.arange(prefix, device=device)
        # pending pairs: pair j of a sequence with n of them sits at position anchor - n + 1 + j
        tok = b.tok.scatter(1, pairs[:, None], anchor_tokens[:, None])
        x = model.inputs(tok[:, 1:].reshape(-1), b.h.reshape(-1, hidden_size), head)
        cos, sin = model.rotary_emb((anchors[:, None] - pairs[:, None] + 1 + rows).reshape(-1), x.dtype)
        cache_visible = torch.arange(b.cache, device=device)[None, :] < cached[:, None]  # [B, C]
        # query pair j sees the cache and pairs 0..j (a padding pair sees itself at least: no empty row)
        mask = torch.cat([cache_visible[:, None, :].expand(batch, prefix, b.cache),
                          (rows[None, :] <= rows[:, None])[None].expand(batch, prefix, prefix)], 2)
        out = model.layer(x, _pairs_mixer(b, cos, sin, mask)).view(batch, prefix, hidden_size)
        hidden = out[torch.arange(batch, device=device), (pairs - 1).clamp(min=0)]  # the anchors' outputs
        visible = torch.cat([cache_visible, rows[None, :] < pairs[:, None],
                             torch.ones(batch, max(most - 1, 0), dtype=torch.bool, device=device)], 1)
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
            column = b.cache + prefix + step - 1
            hidden = model.layer(x, _chain_mixer(b, column, cos, sin, visible))
        keep = torch.arange(most, device=device)[None, :] < counts[:, None]
        tokens, logps = torch.stack(tokens, 1), torch.stack(logps, 1)
        return torch.where(keep, tokens, 0), torch.where(keep, logps, 0.0)


@dataclasses.dataclass(frozen=True)
class ChainOut:
    """A propose through the static chain: drafts and their log-probabilities [n, M], and the pending
    pairs' K/V [n, P, Hkv, D] (sequence i's first n_i rows are its pairs'). Views of static tensors."""

    tokens: torch.Tensor
    logps: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _pairs_mixer(b: _ChainBuffers, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor):
    """The pending pairs [B * P] at columns C..C+P-1: their K/V written there, attending as `mask` [B, P, C+P]."""
    batch, prefix = mask.shape[:2]
    end = b.cache + prefix

    def mix(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, cos, sin)
        k, v = attn.key_value(x, cos, sin)  # [B * P, Hkv, D]
        b.k[:, :, b.cache:end] = k.view(batch, prefix, *k.shape[1:]).transpose(1, 2)
        b.v[:, :, b.cache:end] = v.view(batch, prefix, *v.shape[1:]).transpose(1, 2)
        out = grouped_attention(q.view(batch, prefix, *q.shape[1:]), b.k[:, :, :end], b.v[:, :, :end],
                                grouped_mask(mask, b.groups), attn.scale)
        return attn.output(out.reshape(batch * prefix, *out.shape[2:]))

    return mix


def _chain_mixer(b: _ChainBuffers, column: int, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor):
    """One new row per sequence at `column`: its K/V written there, attending the visible columns up to it."""

    def mix(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, cos, sin)  # [B, Hq, D]
        k, v = attn.key_value(x, cos, sin)  # [B, Hkv, D]
        b.k[:, :, column], b.v[:, :, column] = k, v
        out = grouped_attention(q[:, None], b.k[:, :, :column + 1], b.v[:, :, :column + 1],
                                grouped_mask(visible[:, None, :column + 1], b.groups), attn.scale)
        return attn.output(out[:, 0])

    return mix


def _cache_bucket(rows: int) -> int:
    """Cache lengths come in powers of two from 16."""
    return max(16, 1 << (rows - 1).bit_length())


def _head_key(head: TargetHead) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (head.embed, head.lm_head))
