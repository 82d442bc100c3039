"""y = x @ w.T (+ bias) for a few rows against a large weight: a decode step's projections on a wide model.

A decode step of an 8B-class model reads ~15 GB of weights for one to sixteen rows, so each projection is
bandwidth-bound and should stream its weight at the copy rate. cuBLAS does not quite, at those shapes on
the H200 (`bench/gemm_probe.py --geometry qwen3-8b`, one row): the down projection (12,288 -> 4,096, 96 MiB)
30.4 µs against 23.6 at the copy rate, and a split-K second kernel for o and down. This kernel gives each
program BLOCK_N output columns of every row and streams their weight rows once over K in BLOCK_K tiles,
float32 accumulation, no split (26.6 µs for that down projection). The Qwen3-8B-shaped decode step at one
stream (`bench/floor_profile.py`, a replay of its graph): 4.83 ms with cuBLAS, 4.51 with this kernel.

Alone, at SmolLM2's widths (weights of 0.6-3.4 MiB, K of 576 or 1,536, latency-bound), it measured about
as fast as cuBLAS (the twenty-eighth session, one stream's captured step: qkv 2.8 µs against 3.7, o 2.8
against 3.2, gate/up 3.5 against 3.7, down 3.8 against 4.7, where the ninth session had found cuBLAS's
launch the better), and its 57-MB LM head (K = 576) took 18.5-18.9 µs against 16.5-16.8 for cuBLAS. So
`linear` takes it for 16-bit CUDA inputs of at most MAX_ROWS rows against a weight of at least
MIN_WEIGHT_BYTES and MIN_K columns (`takes_kernel`), F.linear otherwise; a decoder layer takes it for every
projection whatever their size (`bounded=False`), where it also does the layer's norms, SiLU·mul and
residual adds (below). Benches set MIN_WEIGHT_BYTES to compare in one run.

Measured and dropped (twenty-seventh session, `bench/floor_profile.py`, Qwen3-8B's geometry, one row, H200):
- SiLU·mul folded into the down projection's kernel (each program reading the gate/up rows and applying the
  activation as kernels/activation.py does): 88 µs where the projection took 27 and SiLU·mul 1.5. Every
  program computed the activation of sixteen rows, fifteen of them padding, over the whole of K.
- A one-row kernel without tl.dot (each program multiplying its weight rows by the row elementwise in
  float32, summing once at the end): the step 6.50 ms against 4.51 with the 16-row tiles (qkv 21.1 µs against
  14.5, the down projection 60.5 against 26.8). The fold in it: 6.74 ms.
- (twenty-eighth session) An RMSNorm folded into the loop (each loaded x tile times the norm's weight, its
  squares summed, 1/rms applied to the sums at the end): qkv 42.2 µs against 14.4, gate/up with SiLU·mul
  97.7 against 48.6; the step 7.05 ms against 4.52. The norm now travels between projections instead
  (PendingNorm): the writer multiplies by the weight and sums squares on the tile it stores, and the reader's
  loop is the plain one. The residual add on the way out cost nothing measurable (o 11.08 µs against 10.88,
  down 26.58 against 26.71).

What the kernel folds in beside the product (shared/fused.py uses them where every projection of a layer
takes the kernel): SiLU·mul of the gate and up halves (each program streams its gate rows and its up rows),
a residual added to the rounded result, and an RMSNorm handed from the projection that writes its input to
the one that reads it (`linear_triton_norm_out`, `PendingNorm`). So that a small model's layers keep the folds
beyond one tile of rows (eight streams' verify of 16 tokens, the DFlash drafter's blocks at eight streams),
the kernel also runs row tiles side by side (WIDE_TILE's, up to MAX_FOLD_ROWS rows), each reading the weight's
columns again, from L2 where the weight is below MIN_WEIGHT_BYTES; a heavier weight stays at one tile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton
from .activation import silu_mul_reference
from .norm import rms_norm_reference

MAX_ROWS = 16  # tl.dot's least tile; more rows go to cuBLAS, where they stop being a weight stream alone ...
# ... except in a decoder layer whose weights are small enough to stay in L2 (below MIN_WEIGHT_BYTES: SmolLM2's),
# where the kernel runs row tiles side by side (WIDE_TILE) to keep its folds (eight streams' verify)
MAX_FOLD_ROWS = 128
# (rows, columns, K) of a program past MAX_ROWS rows, its warps and pipeline stages: a GEMM's tile (the best of
# bench/gemm_probe.py --row-tiles at 64 and 128 rows of SmolLM2's projections on the H200, 2.9-4.7 µs each,
# 0.95-1.07x cuBLAS; the few-rows tile stacked 32 rows deep took 4.3-10.5 µs, 2.9x cuBLAS for gate/up)
WIDE_TILE = (64, 32, 128, 4, 3)
MIN_WEIGHT_BYTES = 16 * 2 ** 20  # below, the weight can sit in L2 and a launch's latency is the cost
# A projection of this weight or heavier launches as its own PDL family, "skinny_linear_heavy", which
# kernels._triton.PDL_SKIP leaves plain: launched dependent (the next kernel resident and waiting from this
# one's start) the Qwen3-8B-shaped step took 4.77 ms against 4.47 without PDL, and 4.41 with every other
# kernel dependent (thirtieth session, `bench/floor_profile.py --pdl`); SmolLM2's projections (below it)
# gain by it (0.81 ms to 0.68 with every kernel dependent)
PDL_HEAVY_BYTES = 16 * 2 ** 20
MIN_K = 2048  # below, a program's stream is too short to beat cuBLAS (SmolLM2's head, K = 576)
BLOCK_K = 256
MAX_COLUMN_BLOCKS = 65535  # programs along N (a CUDA grid's y): 1 M columns at the narrowest tile
NARROWEST_BLOCK_N = 16  # (a few-rows program's columns, SWIGLU_BLOCK_N's included)
SWIGLU_BLOCK_N = 16  # output columns of a SiLU·mul program, which streams twice as many weight rows


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, *, norm: torch.Tensor | None = None, eps: float = 0.0,
                     swiglu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, converted to out_dtype (default x's), with what a decoder layer does around it: x RMS-normed
    with weight `norm` first (kernels/norm.py's math), SiLU·mul of the product's halves after (weight [2F, K]:
    gate rows, then up rows), and `residual` added last, each rounded to x's dtype as its own launch would."""
    if norm is not None:
        x = rms_norm_reference(x, norm, eps)
    y = F.linear(x, weight, bias)
    if swiglu:
        y = silu_mul_reference(y.to(x.dtype))
    if residual is not None:
        y = y.to(x.dtype) + residual
    return y.to(out_dtype or x.dtype)


def takes_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 bounded: bool = True) -> bool:
    """Whether `linear` runs the kernel for x [..., K], this weight [N, K] and bias [N]: 16-bit CUDA tensors,
    at most MAX_ROWS rows, and (`bounded`) a weight of at least MIN_WEIGHT_BYTES and MIN_K columns. A decoder
    layer asks unbounded (shared/fused.py): where the kernel also does the norms, SiLU·mul and the residual
    adds, it wins at any width, and for a weight below MIN_WEIGHT_BYTES (read from L2 by every row tile) up
    to MAX_FOLD_ROWS rows. Never where autograd would need the product's graph (the kernel has no
    backward): F.linear's then."""
    if not (HAVE_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype):
        return False  # (first: every projection of an eager forward asks, on the CPU too)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))
    heavy = weight.numel() * weight.element_size() >= MIN_WEIGHT_BYTES
    large = heavy and weight.shape[-1] >= MIN_K
    most = MAX_ROWS if bounded or heavy else MAX_FOLD_ROWS  # (a heavy weight streams once, in one row tile)
    return (1 <= rows <= most and (large or not bounded) and weight.dim() == 2 and weight.stride(1) == 1
            and weight.shape[0] <= MAX_COLUMN_BLOCKS * NARROWEST_BLOCK_N  # (the launch grid's second axis)
            and x.stride(-1) == 1
            and (bias is None or (bias.shape == (weight.shape[0],) and bias.dtype == x.dtype
                                  and bias.is_contiguous()))
            and not grads)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel where it streams a large weight for a few rows."""
    if takes_kernel(x, weight, bias):
        return linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)


class PendingNorm(NamedTuple):
    """An RMSNorm handed from the projection that wrote its input to the one that reads it: the input times
    the norm's weight (rounded), and each producing program's sum of the input's squares over its columns,
    [rows, programs] in float32. The reader scales its sums by 1/rms from those."""

    weighted: torch.Tensor
    squares: torch.Tensor


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, norm_ptr, weighted_ptr, squares_ptr, M, N, K,
                          stride_xm, stride_wn, stride_rm, stride_ym, squares_in, eps, HAS_BIAS: tl.constexpr,
                          SWIGLU: tl.constexpr, ADD: tl.constexpr, NORM_OUT: tl.constexpr, NORM_IN: tl.constexpr,
                          SQUARES_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
    """Program (m, n): columns n*BLOCK_N.. of rows m*BLOCK_M.., over the whole of K (the row tiles of one
    column block are neighbours in launch order, so all but the first read its weight rows from L2). With
    SWIGLU, the program also streams the up rows N.. below its gate rows and stores silu(gate) * up. With ADD, the
    residual's columns are added to the rounded result. With NORM_OUT, it also writes the result times the
    norm's weight and the sum of its squares over the program's columns (a PendingNorm); with NORM_IN, x is
    such a weighted input and the first `squares_in` columns of squares_ptr its partial sums, which scale
    the float32 sums by the row's 1/rms. The loop itself is the plain kernel's: a norm folded into it
    (squares and weight on each loaded tile) made every program 2-3x slower."""
    gdc_enter(USE_GDC)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = x_ptr.dtype.element_ty
    if NORM_IN:  # loaded before the loop: in flight while the weights stream
        parts = tl.arange(0, SQUARES_BLOCK)
        squares = tl.sum(tl.load(squares_ptr + rm[:, None] * squares_in + parts[None, :],
                                 mask=(rm[:, None] < M) & (parts[None, :] < squares_in), other=0.0), axis=1)
        scale = tl.math.rsqrt(squares / K + eps)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        acc += tl.dot(x, tl.trans(tl.load(w_rows, mask=w_mask, other=0.0)))
        if SWIGLU:
            up_rows = w_rows + N.to(tl.int64) * stride_wn  # (64-bit: N * K may pass 2**31)
            acc_up += tl.dot(x, tl.trans(tl.load(up_rows, mask=w_mask, other=0.0)))
    if NORM_IN:
        acc *= scale
        acc_up *= scale
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(bias_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:  # as kernels/activation.py from the rounded projection
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ADD:  # the rounded result plus the residual, rounded, as `linear(...) + residual`
        acc = acc.to(dtype).to(tl.float32) + tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :],
                                                     mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    if NORM_OUT:  # from the rounded output, as kernels/norm.py reads it
        out = tl.where(out_mask, acc.to(dtype).to(tl.float32), 0.0)
        tl.store(squares_ptr + rm * tl.num_programs(1) + tl.program_id(1), tl.sum(out * out, axis=1), mask=rm < M)
        weight = tl.load(norm_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(weighted_ptr + rm[:, None] * N + rn[None, :], (out * weight[None, :]).to(dtype), mask=out_mask)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, *, swiglu: bool = False,
                  residual: torch.Tensor | None = None, norm_in: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor:
    """x [..., K] (up to MAX_FOLD_ROWS rows: MAX_ROWS a tile, WIDE_TILE's past it), weight [N, K] (rows
    contiguous), bias [N] -> [..., N] in out_dtype (default x's; float32 keeps the accumulator, as the LM head
    wants). swiglu (-> [..., N / 2]) and residual [..., N / 2 or N] as `linear_reference`. norm_in: x is a
    PendingNorm's `weighted` and this its `squares` (see `linear_triton_norm_out`), with the norm's eps."""
    return _launch(x, weight, bias, out_dtype, swiglu, residual, norm_in, eps, None)[0]


def linear_triton_norm_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                           residual: torch.Tensor | None = None,
                           norm: torch.Tensor) -> tuple[torch.Tensor, PendingNorm]:
    """`linear_triton`'s output y (with the residual added) and the PendingNorm of y under this RMSNorm weight
    [N], for the next projection: `linear_triton(pending.weighted, w2, norm_in=pending.squares, eps=eps)` is
    `linear_reference(y, w2, norm=norm, eps=eps)` up to rounding (y times the weight is rounded and 1/rms
    scales the float32 sums, where the reference rounds y / rms before the weight)."""
    return _launch(x, weight, bias, None, False, residual, None, 0.0, norm)


def _launch(x, weight, bias, out_dtype, swiglu, residual, norm_in, eps, norm_out):
    n, k = weight.shape
    assert x.shape[-1] == k, (x.shape, weight.shape)
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    # (rows up to MAX_FOLD_ROWS: the kernel's row offsets are 32-bit)
    assert 1 <= rows <= MAX_FOLD_ROWS and weight.stride(1) == 1 and flat.stride(1) == 1
    assert x.dtype == weight.dtype and (bias is None or (bias.shape == (n,) and bias.is_contiguous()))
    assert not swiglu or n % 2 == 0, n
    out_n = n // 2 if swiglu else n
    if residual is not None:
        residual = residual.reshape(-1, out_n)
        assert residual.shape[0] == rows and residual.dtype == x.dtype and residual.stride(1) == 1, residual.shape
    if norm_in is not None:
        assert norm_in.dim() == 2 and norm_in.shape[0] == rows and norm_in.dtype == torch.float32 \
            and norm_in.is_contiguous(), (norm_in.shape, norm_in.dtype)
    assert norm_out is None or (norm_out.shape == (out_n,) and norm_out.dtype == x.dtype
                                and norm_out.is_contiguous()), norm_out
    y = torch.empty(rows, out_n, dtype=out_dtype or x.dtype, device=x.device)
    if rows <= MAX_ROWS:  # (the best of the probe's tiles at Qwen3-8B's widths)
        block_n = SWIGLU_BLOCK_N if swiglu else 32 if n >= 16384 else 16
        block_m, block_k, warps, stages = MAX_ROWS, BLOCK_K, 2, 4
    else:
        block_m, block_n, block_k, warps, stages = WIDE_TILE
    programs = triton.cdiv(out_n, block_n)
    assert programs <= MAX_COLUMN_BLOCKS, (out_n, block_n)
    weighted = squares = None
    if norm_out is not None:
        weighted = torch.empty(rows, out_n, dtype=x.dtype, device=x.device)
        squares = torch.empty(rows, programs, dtype=torch.float32, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(rows, block_m), programs)](
        flat, weight, flat if bias is None else bias, flat if residual is None else residual, y,
        flat if norm_out is None else norm_out, y if weighted is None else weighted,
        norm_in if norm_in is not None else (y if squares is None else squares), rows, out_n, k, flat.stride(0),
        weight.stride(0), 0 if residual is None else residual.stride(0), y.stride(0),
        0 if norm_in is None else norm_in.shape[1], eps, HAS_BIAS=bias is not None, SWIGLU=swiglu,
        ADD=residual is not None, NORM_OUT=norm_out is not None, NORM_IN=norm_in is not None,
        SQUARES_BLOCK=1 if norm_in is None else triton.next_power_of_2(norm_in.shape[1]),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))),
        num_warps=warps, num_stages=stages, **dependent_launch(
            x.device, "skinny_linear_heavy" if weight.numel() * weight.element_size() >= PDL_HEAVY_BYTES
            else "skinny_linear"))
    shape = (*x.shape[:-1], out_n)
    return y.view(shape), None if norm_out is None else PendingNorm(weighted.view(shape), squares)
