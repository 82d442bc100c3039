"""The target model (Llama, Qwen3, Qwen2, Mistral) over a ragged token batch and a paged KV cache.

One `forward` serves prefill chunks, decode (one token per sequence) and verify (k+1 tokens per
sequence): every token's K/V is written at its position, then each query attends causally, by
position and within its layer's window, to its own sequence's cached positions 0..its position.
The module tree carries HF's names (`model.layers.3.self_attn.q_proj`, `lm_head`), so loading a
checkpoint is a name lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from specsplit.shared.checkpoint import assign_parameters, load_config, load_state_dict
from specsplit.shared.config import ModelConfig
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.layers import (
    DecoderLayer, RMSNorm, RotaryEmbedding, SelfAttention, attention, grouped_attention, grouped_mask,
    head_logits, padded_visibility, visibility_mask,
)
from specsplit.shared.staging import to_host
from specsplit.shared.tree import block_rows
from specsplit.target_service.kv_cache import PagedKVCache


@dataclass(frozen=True)
class CaptureSpec:
    """Which hidden rows a forward returns besides logits (the drafter's feature rows)."""

    # Outputs of these decoder layers (0-based), concatenated in this order: HF's hidden_states[i + 1], so the
    # last layer's after the final norm (HF hands that entry normed, and z-lab's DFlash reads it so)
    layer_ids: tuple[int, ...] = ()
    last_hidden: bool = False  # output of the last decoder layer, before the final norm

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))

    def validate(self, num_layers: int) -> None:
        bad = [i for i in self.layer_ids if not 0 <= i < num_layers]
        if bad:
            raise InvalidRequest(f"capture layer id {bad[0]} is out of range for {num_layers} layers")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise InvalidRequest(f"capture layer ids {self.layer_ids} repeat a layer")

    def features(self, outputs: dict[int, torch.Tensor], normed: Callable[[], torch.Tensor],
                 num_layers: int) -> torch.Tensor | None:
        """The feature rows [T, len(layer_ids) * hidden] from the layers' `outputs` ({i: layer i's output}),
        the last layer's replaced by `normed()` (the final norm of it), as HF's hidden_states numbers them."""
        if not self.layer_ids:
            return None
        return torch.cat([normed() if i == num_layers - 1 else outputs[i] for i in self.layer_ids], -1)


@dataclass
class ForwardBatch:
    """A ragged batch, flat over tokens; sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1]."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64; within each sequence contiguous and increasing
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int64 offsets into token_ids (CPU tensor)
    seq_ids: list[int]  # [num_seqs] KV cache sequence ids, each at most once
    logits_index: torch.Tensor | None = None  # [R] rows of T to compute logits for; None = all T rows
    # Per sequence, None or a draft tree's parents (`shared.tree.DraftTree.parents`): its rows are then the
    # tree's root (the last emitted token) and its nodes in order, written to the cache positions given but
    # rotated at the root's position plus their depth, each seeing the context and its own ancestors only
    trees: Sequence[Sequence[int] | None] | None = None


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, vocab] float32
    layer_features: torch.Tensor | None  # [T, len(layer_ids) * hidden] in model dtype, when captured
    last_hidden: torch.Tensor | None  # [T, hidden] in model dtype, when captured
    # A step graph's argmax of every row of its bucket (computed inside the graph, so reading the greedy
    # picks back launches nothing), and which of those rows are the R rows of `logits`, in order
    bucket_argmax: torch.Tensor | None = None  # [B * Q] int64
    bucket_rows: np.ndarray | None = None  # [R]

    def greedy_picks(self, *also: torch.Tensor) -> list[list]:
        """`also`, then the argmax of each of the R rows, read back with one wait for the device."""
        if self.bucket_argmax is None:
            return to_host(*also, self.logits.argmax(dim=-1))
        *rest, every = to_host(*also, self.bucket_argmax)
        rows = self.bucket_rows
        if len(rows) == len(every) and bool((rows == np.arange(len(rows))).all()):
            return [*rest, every]
        return [*rest, np.asarray(every)[rows].tolist()]


@dataclass(frozen=True)
class _Span:
    """One sequence of the batch: its rows, and where its context lives in the cache."""

    rows: slice
    first: int  # position of the sequence's first token in this batch
    context_slots: torch.Tensor  # [last + 1] int64 cache slots of positions 0..last
    context_positions: torch.Tensor  # [last + 1] int64, arange(last + 1)


@dataclass(frozen=True)
class _Padded:
    """The ragged batch as B rows of queries over B rows of cached keys, built once per forward."""

    q_index: torch.Tensor  # [B, Qmax] rows of T (0 on padding)
    out_rows: torch.Tensor  # [T] rows of the flattened [B * Qmax] output holding the batch's tokens, in order
    ctx_slots: torch.Tensor  # [B * Lmax] cache slots of positions 0..Lmax-1 (garbage past a row's context)
    masks: dict[int | None, torch.Tensor]  # attention window -> [B, 1, groups * Qmax, Lmax] bool


@dataclass(frozen=True)
class _TreeBlock:
    """A sequence's rows as a draft tree: the root at cache position `root`, node i at root + 1 + i."""

    start: int  # its first row in the batch
    root: int
    depths: torch.Tensor  # [N + 1] int64 on the host: 0 for the root, then each node's depth
    sees: torch.Tensor  # [N + 1, N + 1] bool on the host: row r sees row c of the block (c is r or an ancestor)

    def mask(self, keys: torch.Tensor, window: int | None) -> torch.Tensor:
        """[N + 1, K] bool: which of the cache positions `keys` [K] (host) each row of the block sees."""
        size = len(self.depths)
        ctx = keys[None, :] < self.root
        if window is not None:
            ctx = ctx & (self.root + self.depths[:, None] - keys[None, :] < window)
        sees = self.sees
        if window is not None:
            sees = sees & (self.depths[:, None] - self.depths[None, :] < window)
        inside = (keys >= self.root) & (keys < self.root + size)
        return ctx | (sees[:, (keys - self.root).clamp(0, size - 1)] & inside[None, :])


def _tree_blocks(trees: Sequence[Sequence[int] | None] | None, bounds: list[tuple[int, int]],
                 firsts: list[int]) -> dict[int, _TreeBlock]:
    """Each tree sequence's block, checked against its rows."""
    if trees is None:
        return {}
    if len(trees) != len(bounds):
        raise InvalidRequest(f"trees names {len(trees)} sequences; the batch has {len(bounds)}")
    out = {}
    for index, (parents, (a, b), first) in enumerate(zip(trees, bounds, firsts)):
        if parents is None:
            continue
        if len(parents) + 1 != b - a:
            raise InvalidRequest(f"sequence {index}'s tree has {len(parents)} nodes; its rows are {b - a} "
                                 "(the root and one a node)")
        depths, words = block_rows(parents)
        sees = torch.tensor([[word >> c & 1 for c in range(b - a)] for word in words], dtype=torch.bool)
        out[index] = _TreeBlock(a, first, torch.tensor(depths), sees)
    return out


def _rotary_positions(positions: torch.Tensor, trees: dict[int, _TreeBlock]) -> torch.Tensor:
    """The rows' rotary positions: their cache positions, but a tree's rows at the root's plus their depth."""
    rotary = positions.clone()
    for block in trees.values():
        rotary[block.start:block.start + len(block.depths)] = (block.root + block.depths).to(positions.device)
    return rotary


@dataclass(frozen=True)
class _Step:
    """What every layer of one forward needs to attend."""

    cache: PagedKVCache
    spans: list[_Span] | None  # per-sequence reference path
    padded: _Padded | None  # batched path
    positions: torch.Tensor  # [T] rotary positions (a tree node's: its root's plus its depth)
    new_slots: torch.Tensor  # [T] cache slots the batch's tokens are written to
    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor  # [T, head_dim]
    trees: dict[int, _TreeBlock] | None = None  # sequence index -> its tree block


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)


class TargetModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # "batched": one padded attention call per layer for the whole batch (serving);
        # "per_sequence": a loop over sequences, the simple reference the batched path is tested against.
        self.attention_path = "batched"

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight  # [vocab, hidden]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight  # [vocab, hidden]

    def new_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        cfg = self.config
        return PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks,
                            block_size, dtype=self.embed_weight.dtype, device=self.embed_weight.device)

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, cache: PagedKVCache, capture: CaptureSpec = CaptureSpec()
    ) -> ForwardOutput:
        """Each sequence must be allocated in `cache`; forward reserves it up to its last position + 1
        itself (never shrinking it), and a batch may start anywhere up to the sequence's cached length.

        Rows past a sequence's last position (a rejected verify's) are left alone: the engine may
        truncate them, and if it does not, a later forward overwrites them before any query reads them.
        """
        capture.validate(self.config.num_hidden_layers)
        device = self.embed_weight.device
        token_ids, positions = batch.token_ids.to(device), batch.positions.to(device)
        bounds, firsts, lasts = self._plan(batch, token_ids, positions, cache)
        trees = _tree_blocks(batch.trees, bounds, firsts)
        rotary = positions if not trees else _rotary_positions(positions, trees)
        x = self.model.embed_tokens(token_ids)  # [T, hidden]
        cos, sin = self.model.rotary_emb(rotary, x.dtype)
        if self.attention_path == "per_sequence":
            spans = self._spans(batch.seq_ids, bounds, firsts, lasts, cache, positions.device)
            new_slots = torch.cat([s.context_slots[s.first:] for s in spans])  # [T]
            step = _Step(cache, spans, None, rotary, new_slots, cos, sin, trees)
            attend = self._attend_per_sequence
        else:
            padded, new_slots = self._pad(batch.seq_ids, bounds, lasts, cache, positions, trees)
            step = _Step(cache, None, padded, rotary, new_slots, cos, sin, trees)
            attend = self._attend_batched
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, partial(attend, step, i))
            if i in capture.layer_ids:
                captured[i] = x
        return ForwardOutput(
            logits=self._logits(x, batch.logits_index),
            layer_features=capture.features(captured, lambda: self.model.norm(x), len(self.model.layers)),
            last_hidden=x if capture.last_hidden else None,
        )

    def _logits(self, x: torch.Tensor, logits_index: torch.Tensor | None) -> torch.Tensor:
        if logits_index is not None:
            x = x[logits_index.to(x.device)]
        return head_logits(self.model.norm(x), self.lm_head.weight)  # [R, vocab]

    def _attend_batched(self, step: _Step, layer: int, attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, step.cos, step.sin)  # [T, Hq, D]
        k, v = attn.key_value(x, step.cos, step.sin)  # [T, Hkv, D]
        step.cache.write_slots(layer, step.new_slots, k, v)
        pad = step.padded
        batch, width = pad.q_index.shape[0], pad.ctx_slots.shape[0] // pad.q_index.shape[0]
        keys, values = step.cache.read_slots(layer, pad.ctx_slots)  # [B * Lmax, Hkv, D]
        keys, values = (t.view(batch, width, *t.shape[1:]).transpose(1, 2) for t in (keys, values))
        out = grouped_attention(q[pad.q_index], keys, values, pad.masks[self.config.layer_window(layer)], attn.scale)
        return attn.output(out.flatten(0, 1).index_select(0, pad.out_rows))

    def _attend_per_sequence(self, step: _Step, layer: int, attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, step.cos, step.sin)  # [T, Hq, D]
        k, v = attn.key_value(x, step.cos, step.sin)  # [T, Hkv, D]
        step.cache.write_slots(layer, step.new_slots, k, v)
        window = self.config.layer_window(layer)
        out = torch.empty_like(q)
        for index, span in enumerate(step.spans):
            # Keys older than the window of the batch's first query are invisible to every query of it.
            start = 0 if window is None else max(0, span.first - window + 1)
            keys, values = step.cache.read_slots(layer, span.context_slots[start:])
            if step.trees and index in step.trees:
                mask = step.trees[index].mask(span.context_positions[start:].cpu(), window).to(q.device)
            else:
                mask = visibility_mask(step.positions[span.rows], span.context_positions[start:], window=window)
            out[span.rows] = attention(q[span.rows], keys, values, mask, attn.scale)
        return attn.output(out)

    def _plan(self, batch: ForwardBatch, token_ids: torch.Tensor, positions: torch.Tensor,
              cache: PagedKVCache) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """Validate the batch against the cache and reserve room: (row bounds, first and last position) per sequence."""
        bounds = _check_layout(batch, token_ids, positions)
        starts = torch.tensor([a for a, _ in bounds], device=positions.device)
        ends = torch.tensor([b - 1 for _, b in bounds], device=positions.device)
        firsts, lasts = torch.stack([positions[starts], positions[ends]]).tolist()
        _check_values(token_ids, positions, bounds, firsts, self.config.vocab_size)
        if batch.logits_index is not None:
            _check_index(batch.logits_index, len(token_ids))
        cache.reserve_batch(batch.seq_ids, firsts, [last + 1 for last in lasts])
        return bounds, firsts, lasts

    @staticmethod
    def _spans(seq_ids, bounds, firsts, lasts, cache: PagedKVCache, device: torch.device) -> list[_Span]:
        spans = []
        for seq_id, (a, b), first, last in zip(seq_ids, bounds, firsts, lasts):
            slots = cache.context_slots(seq_id, last + 1)
            spans.append(_Span(slice(a, b), first, slots, torch.arange(last + 1, device=device)))
        return spans

    def _pad(self, seq_ids: list[int], bounds: list[tuple[int, int]], lasts: list[int], cache: PagedKVCache,
             positions: torch.Tensor, trees: dict[int, _TreeBlock]) -> tuple[_Padded, torch.Tensor]:
        """The padded layout, its masks (one per distinct attention window) and the batch's new slots.

        Index tensors are built on the host from the known lengths and copied once, so no layer
        needs a data-dependent (synchronising) operation such as boolean indexing.
        """
        device = positions.device
        q_lens = torch.tensor([b - a for a, b in bounds])
        qmax, lmax = int(q_lens.max()), max(lasts) + 1
        q_cols = torch.arange(qmax)
        q_valid = q_cols[None, :] < q_lens[:, None]  # [B, Qmax]
        q_index = torch.where(q_valid, torch.tensor([a for a, _ in bounds])[:, None] + q_cols[None, :], 0)
        out_rows = q_valid.reshape(-1).nonzero().squeeze(1)  # [T]: where each token's row sits in [B * Qmax]
        token_seq = torch.repeat_interleave(torch.arange(len(bounds)), q_lens)  # [T]
        k_valid = torch.arange(lmax)[None, :] < torch.tensor([last + 1 for last in lasts])[:, None]
        q_valid, q_index, out_rows, token_seq, k_valid = (
            t.to(device, non_blocking=True) for t in (q_valid, q_index, out_rows, token_seq, k_valid))
        k_pos = torch.arange(lmax, device=device)
        tables = pad_sequence([cache.block_table(s).to(torch.int64) for s in seq_ids], batch_first=True)
        # Padding columns read the row's own last block, never another request's (masked either way,
        # but a non-finite value there would still turn 0-weights into NaN).
        own_blocks = torch.tensor([cache.blocks_for(last + 1) - 1 for last in lasts]).to(device, non_blocking=True)
        blocks = tables.gather(1, torch.minimum((k_pos // cache.block_size)[None, :], own_blocks[:, None]))
        slots = blocks * cache.block_size + k_pos % cache.block_size  # [B, Lmax]
        new_slots = slots[token_seq, positions]  # [T]: each token's own slot
        q_pos = positions[q_index]
        cfg = self.config
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        windows = {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}
        masks = {}
        for w in windows:
            visible = padded_visibility(q_pos, q_valid, k_pos.expand_as(k_valid), k_valid, w)
            for index, block in trees.items():  # a tree's rows: the context, then their ancestors
                visible[index, :len(block.depths)] = block.mask(torch.arange(lmax), w).to(device)
            masks[w] = grouped_mask(visible, groups)
        return _Padded(q_index, out_rows, slots.reshape(-1), masks), new_slots


def _check_layout(batch: ForwardBatch, token_ids: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, int]]:
    """Shapes and offsets, on the host: [(row_start, row_end)] per sequence."""
    if token_ids.dim() != 1 or positions.shape != token_ids.shape:
        raise InvalidRequest(f"token_ids {tuple(token_ids.shape)} and positions {tuple(positions.shape)} "
                             "must be equal 1-D shapes")
    if token_ids.dtype.is_floating_point or positions.dtype.is_floating_point:
        raise InvalidRequest("token_ids and positions must be integer tensors")
    if not batch.seq_ids:
        raise InvalidRequest("a forward batch needs at least one sequence")
    cu = batch.cu_seqlens.tolist()
    if len(cu) != len(batch.seq_ids) + 1 or cu[0] != 0 or cu[-1] != token_ids.shape[0]:
        raise InvalidRequest(f"cu_seqlens {cu} must run from 0 to {token_ids.shape[0]} "
                             f"with one entry per sequence ({len(batch.seq_ids)}) plus one")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise InvalidRequest(f"cu_seqlens {cu} gives a sequence no tokens")
    if len(set(batch.seq_ids)) != len(batch.seq_ids):
        raise InvalidRequest(f"seq_ids {batch.seq_ids} name a sequence twice")
    return list(zip(cu, cu[1:]))


def _check_values(
    token_ids: torch.Tensor, positions: torch.Tensor, bounds: list[tuple[int, int]], firsts: list[int], vocab_size: int
) -> None:
    if min(firsts) < 0:
        raise InvalidRequest("positions must be non-negative")
    lengths = torch.tensor([b - a for a, b in bounds], device=positions.device)
    offsets = torch.tensor([f - a for (a, _), f in zip(bounds, firsts)], device=positions.device)
    expected = torch.repeat_interleave(offsets, lengths) + torch.arange(len(positions), device=positions.device)
    if bool((positions != expected).any()):
        raise InvalidRequest("positions must be contiguous and increasing within each sequence")
    if bool(((token_ids < 0) | (token_ids >= vocab_size)).any()):
        raise InvalidRequest(f"token ids must lie in [0, {vocab_size})")


def _check_index(logits_index: torch.Tensor, num_rows: int) -> None:
    if logits_index.dim() != 1 or logits_index.dtype.is_floating_point:
        raise InvalidRequest("logits_index must be a 1-D integer tensor")
    if logits_index.numel() and not (0 <= int(logits_index.min()) and int(logits_index.max()) < num_rows):
        raise InvalidRequest(f"logits_index must lie in [0, {num_rows})")


def load_target(
    folder: Path | str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> TargetModel:
    """A TargetModel from an HF-format folder, weights cast to `dtype` on `device`, ready for inference."""
    if not dtype.is_floating_point:
        raise InvalidRequest(f"target dtype must be floating point, got {dtype}")
    config = load_config(folder)
    tensors = load_state_dict(folder)
    with torch.device("meta"):
        model = TargetModel(config).to(dtype)  # no random init: every parameter is overwritten below
    model = model.to_empty(device=device)
    model.model.rotary_emb = RotaryEmbedding(config.head_dim, config.rope).to(device)  # float32 inv_freq
    model.tie_weights()
    ignore = ["*.rotary_emb.inv_freq"] + (["lm_head.weight"] if config.tie_word_embeddings else [])
    assign_parameters(model, tensors, ignore=ignore)
    return model.eval().requires_grad_(False)
