"""Linear layers of a decode/verify step's few rows, with the elementwise work around them fused in.

At one to sixteen rows a projection reads its weights once and does almost no arithmetic, so each
cuBLAS call costs its fixed latency (3.7-3.9 µs on the H200 for every GEMM of the default model,
whatever its bytes), and the RMSNorm before it, the SiLU·mul after gate/up and the residual add after
o/down are launches of their own. One kernel here does

    out = [silu_mul](rms_norm?(x) @ weight.T) [+ residual]

for every row at once: each program owns a slice of output columns, normalises the (few, short) input
rows itself from their sum of squares, and streams its slice of the weight once. The math and its
roundings are the references' (`norm.rms_norm_reference`, `activation.silu_mul_reference`, the layer's
`x + residual`); only the order of the GEMM's sums differs from torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, tl, triton
from .activation import silu_mul_reference
from .norm import rms_norm_reference

MAX_ROWS = 16  # rows of one step this kernel takes (tl.dot's smallest tile); wider steps use cuBLAS
BLOCK_K = 64


def small_linear_reference(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                           eps: float = 0.0, gated: bool = False,
                           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K] ([2F, K] gate rows then up rows when `gated`): x, RMS-normed with
    `norm_weight` first when given, times weight.T; silu(gate) * up when `gated` ([M, F]); plus
    `residual` [M, N] when given (the sum in x's dtype)."""
    h = x if norm_weight is None else rms_norm_reference(x, norm_weight, eps)
    y = F.linear(h, weight)
    if gated:
        y = silu_mul_reference(y)
    return y if residual is None else y + residual


def small_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`small_linear_reference`, as one kernel on CUDA for at most MAX_ROWS rows."""
    if x.is_cuda and HAVE_TRITON and x.shape[0] <= MAX_ROWS:
        return small_linear_triton(x, weight, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)
    return small_linear_reference(x, weight, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)


def _block_n(columns: int) -> int:
    """Output columns per program: enough programs to keep the GPU's SMs reading (the weight is the
    only real traffic), 16 at least (tl.dot's smallest tile)."""
    return 32 if columns >= 4096 else 16


def small_linear_triton(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                        eps: float = 0.0, gated: bool = False,
                        residual: torch.Tensor | None = None) -> torch.Tensor:
    assert HAVE_TRITON, "triton is not installed"
    rows, k = x.shape
    assert 0 < rows <= MAX_ROWS and x.stride(1) == 1, (x.shape, x.stride())
    assert weight.dim() == 2 and weight.shape[1] == k and weight.stride(1) == 1 and weight.dtype == x.dtype
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert not gated or weight.shape[0] % 2 == 0, weight.shape
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    if residual is not None:
        assert residual.shape == (rows, n) and residual.stride(1) == 1 and residual.dtype == x.dtype
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n = _block_n(n)
    _small_linear_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), norm_weight if norm_weight is not None else x,
        residual if residual is not None else out, residual.stride(0) if residual is not None else 0,
        out, rows, n, k, eps,
        NORM=norm_weight is not None, GATED=gated, RESIDUAL=residual is not None,
        IEEE=x.dtype == torch.float32, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=4)
    return out


@triton.jit
def _small_linear_kernel(x_ptr, x_stride, w_ptr, w_stride, nw_ptr, res_ptr, res_stride, out_ptr, rows, n, k, eps,
                         NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program j writes output columns j*BLOCK_N.. of every row; out is contiguous [rows, n]. Gated: the
    weight's rows n.. are the up projection."""
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < rows, rn < n
    if NORM:  # each row's inverse RMS, from its sum of squares in float32 (the rows are short: read twice)
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + rk
            xs = tl.load(x_ptr + rm[:, None] * x_stride + cols[None, :], mask=m_mask[:, None] & (cols < k)[None, :],
                         other=0.0).to(tl.float32)
            squares += tl.sum(xs * xs, axis=1)
        inv_rms = tl.math.rsqrt(squares / k + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + rk
        k_mask = cols < k
        xs = tl.load(x_ptr + rm[:, None] * x_stride + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:  # normalised, rounded to the model dtype, then scaled by the weight in it (the reference's order)
            h = (xs.to(tl.float32) * inv_rms[:, None]).to(dtype).to(tl.float32)
            g = tl.load(nw_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
            xs = (h * g[None, :]).to(dtype)
        w = tl.load(w_ptr + rn[None, :] * w_stride + cols[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(xs, w, input_precision="ieee")
        else:
            acc += tl.dot(xs, w)
        if GATED:
            up = tl.load(w_ptr + (n + rn)[None, :] * w_stride + cols[:, None], mask=n_mask[None, :] & k_mask[:, None],
                         other=0.0)
            if IEEE:
                acc_up += tl.dot(xs, up, input_precision="ieee")
            else:
                acc_up += tl.dot(xs, up)
    y = acc.to(dtype).to(tl.float32)  # the projection's output, rounded as torch's GEMM rounds it
    if GATED:  # silu(gate) rounded before the product, as F.silu(gate) * up
        silu = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)
        y = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    mask = m_mask[:, None] & n_mask[None, :]
    if RESIDUAL:  # the layer's `x + residual`, rounded once
        y = y + tl.load(res_ptr + rm[:, None] * res_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm[:, None] * n + rn[None, :], y.to(dtype), mask=mask)
