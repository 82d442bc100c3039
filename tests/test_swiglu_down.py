"""down_proj(silu(gate) * up) in one kernel: the reference against the model's MLP, the Triton kernel
against the reference under Triton's CPU interpreter here (a child process, as tests/test_paged_attention.py
explains) and on CUDA, in a CUDA graph too, in the gpu tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels.swiglu_down import MAX_ROWS, swiglu_down, swiglu_down_reference, swiglu_down_triton
from tests.kernel_checks import captured, run_interpreted

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def mlp_inputs(rows: int, ffn: int, n_out: int, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * ffn, generator=gen) * 2
    weight = torch.randn(n_out, ffn, generator=gen) * ffn ** -0.5
    return gate_up.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models_mlp(dtype):
    """The model's MLP, silu(gate_proj(x)) * up_proj(x) then down_proj, with gate then up in the fused
    projection's columns (the order shared.fused concatenates them in)."""
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(5, 40, generator=gen).to(dtype) for _ in range(2))
    down_w = (torch.randn(24, 40, generator=gen) * 0.2).to(dtype)
    model = F.linear(F.silu(gate) * up, down_w)
    assert torch.equal(swiglu_down_reference(torch.cat([gate, up], 1), down_w), model)
    assert not torch.equal(swiglu_down_reference(torch.cat([up, gate], 1), down_w), model)


def test_dispatcher_on_cpu_is_the_reference_and_keeps_a_bias():
    gate_up, weight = mlp_inputs(3, 48, 20)
    bias = torch.randn(20)
    assert torch.equal(swiglu_down(gate_up, weight), swiglu_down_reference(gate_up, weight))
    assert torch.equal(swiglu_down(gate_up, weight, bias), swiglu_down_reference(gate_up, weight) + bias)


# (rows, ffn, n_out): ffn not a multiple of the kernel's 256-wide steps, rows and n_out not of its tiles
INTERPRETED = [(1, 96, 40), (5, 300, 24), (16, 64, 48), (33, 260, 20)]


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    for seed, (rows, ffn, n_out) in enumerate(INTERPRETED):
        gate_up, weight = mlp_inputs(rows, ffn, n_out, seed=seed)
        torch.testing.assert_close(swiglu_down_triton(gate_up, weight), swiglu_down_reference(gate_up, weight),
                                   atol=1e-5, rtol=1e-5)
    print("interpreted swiglu_down ok:", len(INTERPRETED))


def test_triton_interpreted():
    run_interpreted(__file__, "swiglu_down ok")


SHAPES = {"smollm2": (1536, 576), "qwen3_8b": (12288, 4096)}  # (ffn, hidden)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 7, 16, 40, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference_cuda(shape, dtype, rows):
    ffn, hidden = SHAPES[shape]
    gate_up, weight = mlp_inputs(rows, ffn, hidden, dtype, "cuda", seed=rows)
    got, want = swiglu_down_triton(gate_up, weight), swiglu_down_reference(gate_up, weight)
    # float32: exact (ieee) products, only the order of the sum differs. bfloat16: both round the
    # activation alike; the output's rounding (2^-9) and the sum's order remain.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@gpu
def test_triton_in_cuda_graph():
    static_gate_up, weight = mlp_inputs(16, 1536, 576, torch.bfloat16, "cuda")
    graph, out = captured(lambda: swiglu_down(static_gate_up, weight))
    for seed in (1, 2):
        fresh, _ = mlp_inputs(16, 1536, 576, torch.bfloat16, "cuda", seed=seed)
        static_gate_up.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(out.float(), swiglu_down_reference(fresh, weight).float(), atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    check_triton_interpreted()
