"""A decoder layer's q/k/v projection with the rotation and the KV-cache write done on its way out: one launch
where `kernels.skinny_linear` and `kernels.rope.rope_and_cache_write` take two.

Each program computes one head of the projection's output (its head_dim columns, as two accumulators of the
head's halves, so the rotate_half partners meet in one program) for a tile of rows, over the whole of K as the
few-rows projection does (with the input's RMSNorm handed over as a PendingNorm, `norm_in`), then rounds the
result to the model dtype and, as `rope_and_cache_write` would from that rounded output: a q head is normed
(where the layer has per-head norms), rotated and stored in q_out; a k head normed, rotated and written to the
cache row of its token's slot; a v head written there. Meant for small models' decode steps, whose projection
weights sit in L2 (a program streams a whole head's rows: 15 programs for SmolLM2's 9 + 3 + 3 heads).

`shared.fused` takes it where ROPE_IN_QKV and `takes_qkv_rope` hold and the layer's attention is a
`shared.fused.PagedAttend`. Built without a GPU (fifty-first session): off until one has run it
(`gpu_round.sh qkv-rope`; SPECSPLIT_ROPE_IN_QKV=1).
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, _switch, dependent_launch, gdc_enter, tl, triton
from .norm import rms_norm_reference
from .rope import rope_and_cache_write_reference
from .skinny_linear import MIN_WEIGHT_BYTES

ROPE_IN_QKV = _switch("SPECSPLIT_ROPE_IN_QKV", False)  # read when a forward is captured (shared.fused)
MAX_ROWS = 128  # (row tiles of 16 up to 16 rows, of 64 past them)


def takes_qkv_rope(x: torch.Tensor, weight: torch.Tensor, heads: tuple[int, int]) -> bool:
    """Whether `qkv_rope_triton` takes this projection: 16-bit CUDA rows (at most MAX_ROWS) against a weight
    small enough to sit in L2 (below skinny_linear.MIN_WEIGHT_BYTES: a program streams a whole head's rows, few
    programs for a wide model's bandwidth), heads of a power of two from 32 wide."""
    hq, hkv = heads
    dim, rest = divmod(weight.shape[0], hq + 2 * hkv)
    return (HAVE_TRITON and x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and rest == 0
            and dim >= 32 and dim & (dim - 1) == 0 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.numel() * weight.element_size() < MIN_WEIGHT_BYTES)


def qkv_rope_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: tuple[int, int],
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
                       norm_in: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """x [T, K] (with norm_in: the input's RMSNorm weight [K], applied first as `kernels.norm` does), weight
    [(Hq + 2 Hkv) D, K], heads (Hq, Hkv): the projection rounded to x's dtype, split into q, k and v heads, then
    `rope_and_cache_write_reference` (norms: the per-head q and k norm weights, eps theirs). Returns rotated q
    [T, Hq, D]."""
    hq, hkv = heads
    if norm_in is not None:
        x = rms_norm_reference(x, norm_in, norm_eps)
    qkv = torch.nn.functional.linear(x, weight, bias).to(x.dtype)
    dim = weight.shape[0] // (hq + 2 * hkv)
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    q, k, v = (t.reshape(t.shape[0], -1, dim) for t in (q, k, v))
    return rope_and_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, slots, norms, eps)


@triton.jit
def _qkv_rope_kernel(x_ptr, stride_xm, w_ptr, stride_wn, bias_ptr, squares_ptr, squares_in, norm_eps, M, K,
                     cos_ptr, sin_ptr, stride_cs, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, q_norm_ptr,
                     k_norm_ptr, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, DIM: tl.constexpr, HAS_BIAS: tl.constexpr,
                     NORM_IN: tl.constexpr, SQUARES_BLOCK: tl.constexpr, NORMS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
    """Program (m, head): rows m*BLOCK_M.. of output head `head` (q heads, then k, then v)."""
    gdc_enter(USE_GDC)
    HALF: tl.constexpr = DIM // 2
    head = tl.program_id(1)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rm < M
    half = tl.arange(0, HALF)
    lo = head * DIM + half  # the weight rows of the head's first half; the second's are HALF further
    dtype = x_ptr.dtype.element_ty
    if NORM_IN:  # a PendingNorm's partial sums of squares: loaded before the loop, in flight while weights stream
        parts = tl.arange(0, SQUARES_BLOCK)
        squares = tl.sum(tl.load(squares_ptr + rm[:, None] * squares_in + parts[None, :],
                                 mask=real[:, None] & (parts[None, :] < squares_in), other=0.0), axis=1)
        scale = tl.math.rsqrt(squares / K + norm_eps)[:, None]
    acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=real[:, None] & (rk[None, :] < K), other=0.0)
        rows = w_ptr + lo[:, None].to(tl.int64) * stride_wn + rk[None, :]
        inside = rk[None, :] < K
        acc1 += tl.dot(x, tl.trans(tl.load(rows, mask=inside, other=0.0)))
        acc2 += tl.dot(x, tl.trans(tl.load(rows + HALF * stride_wn, mask=inside, other=0.0)))
    if NORM_IN:
        acc1 *= scale
        acc2 *= scale
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + lo).to(tl.float32)[None, :]
        acc2 += tl.load(bias_ptr + lo + HALF).to(tl.float32)[None, :]
    x1 = acc1.to(dtype).to(tl.float32)  # the projection's output, rounded as its own launch stores it
    x2 = acc2.to(dtype).to(tl.float32)
    cols = half[None, :]
    if head >= HQ + HKV:  # a v head: into the cache row of each token's slot
        slot = tl.load(slots_ptr + rm, mask=real, other=0)
        row = v_cache_ptr + slot[:, None] * (HKV * DIM) + (head - HQ - HKV) * DIM + cols
        tl.store(row, x1.to(dtype), mask=real[:, None])
        tl.store(row + HALF, x2.to(dtype), mask=real[:, None])
    else:
        is_q = head < HQ
        if NORMS:  # per-head RMSNorm (kernels/rope.py's _rotate), by q's weight or k's
            if is_q:
                w1 = tl.load(q_norm_ptr + cols).to(tl.float32)
                w2 = tl.load(q_norm_ptr + HALF + cols).to(tl.float32)
            else:
                w1 = tl.load(k_norm_ptr + cols).to(tl.float32)
                w2 = tl.load(k_norm_ptr + HALF + cols).to(tl.float32)
            r = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / DIM + eps)[:, None]
            x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        table = rm[:, None] * stride_cs + cols
        cos1 = tl.load(cos_ptr + table, mask=real[:, None], other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + table + HALF, mask=real[:, None], other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + table, mask=real[:, None], other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + table + HALF, mask=real[:, None], other=0.0).to(tl.float32)
        # rotate_half(x) = (-x2, x1); each product and the sum rounded to the model dtype as in torch
        out1 = ((x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
        out2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
        if is_q:
            row = q_out_ptr + rm[:, None] * (HQ * DIM) + head * DIM + cols
        else:
            slot = tl.load(slots_ptr + rm, mask=real, other=0)
            row = k_cache_ptr + slot[:, None] * (HKV * DIM) + (head - HQ) * DIM + cols
        tl.store(row, out1, mask=real[:, None])
        tl.store(row + HALF, out2, mask=real[:, None])


def qkv_rope_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: tuple[int, int],
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
                    squares: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """`qkv_rope_reference` in one launch. With `squares` (a PendingNorm's), x is that norm's `weighted` input
    and its 1/rms scales the sums (as `kernels.skinny_linear.linear_triton(norm_in=...)`)."""
    assert HAVE_TRITON, "triton is not installed"
    hq, hkv = heads
    rows, k = x.shape
    width = weight.shape[0]
    dim = width // (hq + 2 * hkv)
    assert hq % hkv == 0 and dim * (hq + 2 * hkv) == width and dim >= 32 and dim & (dim - 1) == 0, (heads, width)
    assert 1 <= rows <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert x.dtype == weight.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype
    assert bias is None or (bias.shape == (width,) and bias.is_contiguous())
    assert cos.shape == sin.shape == (rows, dim) and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (hkv, dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slots.shape == (rows,) and slots.dtype == torch.int64
    assert squares is None or (squares.dim() == 2 and squares.shape[0] == rows and squares.dtype == torch.float32
                               and squares.is_contiguous())
    if norms is not None:
        assert all(w.shape == (dim,) and w.dtype == x.dtype and w.is_contiguous() for w in norms), \
            [(w.shape, w.dtype) for w in norms]
    q_norm, k_norm = norms if norms is not None else (x, x)  # (not read without NORMS)
    q_out = torch.empty(rows, hq, dim, dtype=x.dtype, device=x.device)
    block_m, block_k, warps, stages = (16, 256, 2, 4) if rows <= 16 else (64, 128, 4, 3)
    _qkv_rope_kernel[(triton.cdiv(rows, block_m), hq + 2 * hkv)](
        x, x.stride(0), weight, weight.stride(0), x if bias is None else bias, x if squares is None else squares,
        0 if squares is None else squares.shape[1], norm_eps, rows, k, cos, sin, cos.stride(0), slots, q_out,
        k_cache, v_cache, q_norm, k_norm, eps, HQ=hq, HKV=hkv, DIM=dim, HAS_BIAS=bias is not None,
        NORM_IN=squares is not None,
        SQUARES_BLOCK=1 if squares is None else triton.next_power_of_2(squares.shape[1]), NORMS=norms is not None,
        BLOCK_M=block_m, BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))), num_warps=warps,
        num_stages=stages, enable_fp_fusion=False, **dependent_launch(x.device, "rope"))
    return q_out
