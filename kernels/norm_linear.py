"""The residual add, the RMSNorm and the projection after it in one kernel: a decoder layer's
post-attention norm feeding its gate/up GEMM. Torch reference, Triton kernel, dispatcher.

At decode and verify sizes (a few to 64 rows) the GEMM is latency-bound (~4 µs on the H200 with its
weights read from HBM, Triton's tiles as fast as cuBLAS's there: `bench/gemm_probe.py --cold-copies`),
so the norm's own launch (~1.5 µs) is what fusing saves. Each program computes its rows' sum of
squares over the hidden size first, then normalises each tile of K as it feeds the dot: the rows are
read twice, from L2, the weights once. Rounded as `kernels.norm.add_rms_norm` then the GEMM round
(the sum to the dtype, the normalised row to the dtype before the weight, fp32 accumulation), so it
differs from them only in the order of sums and in rsqrt. Rows past MAX_ROWS take the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, tl, triton
from .norm import add_rms_norm, add_rms_norm_reference

MAX_ROWS = 64


def add_rms_norm_linear_reference(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(x + residual), weight), x + residual); x, residual [T, hidden], weight [N, hidden]."""
    normed, new_residual = add_rms_norm_reference(x, residual, norm_weight, eps)
    return F.linear(normed, weight), new_residual


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA for up to MAX_ROWS rows; the norm's kernel then the GEMM otherwise."""
    if (HAVE_TRITON and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and x.dtype == residual.dtype == norm_weight.dtype == weight.dtype):
        return add_rms_norm_linear_triton(x, residual, norm_weight, eps, weight)
    normed, new_residual = add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(normed, weight), new_residual


@triton.jit
def _add_rms_norm_linear_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, y_ptr, new_res_ptr, rows, n_out, hidden, eps,
                                stride_x, stride_r, stride_w, stride_y,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                DOT_PRECISION: tl.constexpr):
    """Program (j, i): rows i*BLOCK_M.. of y's columns j*BLOCK_N..; the programs of column block 0 also
    write the rows' new residual (contiguous [rows, hidden])."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm[:, None] < rows
    row64 = rm[:, None].to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok & (rk[None, :] < hidden)
        s = (tl.load(x_ptr + row64 * stride_x + rk[None, :], mask=ok, other=0.0).to(tl.float32)
             + tl.load(res_ptr + row64 * stride_r + rk[None, :], mask=ok, other=0.0).to(tl.float32))
        s = s.to(dtype).to(tl.float32)  # the sum is rounded to the model dtype, as `x + residual` is
        squares += tl.sum(s * s, axis=1)
    rstd = tl.math.rsqrt(squares / hidden + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok & (rk[None, :] < hidden)
        s = (tl.load(x_ptr + row64 * stride_x + rk[None, :], mask=ok, other=0.0).to(tl.float32)
             + tl.load(res_ptr + row64 * stride_r + rk[None, :], mask=ok, other=0.0).to(tl.float32)).to(dtype)
        if pid_n == 0:
            tl.store(new_res_ptr + row64 * hidden + rk[None, :], s, mask=ok)
        h = (s.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)  # rounded before the weight
        gain = tl.load(norm_w_ptr + rk, mask=rk < hidden, other=0.0).to(tl.float32)
        a = (gain[None, :] * h).to(dtype)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :],
                    mask=(rn[:, None] < n_out) & (rk[None, :] < hidden), other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    tl.store(y_ptr + row64 * stride_y + rn[None, :], acc.to(dtype), mask=row_ok & (rn[None, :] < n_out))


def add_rms_norm_linear_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert HAVE_TRITON, "triton is not installed"
    assert x.dim() == 2 and x.shape == residual.shape and x.stride(1) == 1 and residual.stride(1) == 1, \
        (x.shape, residual.shape)
    rows, hidden = x.shape
    assert norm_weight.shape == (hidden,) and norm_weight.is_contiguous()
    assert weight.dim() == 2 and weight.shape[1] == hidden and weight.stride(1) == 1, (weight.shape, hidden)
    assert x.dtype == residual.dtype == norm_weight.dtype == weight.dtype
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    n_out = weight.shape[0]
    y = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    new_residual = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y, new_residual
    # The tile bench/gemm_probe.py found fastest on the H200 for SmolLM2's gate/up projection
    block_m, block_n, block_k = 16, 32, 64
    grid = (triton.cdiv(n_out, block_n), triton.cdiv(rows, block_m))
    _add_rms_norm_linear_kernel[grid](x, residual, norm_weight, weight, y, new_residual, rows, n_out, hidden, eps,
                                      x.stride(0), residual.stride(0), weight.stride(0), y.stride(0),
                                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                      DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                      num_warps=2, num_stages=4)
    return y, new_residual
