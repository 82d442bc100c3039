"""The residual add + RMSNorm + projection in one kernel: the reference against the model's own
norm-then-linear, the Triton kernel against the reference under Triton's CPU interpreter here (a child
process, as tests/test_paged_attention.py explains) and on CUDA, in a CUDA graph too, in the gpu tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels.norm_linear import (MAX_ROWS, add_rms_norm_linear, add_rms_norm_linear_reference,
                                           add_rms_norm_linear_triton)
from specsplit.shared.layers import RMSNorm
from tests.kernel_checks import captured, run_interpreted

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-5


def inputs(rows: int, hidden: int, n_out: int, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen) * 3
    norm_weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    weight = torch.randn(n_out, hidden, generator=gen) * hidden ** -0.5
    return tuple(t.to(device=device, dtype=dtype) for t in (x, residual, norm_weight, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models_norm_then_linear(dtype):
    x, residual, norm_weight, weight = inputs(5, 48, 20, dtype)
    norm = RMSNorm(48, EPS).to(dtype)
    norm.weight.data.copy_(norm_weight)
    y, new_residual = add_rms_norm_linear_reference(x, residual, norm_weight, EPS, weight)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(y, F.linear(norm(x + residual), weight))


def test_dispatcher_on_cpu_is_the_reference():
    args = inputs(3, 40, 24)
    for got, want in zip(add_rms_norm_linear(*args[:3], EPS, args[3]), add_rms_norm_linear_reference(*args[:3], EPS, args[3])):
        assert torch.equal(got, want)


# (rows, hidden, n_out): hidden not a multiple of the kernel's 64-wide steps, rows and n_out not of its tiles
INTERPRETED = [(1, 96, 40), (5, 100, 24), (16, 64, 70), (33, 130, 20)]


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    for seed, (rows, hidden, n_out) in enumerate(INTERPRETED):
        x, residual, norm_weight, weight = inputs(rows, hidden, n_out, seed=seed)
        y, new_residual = add_rms_norm_linear_triton(x, residual, norm_weight, EPS, weight)
        want_y, want_residual = add_rms_norm_linear_reference(x, residual, norm_weight, EPS, weight)
        assert torch.equal(new_residual, want_residual)
        torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    print("interpreted add_rms_norm_linear ok:", len(INTERPRETED))


def test_triton_interpreted():
    run_interpreted(__file__, "add_rms_norm_linear ok")


SHAPES = {"smollm2_gate_up": (576, 3072), "smollm2_qkv": (576, 960), "qwen3_8b_gate_up": (4096, 24576)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 7, 16, 40, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference_cuda(shape, dtype, rows):
    hidden, n_out = SHAPES[shape]
    x, residual, norm_weight, weight = inputs(rows, hidden, n_out, dtype, "cuda", seed=rows)
    y, new_residual = add_rms_norm_linear_triton(x, residual, norm_weight, EPS, weight)
    want_y, want_residual = add_rms_norm_linear_reference(x, residual, norm_weight, EPS, weight)
    assert torch.equal(new_residual, want_residual)
    # float32: exact (ieee) products, only the order of sums and rsqrt differ. bfloat16: a normalised
    # value may round the other way (one bf16 ulp) where rsqrt differs, then the output's rounding.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), want_y.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@gpu
def test_triton_in_cuda_graph():
    static = inputs(16, 576, 3072, torch.bfloat16, "cuda")
    graph, (y, new_residual) = captured(lambda: add_rms_norm_linear(*static[:3], EPS, static[3]))
    for seed in (1, 2):
        fresh = inputs(16, 576, 3072, torch.bfloat16, "cuda", seed=seed)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        want_y, want_residual = add_rms_norm_linear_reference(*fresh[:3], EPS, fresh[3])
        assert torch.equal(new_residual, want_residual)
        torch.testing.assert_close(y.float(), want_y.float(), atol=3e-2, rtol=3e-2)


if __name__ == "__main__":
    check_triton_interpreted()
