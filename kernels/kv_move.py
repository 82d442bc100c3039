"""Cache rows moved on the device in one launch: a chained tree step's accepted path, every layer's k and v.

After a tree verify the accepted nodes' k/v lie at the rows their verify wrote and move to the positions their
tokens take (`PagedKVCache.move_slots`). As torch ops that is an index_select and an index_copy a pool: four
kernels a step, two of them reading across every layer at about 8 µs each (the forty-seventh session's
profile, H100). Here a program a (layer, column tile) reads its tile of every source row of both pools, then
writes them all: every row is read before any is written, as the torch ops do.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton

KERNEL = True  # False: the torch reference on CUDA too (`bench/profile_step.py --torch-kernels kv_move`)
BLOCK_COLUMNS = 64


def move_rows_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Pools [L, blocks, block_size, Hkv, D]: every layer's rows `src` [n] (flat over blocks x block_size)
    copied to rows `dst` [n], all read before any is written. A row repeated in dst gets one of its sources."""
    for pool in (k_pool, v_pool):
        flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # [L, blocks * block_size, Hkv, D]
        flat.index_copy_(1, dst, flat.index_select(1, src))


def move_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The Triton kernel on CUDA, the torch reference elsewhere (the same arguments)."""
    if KERNEL and HAVE_TRITON and k_pool.is_cuda:
        move_rows_triton(k_pool, v_pool, src, dst)
    else:
        move_rows_reference(k_pool, v_pool, src, dst)


@triton.jit
def _move_rows_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, n, layer_stride, WIDTH: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_C: tl.constexpr, USE_GDC: tl.constexpr):
    """Program (layer, tile): columns tile * BLOCK_C.. of the n rows of both pools, all loaded, then all stored."""
    gdc_enter(USE_GDC)
    layer, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rows = tl.arange(0, ROWS)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n) & (cols[None, :] < WIDTH)
    src = tl.load(src_ptr + rows, mask=rows < n, other=0)
    dst = tl.load(dst_ptr + rows, mask=rows < n, other=0)
    read = layer * layer_stride + src[:, None] * WIDTH + cols[None, :]
    write = layer * layer_stride + dst[:, None] * WIDTH + cols[None, :]
    k = tl.load(k_ptr + read, mask=mask)
    v = tl.load(v_ptr + read, mask=mask)
    tl.debug_barrier()  # (every row read before any is written: a row may be another's source)
    tl.store(k_ptr + write, k, mask=mask)
    tl.store(v_ptr + write, v, mask=mask)


def move_rows_triton(k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """`move_rows` in one launch: contiguous pools alike, int64 src and dst [n] contiguous."""
    assert k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype and k_pool.dim() == 5
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    assert src.shape == dst.shape and src.dim() == 1 and src.dtype == dst.dtype == torch.int64
    assert src.is_contiguous() and dst.is_contiguous()
    n = src.shape[0]
    if n == 0:
        return
    layers, blocks, block_size, heads, dim = k_pool.shape
    width = heads * dim
    grid = (layers, triton.cdiv(width, BLOCK_COLUMNS))
    _move_rows_kernel[grid](k_pool, v_pool, src, dst, n, blocks * block_size * width, WIDTH=width,
                            ROWS=triton.next_power_of_2(n), BLOCK_C=BLOCK_COLUMNS, num_warps=4,
                            **dependent_launch(k_pool.device, "kv_move"))
