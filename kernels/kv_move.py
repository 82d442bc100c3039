"""Cache rows moved on the device in one launch: a chained tree step's accepted path, every layer's k and v.

After a tree verify the accepted nodes' k/v lie at the rows their verify wrote and move to the positions their
tokens take (`PagedKVCache.move_slots`). As torch ops that is an index_select and an index_copy a pool: four
kernels a step, two of them reading across every layer at about 8 µs each (the forty-seventh session's
profile, H100). Here a program a (layer, column tile, sequence) reads its tile of the sequence's source rows of
both pools, then writes them all: every row is read before any is written, as the torch ops do (one sequence's
moves never touch another's rows).
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton

KERNEL = True  # False: the torch reference on CUDA too (`bench/profile_step.py --torch-kernels kv_move`)
BLOCK_COLUMNS = 64


def move_rows_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                        group: int | None = None) -> None:
    """Pools [L, blocks, block_size, Hkv, D]: every layer's rows `src` [n] (flat over blocks x block_size)
    copied to rows `dst` [n], all read before any is written. A row repeated in dst gets one of its sources.
    (`group`: see `move_rows`.)"""
    for pool in (k_pool, v_pool):
        flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # [L, blocks * block_size, Hkv, D]
        flat.index_copy_(1, dst, flat.index_select(1, src))


def move_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
              group: int | None = None) -> None:
    """The Triton kernel on CUDA, the torch reference elsewhere (the same arguments). `group`: the moves come in
    groups of that many (a sequence's path), no group's destination another's source but the scratch row (whose
    contents nobody reads): the kernel reads and writes each group in its own programs. None: one group."""
    if group is not None and (group < 1 or src.shape[0] % group):
        raise ValueError(f"moves in groups of {group} take a multiple of {group} rows, got {src.shape[0]}")
    if KERNEL and HAVE_TRITON and k_pool.is_cuda:
        move_rows_triton(k_pool, v_pool, src, dst, group)
    else:
        move_rows_reference(k_pool, v_pool, src, dst)


@triton.jit
def _move_rows_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, group, layer_stride, WIDTH: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_C: tl.constexpr, USE_GDC: tl.constexpr):
    """Program (layer, tile, g): columns tile * BLOCK_C.. of group g's rows of both pools, all loaded, then all
    stored."""
    gdc_enter(USE_GDC)
    layer, tile, g = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, ROWS)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < group) & (cols[None, :] < WIDTH)
    src = tl.load(src_ptr + g * group + rows, mask=rows < group, other=0)
    dst = tl.load(dst_ptr + g * group + rows, mask=rows < group, other=0)
    read = layer * layer_stride + src[:, None] * WIDTH + cols[None, :]
    write = layer * layer_stride + dst[:, None] * WIDTH + cols[None, :]
    k = tl.load(k_ptr + read, mask=mask)
    v = tl.load(v_ptr + read, mask=mask)
    tl.debug_barrier()  # (every row read before any is written: a row may be another's source)
    tl.store(k_ptr + write, k, mask=mask)
    tl.store(v_ptr + write, v, mask=mask)


def move_rows_triton(k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                     group: int | None = None) -> None:
    """`move_rows` in one launch: contiguous pools alike, int64 src and dst [n] contiguous."""
    assert k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype and k_pool.dim() == 5
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    assert src.shape == dst.shape and src.dim() == 1 and src.dtype == dst.dtype == torch.int64
    assert src.is_contiguous() and dst.is_contiguous()
    n = src.shape[0]
    if n == 0:
        return
    group = group or n
    assert n % group == 0
    layers, blocks, block_size, heads, dim = k_pool.shape
    width = heads * dim
    grid = (layers, triton.cdiv(width, BLOCK_COLUMNS), n // group)
    _move_rows_kernel[grid](k_pool, v_pool, src, dst, group, blocks * block_size * width, WIDTH=width,
                            ROWS=triton.next_power_of_2(group), BLOCK_C=BLOCK_COLUMNS, num_warps=4,
                            **dependent_launch(k_pool.device, "kv_move"))
