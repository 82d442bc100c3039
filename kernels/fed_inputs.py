"""A fed verify's inputs on the device, in one launch: a chained step's tokens into a bucket's static buffers.

A chained step's verify is fed from the device (`StaticForward.load_fed_device`): each sequence's tokens from its
start position on, their positions, the cache rows they write
(through the block tables the host loaded), and a tree's rotary positions and visibility words. As torch ops
that was some fifteen kernels a chain step and nineteen a tree step in the step's graph (the forty-eighth
session's `bench/profile_step.py --op-sites`), each a few microseconds of a GPU doing almost nothing; here one
program a bucket row writes its row.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton

KERNEL = True  # False: the torch reference on CUDA too (`bench/profile_step.py --torch-kernels fed_inputs`)


def write_fed_inputs_reference(tokens: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, block_size: int,
                               scratch_slot: int, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                               tree: tuple[torch.Tensor, ...] | None = None) -> None:
    """Torch ops. The first B of a bucket's rows (of Q queries) take tokens [B, n] (n <= Q) from starts [B] on:
    token_ids [rows * Q] (their first n), positions [rows, Q] (padding queries at the last token's), slots
    [rows * Q] (the cache rows through tables [rows, W] of `block_size` blocks; padding queries write scratch).
    A tree bucket's `tree` is (rotary, words) [B, Q] in and the bucket's (rotary, words) [rows, Q] out: the
    padding rows' rotary positions are their positions, and they see every row up to their own (-1)."""
    batch, n = tokens.shape
    q = positions.shape[1]
    offsets = torch.arange(q, device=starts.device)
    at = starts[:, None] + offsets.clamp(max=n - 1)  # [B, Q]
    positions[:batch].copy_(at)
    rows = tables[:batch].gather(1, at // block_size).long() * block_size + at % block_size
    slots.view(-1, q)[:batch].copy_(torch.where(offsets < n, rows, scratch_slot))
    token_ids.view(-1, q)[:batch, :n].copy_(tokens)
    if tree is not None:
        rotary, words, rotary_out, words_out = tree
        rotary_out[:batch].copy_(rotary)
        rotary_out[batch:].copy_(positions[batch:])
        words_out[:batch].copy_(words)
        words_out[batch:].fill_(-1)


def write_fed_inputs(tokens: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, block_size: int,
                     scratch_slot: int, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """The Triton kernel on CUDA, the torch reference elsewhere (the same arguments)."""
    if KERNEL and HAVE_TRITON and tokens.is_cuda:
        write_fed_inputs_triton(tokens, starts, tables, block_size, scratch_slot, token_ids, positions, slots,
                                tree)
    else:
        write_fed_inputs_reference(tokens, starts, tables, block_size, scratch_slot, token_ids, positions, slots,
                                   tree)


@triton.jit
def _fed_inputs_kernel(tokens_ptr, stride_tokens, starts_ptr, tables_ptr, stride_tables, table_width, block_size,
                     scratch_slot, token_ids_ptr, positions_ptr, slots_ptr, rotary_ptr, stride_rotary, words_ptr,
                     stride_words, rotary_out_ptr, words_out_ptr, B, n, Q: tl.constexpr, QP: tl.constexpr,
                     TREE: tl.constexpr, USE_GDC: tl.constexpr):
    """Program r writes bucket row r: a fed sequence's (r < B), or with TREE a padding row's tree inputs."""
    gdc_enter(USE_GDC)
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, QP)
    row = tl.zeros([QP], dtype=tl.int64) + r  # (the row as a tensor: a scalar mask is not every Triton's)
    fed = (j < Q) & (row < B)
    at = tl.load(starts_ptr + tl.minimum(r, B - 1)) + tl.minimum(j, n - 1)  # (a padding row's is not stored)
    tl.store(positions_ptr + r * Q + j, at, mask=fed)
    block = at // block_size
    inside = (j < n) & (block < table_width)  # (past the table, where the reference would fail: scratch)
    entry = tl.load(tables_ptr + r * stride_tables + block, mask=fed & inside, other=0)
    slot = tl.where(inside, entry.to(tl.int64) * block_size + at % block_size, scratch_slot)
    tl.store(slots_ptr + r * Q + j, slot, mask=fed)
    token = tl.load(tokens_ptr + r * stride_tokens + j, mask=fed & (j < n), other=0)
    tl.store(token_ids_ptr + r * Q + j, token, mask=fed & (j < n))
    if TREE:
        pad = (j < Q) & (row >= B)
        rotary = tl.load(rotary_ptr + r * stride_rotary + j, mask=fed, other=0)
        own = tl.load(positions_ptr + r * Q + j, mask=pad, other=0)  # (a padding row's, as the host loaded it)
        tl.store(rotary_out_ptr + r * Q + j, tl.where(fed, rotary, own), mask=j < Q)
        words = tl.load(words_ptr + r * stride_words + j, mask=fed, other=-1)
        tl.store(words_out_ptr + r * Q + j, words, mask=j < Q)


def write_fed_inputs_triton(tokens: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, block_size: int,
                            scratch_slot: int, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                            tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """`write_fed_inputs` in one launch: int64 tokens [B, n] and starts [B], int32 or int64 tables [rows, W], the
    bucket's int64 buffers contiguous (tree: int64 rotary and words [B, Q] with unit column stride, [rows, Q]
    outs). A token whose position lies past its table (where the reference would fail) writes scratch, never
    another sequence's rows."""
    batch, n = tokens.shape
    rows, q = positions.shape
    assert 1 <= n <= q and batch <= rows and starts.shape == (batch,) and tables.shape[0] >= rows
    assert token_ids.numel() == slots.numel() == rows * q and tokens.stride(1) == 1 and tables.stride(1) == 1
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in (starts, token_ids, positions, slots))
    assert tokens.dtype == torch.int64 and tables.dtype in (torch.int32, torch.int64)
    if tree is not None:
        rotary, words, rotary_out, words_out = tree
        assert n == q and rotary.shape == words.shape == (batch, q) and rotary.stride(1) == words.stride(1) == 1
        assert rotary_out.shape == words_out.shape == (rows, q) and rotary_out.is_contiguous() \
            and words_out.is_contiguous() and rotary.dtype == words.dtype == torch.int64
    else:
        rotary = words = rotary_out = words_out = positions
    _fed_inputs_kernel[(rows if tree is not None else batch,)](
        tokens, tokens.stride(0), starts, tables, tables.stride(0), tables.shape[1], block_size, scratch_slot,
        token_ids, positions, slots, rotary, rotary.stride(0), words, words.stride(0), rotary_out, words_out, batch, n,
        Q=q, QP=triton.next_power_of_2(q), TREE=tree is not None, num_warps=1,
        **dependent_launch(tokens.device, "fed_inputs"))
