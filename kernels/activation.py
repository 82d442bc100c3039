"""SwiGLU's activation on a fused gate/up projection, silu(gate) * up: torch reference, Triton kernel, dispatcher."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton

BLOCK = 1024  # columns per program


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] (gate = the first F columns, up = the last F) -> [T, F], in its dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda and HAVE_TRITON:
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    assert HAVE_TRITON, "triton is not installed"
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1, \
        (gate_up.shape, gate_up.stride())
    tokens, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, ffn), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(tokens, triton.cdiv(ffn, BLOCK))](gate_up, gate_up.stride(0), out, ffn, BLOCK=BLOCK,
                                                        **dependent_launch(gate_up.device, "silu_mul"))
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, stride, out_ptr, ffn, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """Program (t, j) writes columns j*BLOCK.. of row t; out is contiguous [T, F]."""
    gdc_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ffn
    gate = tl.load(gate_up_ptr + t * stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride + ffn + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu's output is rounded before the product
    tl.store(out_ptr + t * ffn + cols, (silu * up).to(dtype), mask=mask)
