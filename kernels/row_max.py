"""The max of each row and where it first occurs: the greedy pick over a vocabulary of logits.

`torch.max(x, dim=-1)` gives one program a row, so a step's 16 rows of 49,152 logits keep 16 of the
GPU's 132 SMs busy for ~13 µs. The kernel splits each row over programs of BLOCK columns; the last of a
row's programs to finish (`kernels.workspace`) reduces their partial results, so it is one launch.
Same results as torch: the first index of the maximum, and NaN the maximum where a row holds one (its
first NaN's index).
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton
from .workspace import arrived_last

BLOCK = 2048  # columns a program reads


def row_max_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of each row's maximum, x [R, V]."""
    best = x.max(dim=-1)
    return best.values, best.indices


def row_max(x: torch.Tensor, workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel for a CUDA x with a workspace (at least R counters), torch's max otherwise."""
    if HAVE_TRITON and x.is_cuda and workspace is not None:
        return row_max_triton(x, workspace)
    return row_max_reference(x)


@triton.jit
def _row_max_kernel(x_ptr, stride_x, vocab, part_val_ptr, part_idx_ptr, arrivals_ptr, val_ptr, idx_ptr,
                    SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """Program (row, split) reads columns split*BLOCK.. of its row; the row's last arrival reduces."""
    gdc_enter(USE_GDC)
    row, split = tl.program_id(0), tl.program_id(1)
    cols = split * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    at = tl.min(tl.where(x == best, cols, vocab), axis=0)  # the first column holding it
    first_nan = tl.min(tl.where(x != x, cols, vocab), axis=0)
    best = tl.where(first_nan < vocab, float("nan"), best)
    at = tl.where(first_nan < vocab, first_nan, at)
    tl.store(part_val_ptr + row * SPLITS + split, best)
    tl.store(part_idx_ptr + row * SPLITS + split, at)
    counter = arrivals_ptr + row
    if arrived_last(counter, SPLITS):
        splits = tl.arange(0, SPLITS_POW2)
        real = splits < SPLITS
        vals = tl.load(part_val_ptr + row * SPLITS + splits, mask=real, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + row * SPLITS + splits, mask=real, other=vocab, cache_modifier=".cg")
        best = tl.max(vals, axis=0)
        at = tl.min(tl.where(vals == best, idxs, vocab), axis=0)  # splits are in column order
        first_nan = tl.min(tl.where(vals != vals, idxs, vocab), axis=0)
        best = tl.where(first_nan < vocab, float("nan"), best)
        at = tl.where(first_nan < vocab, first_nan, at)
        tl.store(val_ptr + row, best)
        tl.store(idx_ptr + row, at.to(tl.int64))
        tl.atomic_xchg(counter, 0)


def row_max_triton(x: torch.Tensor, workspace: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32 [R], indices int64 [R]) of x [R, V] (float32/bfloat16/float16, rows contiguous)."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    rows, vocab = x.shape
    assert rows >= 1 and 1 <= vocab < 2 ** 31
    assert workspace.dtype == torch.int32 and workspace.numel() >= rows and workspace.device == x.device
    splits = triton.cdiv(vocab, BLOCK)
    part_val = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=x.device)
    values = torch.empty(rows, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, dtype=torch.int64, device=x.device)
    _row_max_kernel[(rows, splits)](x, x.stride(0), vocab, part_val, part_idx, workspace, values, indices,
                                    SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits), BLOCK=BLOCK,
                                    num_warps=4, **dependent_launch(x.device, "row_max"))
    return values, indices
