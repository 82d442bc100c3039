"""RMSNorm and the fused residual add + RMSNorm of a decoder layer: torch reference, Triton kernel, dispatcher.

The math is the model's (HF Llama/Qwen3): normalise in float32, round to the input dtype, THEN scale by
the weight in that dtype. The kernel keeps both roundings, so it differs from the reference only in the
order of the sum of squares and in rsqrt.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton

MAX_HIDDEN = 8192  # one program holds a whole row in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum in x's dtype."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] (e.g. [T, hidden], or [T, H, D] for per-head q/k norms); weight [hidden]."""
    if x.is_cuda and HAVE_TRITON:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) as `add_rms_norm_reference`; new tensors, the inputs are left as they are."""
    if x.is_cuda and HAVE_TRITON:
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 3 and x.stride(-1) == 1 and x.shape[1] > 1:
        # [T, H, D] heads of a wider tensor (q or k columns of a fused qkv projection): read in place,
        # each row found from its token and head, with no copy into [T * H, D] first
        _check_weight(x, weight)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch(x, x, weight, out, out, eps, add=False, heads=(x.shape[1], x.stride(1)),
                rows=x.shape[0] * x.shape[1], hidden=x.shape[2])
        return out
    rows = _rows(x, weight)
    out = _empty(rows)
    _launch(rows, rows, weight, out, out, eps, add=False)
    return out.view(x.shape)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
    rows, res_rows = _rows(x, weight), _rows(residual, weight)
    out, new_residual = _empty(rows), _empty(rows)
    _launch(rows, res_rows, weight, out, new_residual, eps, add=True)
    return out.view(x.shape), new_residual.view(x.shape)


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous(), weight.shape
    assert weight.dtype == x.dtype, f"weight {weight.dtype} vs x {x.dtype}: the model keeps one dtype"
    assert hidden <= MAX_HIDDEN, hidden


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] with unit stride along hidden (a view when x allows it, else one copy)."""
    _check_weight(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _empty(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)  # contiguous, as the kernel writes


def _launch(x, residual, weight, out, new_residual, eps: float, add: bool, heads: tuple[int, int] = (1, 0),
            rows: int | None = None, hidden: int | None = None) -> None:
    """x [rows, hidden] (row stride x.stride(0)), or with `heads` = (H, head stride) the rows of
    x [T, H, hidden]: row r is token r // H's head r % H (token stride x.stride(0))."""
    assert HAVE_TRITON, "triton is not installed"
    hidden = x.shape[1] if hidden is None else hidden
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x.shape[0] if rows is None else rows,)](
        x, x.stride(0), heads[0], heads[1], residual, residual.stride(0), weight, out, new_residual, hidden, eps,
        ADD=add, BLOCK=block, num_warps=min(max(block // 512, 1), 16), **dependent_launch(x.device, "rms_norm"))


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, heads, head_stride, res_ptr, res_stride, w_ptr, out_ptr, new_res_ptr,
                     hidden, eps, ADD: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """One program per row; out and new_res are contiguous [rows, hidden]. Row r of x starts at
    (r // heads) * x_stride + (r % heads) * head_stride (heads = 1: r * x_stride)."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + (row // heads) * x_stride + (row % heads) * head_stride + cols, mask=mask,
                other=0.0).to(tl.float32)
    if ADD:  # the sum is rounded to the model dtype, as `x + residual` is
        x = (x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(new_res_ptr + row * hidden + cols, x, mask=mask)
        x = x.to(tl.float32)
    h = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    h = h.to(dtype).to(tl.float32)  # rounded to the model dtype before the weight, as in the reference
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (w * h).to(dtype), mask=mask)
