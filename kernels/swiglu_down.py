"""A SwiGLU MLP's second half in one kernel: down_proj(silu(gate) * up), from the fused gate/up GEMM's
output. Torch reference, Triton kernel, dispatcher.

At decode and verify sizes (a few to 64 rows) the down projection is a latency-bound GEMM: on the H200,
with its weights read from HBM as in a real step, cuBLAS took 5.1 µs where this kernel's tiles take
4.1-4.2 (`bench/gemm_probe.py --cold-copies`), and the activation's own launch (~1.2 µs) goes too: the
kernel computes silu(gate) * up for each tile of K as it loads it. Rounded as the unfused path rounds
(silu to the dtype, the product to the dtype, fp32 accumulation, the output to the dtype), so it
differs from it only in the order of the sum. Rows past MAX_ROWS take the reference (cuBLAS then wins).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, tl, triton
from .activation import silu_mul, silu_mul_reference

MAX_ROWS = 64  # the kernel's tiles were measured up to here


def swiglu_down_reference(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] (gate = the first F columns), weight [N, F] -> [T, N]."""
    return F.linear(silu_mul_reference(gate_up), weight)


def swiglu_down(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on CUDA for up to MAX_ROWS rows without a bias; silu_mul then the GEMM otherwise."""
    if (HAVE_TRITON and gate_up.is_cuda and bias is None and gate_up.dim() == 2 and gate_up.shape[0] <= MAX_ROWS
            and gate_up.dtype == weight.dtype):
        return swiglu_down_triton(gate_up, weight)
    return F.linear(silu_mul(gate_up), weight, bias)


@triton.jit
def _swiglu_down_kernel(gate_up_ptr, w_ptr, out_ptr, rows, n_out, ffn, stride_g, stride_w, stride_o,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Program (j, i) writes out[i*BLOCK_M.., j*BLOCK_N..], walking the FFN dimension in BLOCK_K steps."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, ffn, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_rows = (rm[:, None] < rows) & (rk[None, :] < ffn)
        at = gate_up_ptr + rm[:, None].to(tl.int64) * stride_g + rk[None, :]
        gate = tl.load(at, mask=in_rows, other=0.0).to(tl.float32)
        up = tl.load(at + ffn, mask=in_rows, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # as kernels.activation rounds
        act = (silu * up).to(dtype)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :],
                    mask=(rn[:, None] < n_out) & (rk[None, :] < ffn), other=0.0)
        acc += tl.dot(act, tl.trans(w), input_precision=DOT_PRECISION)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_o + rn[None, :], acc.to(dtype),
             mask=(rm[:, None] < rows) & (rn[None, :] < n_out))


def swiglu_down_triton(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    assert HAVE_TRITON, "triton is not installed"
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1, (gate_up.shape, gate_up.stride())
    rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    assert weight.dim() == 2 and weight.shape[1] == ffn and weight.stride(1) == 1, (weight.shape, ffn)
    assert weight.dtype == gate_up.dtype and gate_up.dtype in (torch.float32, torch.bfloat16, torch.float16)
    n_out = weight.shape[0]
    out = torch.empty((rows, n_out), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    # The tiles bench/gemm_probe.py found fastest on the H200 for SmolLM2's down projection
    block_m, block_n, block_k = 16, 16 if rows <= 16 else 32, 256
    grid = (triton.cdiv(n_out, block_n), triton.cdiv(rows, block_m))
    _swiglu_down_kernel[grid](gate_up, weight, out, rows, n_out, ffn, gate_up.stride(0), weight.stride(0),
                              out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                              DOT_PRECISION="ieee" if gate_up.dtype == torch.float32 else "tf32",
                              num_warps=2, num_stages=4)
    return out
