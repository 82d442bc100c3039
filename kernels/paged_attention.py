"""Paged attention for decode and verify: Q new queries per sequence against its keys in a paged KV cache.

Layout (vLLM's PagedAttention, as target_service/kv_cache.py keeps it): position p of sequence b lives at
`cache[block_tables[b, p // block_size], p % block_size]`. Query (b, j) sees the keys at positions
lo..positions[b, j] of its own sequence, lo = 0, or max(0, pos - window + 1) with a sliding window.
The queries' own keys are already in the cache, so causality inside a verify block follows from the
positions alone. Both paths are graph-capturable: no host sync, no data-dependent shapes; the block
table and the positions are read on the device.

A draft tree's verify (`shared.tree`) passes `tree` [B, Q] int64: bit j of query i's word set where it sees
the block's query j (the key at positions[b, 0] + j), so a node sees the context and its ancestors only; keys
before the block are seen as in a chain. (Its rotary positions are the model's business; no sliding window.)

Measured and dropped (fifty-first session, H100, `bench/profile_step.py`, alternating runs in one call): the
splits combined by the last split program of each tile to arrive (arrival counters, as kernels.row_max does)
instead of `_combine_splits_kernel`'s second launch. One launch a layer fewer (190 kernels a target-only step
against 220, a tree step 258 against 294), yet the steps took 0.960 ms against 0.705 (target only, one stream),
1.514 and 1.508 against 0.999 and 1.004 (trees of 15, one stream), 1.327 against 1.289 (eight streams): the
attention launch went from 4.3 to 19.5 µs, its last program reading the 32 splits' rows one split after another
where the combine launch reads them with 9 programs a query at once.
"""

from __future__ import annotations

import functools
import math

import torch

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton


def paged_attention(q, k_cache, v_cache, block_tables, positions, scale, window=None, tree=None):
    """The Triton kernel on CUDA tensors when Triton is installed, the torch reference otherwise."""
    if HAVE_TRITON and q.is_cuda:
        return paged_attention_triton(q, k_cache, v_cache, block_tables, positions, scale, window, tree=tree)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, positions, scale, window, tree)


MAX_TREE_QUERIES = 64  # a tree's visibility is one int64 word a query


def _check_tree(tree: torch.Tensor | None, positions: torch.Tensor, window: int | None) -> None:
    if tree is None:
        return
    if window is not None:
        raise ValueError("a tree verify takes no sliding window (its distances are its depths, not its rows)")
    if tree.shape != positions.shape or tree.dtype != torch.int64 or positions.shape[1] > MAX_TREE_QUERIES:
        raise ValueError(f"tree: int64 [B, Q] like positions {tuple(positions.shape)}, Q <= {MAX_TREE_QUERIES}")


def paged_attention_reference(
    q: torch.Tensor,             # [B, Q, Hq, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32; entries past a sequence's last block: any value
    positions: torch.Tensor,     # [B, Q] int32/int64
    scale: float,
    window: int | None = None,
    tree: torch.Tensor | None = None,  # [B, Q] int64 visibility words inside the block (see the module)
) -> torch.Tensor:               # [B, Q, Hq, D] in q's dtype
    """Every key the table can address (max_blocks * block_size per sequence), masked: simple, and
    static-shaped so that it can be captured in a CUDA graph too. Float32 throughout."""
    _check_tree(tree, positions, window)
    batch, q_len, q_heads, head_dim = q.shape
    num_blocks, _, kv_heads, _ = k_cache.shape
    tables = block_tables.long().clamp(0, num_blocks - 1)
    k = k_cache[tables].flatten(1, 2).float()  # [B, L, Hkv, D]: index l holds position l
    v = v_cache[tables].flatten(1, 2).float()
    key_pos = torch.arange(k.shape[1], device=q.device)
    pos = positions.long()[:, :, None]  # [B, Q, 1]
    visible = key_pos <= pos  # [B, Q, L]
    if window is not None:
        visible &= key_pos > pos - window
    if tree is not None:
        rel = key_pos[None, None, :] - positions.long()[:, :1, None]  # [B, 1, L]: the key's row in the block
        inside = (rel >= 0) & (rel < q_len)
        visible &= ~inside | ((tree[:, :, None] >> rel.clamp(0, MAX_TREE_QUERIES - 1)) & 1).bool()
    # Slots no query sees may never have been written (NaN included): a 0 weight times NaN is NaN.
    v = v.masked_fill(~visible.any(1)[:, :, None, None], 0)
    qg = q.float().unflatten(2, (kv_heads, -1))  # [B, Q, Hkv, G, D]: head h reads kv head h // G
    scores = torch.einsum("bqhgd,blhd->bqhgl", qg, k) * scale
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    out = torch.einsum("bqhgl,blhd->bqhgd", scores.softmax(-1), v)
    return out.reshape(batch, q_len, q_heads, head_dim).to(q.dtype)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, tree_ptr, out_ptr, lse_ptr, scale_log2,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_ks, stride_kh,  # shared by k and v (both contiguous)
    stride_tb, stride_pb, stride_pq, stride_treeb,
    Q_LEN: tl.constexpr, Q_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, TILES: tl.constexpr, USE_GDC: tl.constexpr,
    TREE: tl.constexpr,
):
    """One program per (sequence, kv head, row tile, split): the group's heads x queries in tiles of
    ROWS rows (TILES of them), so each key is read once per tile. Writes out [B, Q, Hq, NUM_SPLITS, D]
    (normalised within the split) and, when split, the log2-sum-exp of each row's scores in its split."""
    gdc_enter(USE_GDC)
    seq, split = tl.program_id(0), tl.program_id(2)
    kv_head, tile = tl.program_id(1) // TILES, tl.program_id(1) % TILES
    rows = tile * ROWS + tl.arange(0, ROWS)
    # Row r is query r // GROUPS of head kv_head * GROUPS + r % GROUPS. The rows that pad the tile to a
    # power of two repeat the last query: every row is a real one, and only the store masks them.
    query = tl.minimum(rows // GROUPS, Q_LEN - 1)
    head = kv_head * GROUPS + rows % GROUPS
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + query[:, None] * stride_qq + head[:, None] * stride_qh + dims[None, :])
    hi = tl.load(positions_ptr + seq * stride_pb + query * stride_pq).to(tl.int32)
    lo = tl.zeros_like(hi)
    if WINDOW > 0:
        lo = tl.maximum(hi - WINDOW + 1, 0)
    if TREE:  # the block's first row (the root), and each row's word of the block rows it sees
        root = tl.load(positions_ptr + seq * stride_pb).to(tl.int32)
        words = tl.load(tree_ptr + seq * stride_treeb + query)

    # This split's share of the keys the tile needs, first..last, in whole key tiles.
    first, last = tl.min(lo, axis=0), tl.max(hi, axis=0)
    per_split = tl.cdiv(tl.cdiv(last + 1 - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, last + 1)

    m = tl.full([ROWS], -1e30, tl.float32)  # finite: a row that sees no key of a tile keeps exp2(m - m) = 1
    denom = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for key0 in range(start, end, BLOCK_N):
        keys = key0 + tl.arange(0, BLOCK_N)
        needed = keys < end  # never load past it: unwritten slots may hold NaN
        block = tl.load(tables_ptr + seq * stride_tb + keys // BLOCK_SIZE, mask=needed, other=0)
        kv = block.to(tl.int64)[:, None] * stride_kb + (keys % BLOCK_SIZE)[:, None] * stride_ks \
            + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_ptr + kv, mask=needed[:, None], other=0.0)
        v = tl.load(v_ptr + kv, mask=needed[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [ROWS, BLOCK_N], log2 units
        visible = needed[None, :] & (keys[None, :] <= hi[:, None]) & (keys[None, :] >= lo[:, None])
        if TREE:
            rel = keys - root
            inside = (rel >= 0) & (rel < Q_LEN)
            seen = ((words[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1) != 0
            visible = visible & (~inside[None, :] | seen)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out_row = ((seq * Q_LEN + query) * Q_HEADS + head) * NUM_SPLITS + split
    stored = rows < Q_LEN * GROUPS
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # denom 0: a split holding none of the row's keys
    tl.store(out_ptr + out_row[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=stored[:, None])
    if NUM_SPLITS > 1:
        tl.store(lse_ptr + out_row, m + tl.log2(denom), mask=stored)  # -inf where denom is 0


@triton.jit
def _combine_splits_kernel(partial_ptr, lse_ptr, out_ptr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           USE_GDC: tl.constexpr):
    """One program per (sequence, query, head): the splits' outputs weighted by their share of the sum."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0)  # over [B * Q * Hq]; partial [.., NUM_SPLITS, D] and lse [.., NUM_SPLITS]
    splits, dims = tl.arange(0, NUM_SPLITS), tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * NUM_SPLITS + splits)
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    partial = tl.load(partial_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :])
    out = tl.sum(weight[:, None] * partial, axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def paged_attention_triton(q, k_cache, v_cache, block_tables, positions, scale, window=None,
                           num_splits: int | None = None, block_n: int = 64, tree=None):
    """Launch wrapper (same arguments as the reference). num_splits > 1 is flash-decoding: the keys are
    split over more programs when B * Hkv alone cannot fill the GPU; None picks it from the shapes."""
    _check_tree(tree, positions, window)
    tree = None if tree is None else tree.contiguous()
    batch, q_len, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim and q_heads % kv_heads == 0
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two, at least 16"
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(3) == 1
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == batch and block_tables.stride(1) == 1
    assert positions.shape == (batch, q_len) and positions.dtype in (torch.int32, torch.int64)
    assert window is None or window > 0
    assert q.device == k_cache.device == block_tables.device == positions.device
    groups = q_heads // kv_heads
    if num_splits is None:  # (from the sequences and heads alone, not the row tiles: a decode and a verify
        # over the same table split their keys alike, so each row's arithmetic is the same in both)
        num_splits = default_splits(batch * kv_heads, block_tables.shape[1] * block_size, block_n, q.device)
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0
    out = torch.empty(batch, q_len, q_heads, head_dim, dtype=q.dtype, device=q.device)
    partial, lse = out, out  # unsplit: the kernel writes the output itself and no lse
    if num_splits > 1:
        partial = torch.empty(batch, q_len, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, q_len, q_heads, num_splits, dtype=torch.float32, device=q.device)
    rows, tiles = row_tiles(groups * q_len)
    _paged_attention_kernel[(batch, kv_heads * tiles, num_splits)](
        q, k_cache, v_cache, block_tables, positions, positions if tree is None else tree, partial, lse,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), positions.stride(0), positions.stride(1), 0 if tree is None else tree.stride(0),
        Q_LEN=q_len, Q_HEADS=q_heads, GROUPS=groups, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        ROWS=rows, BLOCK_N=block_n, WINDOW=window or 0, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32: no effect on 16-bit inputs
        TILES=tiles, TREE=tree is not None, num_warps=8 if rows * head_dim >= 8192 else 4,
        **dependent_launch(q.device, "paged_attention"),
    )
    if num_splits > 1:
        _combine_splits_kernel[(batch * q_len * q_heads,)](partial, lse, out, NUM_SPLITS=num_splits,
                                                          HEAD_DIM=head_dim, **dependent_launch(q.device, "combine_splits"))
    return out


MAX_TILE_ROWS = 32


def row_tiles(rows: int) -> tuple[int, int]:
    """(rows per tile, tiles) for a group's heads x queries: a power of two from 16 (tl.dot's least) to
    MAX_TILE_ROWS. Capped so that a verify's rows go through the same matrix instructions as a decode's:
    on the H200 16-token verifies (a 64-row tile for SmolLM2's 3 heads a group) parted bf16 greedy texts
    from target-only's at near-ties where 4- and 8-token ones (16- and 32-row tiles) kept them, the
    attention being what differed (sixteenth session; a 64-row tile presumably takes the warpgroup MMA
    path, with another rounding). Each tile reads the group's keys again (from L2, mostly)."""
    per_tile = min(MAX_TILE_ROWS, max(16, triton.next_power_of_2(rows)))
    return per_tile, -(-rows // per_tile)


def default_splits(programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Split the keys until the programs fill the GPU's SMs, each split keeping >= 4 key tiles of the
    table's capacity. From shapes only, so a captured graph stays valid for any positions. (The engine's table
    spans the model's whole context, so a short context's keys are cut finer than it needs; capping the splits
    at 16, 8, 4, 2 or 1 measured no faster on the H200, thirty-fourth session: 664-932 us a SmolLM2 step
    against 666, 997-1140 against 995 for 8 x 16, and served target-only tokens/s 0.87x at eight streams
    with at most 4.)"""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    splits = 1
    while programs * splits * 2 <= sms and max_keys >= splits * 2 * 4 * block_n:
        splits *= 2
    return splits


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
