"""The drafter's side of a chained step: its static forwards' inputs written on the device, one launch each.

A chained step hands the drafter its anchors and positions on the device (the host does not know them yet).
Its propose's block forward reads each sequence's anchor, position and ring base (`DFlashDrafter.chain_propose`,
`chain_candidates`); its commit's context forward reads each verified row's position and its pool slot through
the sequence's ring (`chain_commit`). As torch ops those were some seven and fourteen kernels a step in the
step's graph (the forty-eighth session's `bench/profile_step.py --op-sites`), each a few microseconds of a GPU
doing almost nothing; here one program writes each.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton

KERNEL = True  # False: the torch references on CUDA too (`bench/profile_step.py --torch-kernels chain_meta`)


def propose_meta_reference(anchors: torch.Tensor, positions: torch.Tensor, window: int, periods: torch.Tensor,
                           meta: torch.Tensor) -> None:
    """A bucket's propose inputs meta [3, rows] (int64): anchors [B], positions [B] and each ring's base (the
    window's first position, at least 0, rounded down to whole periods [B]) in its first B columns, zeros past."""
    batch = anchors.shape[0]
    bases = (positions - window).clamp(min=0) // periods * periods
    meta[:, :batch].copy_(torch.stack([anchors, positions, bases]))
    meta[:, batch:].zero_()


def commit_meta_reference(positions: torch.Tensor, count: int, stacked: torch.Tensor, periods: torch.Tensor,
                          block_size: int, scratch_slot: int, meta: torch.Tensor) -> None:
    """A bucket's commit inputs meta [2, rows] (int64): for sequence b's rows b * count + c (c < count), the
    position positions[b] + c and its pool slot through the ring of tables stacked [B, W] (`periods` [B]
    positions a ring); past B * count rows, position 0 and the scratch slot."""
    at = positions[:, None] + torch.arange(count, device=positions.device)  # [B, count]
    blocks = stacked.gather(1, (at // block_size) % (periods[:, None] // block_size)).long()
    n = at.numel()
    meta[0, :n].copy_(at.view(-1))
    meta[1, :n].copy_((blocks * block_size + at % block_size).view(-1))
    meta[0, n:].zero_()
    meta[1, n:].fill_(scratch_slot)


def propose_meta(anchors: torch.Tensor, positions: torch.Tensor, window: int, periods: torch.Tensor,
                 meta: torch.Tensor) -> None:
    """The Triton kernel on CUDA, the torch reference elsewhere (the same arguments)."""
    if KERNEL and HAVE_TRITON and meta.is_cuda:
        _launch(meta, anchors, positions, periods, window=window)
    else:
        propose_meta_reference(anchors, positions, window, periods, meta)


def commit_meta(positions: torch.Tensor, count: int, stacked: torch.Tensor, periods: torch.Tensor, block_size: int,
                scratch_slot: int, meta: torch.Tensor) -> None:
    """The Triton kernel on CUDA, the torch reference elsewhere (the same arguments)."""
    if KERNEL and HAVE_TRITON and meta.is_cuda:
        _launch(meta, positions, positions, periods, count=count, stacked=stacked, block_size=block_size,
                scratch_slot=scratch_slot)
    else:
        commit_meta_reference(positions, count, stacked, periods, block_size, scratch_slot, meta)


@triton.jit
def _chain_meta_kernel(meta_ptr, stride_meta, anchors_ptr, positions_ptr, periods_ptr, stacked_ptr, stride_stacked,
                       B, window, count, block_size, scratch_slot, ROWS: tl.constexpr, ROWS_P2: tl.constexpr,
                       COMMIT: tl.constexpr, USE_GDC: tl.constexpr):
    """One program writes a bucket's whole meta: ROWS columns (ROWS_P2 their power of two)."""
    gdc_enter(USE_GDC)
    col = tl.arange(0, ROWS_P2)
    inside = col < ROWS
    if COMMIT:
        held = inside & (col < B * count)
        b = col // count
        at = tl.load(positions_ptr + b, mask=held, other=0) + col % count
        period = tl.load(periods_ptr + b, mask=held, other=block_size)
        block = tl.load(stacked_ptr + b * stride_stacked + (at // block_size) % (period // block_size), mask=held,
                        other=0).to(tl.int64)
        tl.store(meta_ptr + col, tl.where(held, at, 0), mask=inside)
        tl.store(meta_ptr + stride_meta + col, tl.where(held, block * block_size + at % block_size, scratch_slot),
                 mask=inside)
    else:
        held = inside & (col < B)
        anchor = tl.load(anchors_ptr + col, mask=held, other=0)
        position = tl.load(positions_ptr + col, mask=held, other=0)
        period = tl.load(periods_ptr + col, mask=held, other=1)
        base = tl.maximum(position - window, 0) // period * period
        tl.store(meta_ptr + col, anchor, mask=inside)
        tl.store(meta_ptr + stride_meta + col, position, mask=inside)
        tl.store(meta_ptr + 2 * stride_meta + col, tl.where(held, base, 0), mask=inside)


def _launch(meta: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, periods: torch.Tensor, *,
            window: int = 0, count: int = 0, stacked: torch.Tensor | None = None, block_size: int = 1,
            scratch_slot: int = 0) -> None:
    """Either kernel: int64 meta [3 or 2, rows] (unit column stride), anchors, positions and periods [B] int64
    contiguous, stacked [B, W] int32 or int64 (unit column stride)."""
    commit = stacked is not None
    batch = positions.shape[0]
    assert meta.dim() == 2 and meta.shape[0] == (2 if commit else 3) and meta.stride(1) == 1
    assert meta.dtype == torch.int64 and periods.shape == anchors.shape == (batch,)
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in (anchors, positions, periods))
    assert (batch * count if commit else batch) <= meta.shape[1]
    if commit:
        assert stacked.shape[0] == batch and stacked.stride(1) == 1 and count >= 1
    _chain_meta_kernel[(1,)](meta, meta.stride(0), anchors, positions, periods, stacked if commit else positions,
                             stacked.stride(0) if commit else 0, batch, window, count, block_size, scratch_slot,
                             ROWS=meta.shape[1], ROWS_P2=triton.next_power_of_2(meta.shape[1]), COMMIT=commit,
                             num_warps=1, **dependent_launch(meta.device, "chain_meta"))
