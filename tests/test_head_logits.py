"""The LM head (`shared.layers.head_logits`): float32 logits from one GEMM on CUDA with 16-bit weights, F.linear
elsewhere; the target's and the drafter's logits paths all go through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.shared.layers import head_logits

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_on_the_cpu_it_is_f_linear_in_float32_whatever_the_leading_shape():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen)
    for shape in ((3, 8), (2, 5, 8), (8,)):
        x = torch.randn(*shape, generator=gen)
        got = head_logits(x, weight)
        assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 50)
        assert torch.equal(got, F.linear(x, weight).float())
    bf = head_logits(torch.randn(4, 8, generator=gen).bfloat16(), weight.bfloat16())
    assert bf.dtype == torch.float32


def test_every_logits_path_goes_through_it():
    """The target's eager and captured forwards, the dense decoder and the drafter: one numerics for all (a
    path left on F.linear(...).float() would round its logits to 16 bits where the others do not, and
    greedy picks at near-ties would part between decoding and verifying)."""
    import inspect

    from specsplit.drafter_service import dflash
    from specsplit.target_service import dense, graphs, model

    for module in (model, graphs, dense, dflash):
        source = inspect.getsource(module)
        assert "head_logits(" in source, module.__name__
        assert "lm_head(" not in source.replace("head_logits(", ""), module.__name__


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 128])
def test_on_cuda_the_logits_keep_the_accumulators_precision(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    weight = (torch.randn(49_152, 576, generator=gen, device="cuda") * 0.05).bfloat16()
    x = torch.randn(rows, 576, generator=gen, device="cuda").bfloat16()
    exact = x.double() @ weight.double().t()
    got = head_logits(x, weight)
    rounded = F.linear(x, weight).float()  # what the head gave before: the accumulator rounded to bf16
    assert got.dtype == torch.float32 and got.shape == (rows, 49_152)
    assert (got.double() - exact).abs().max() < (rounded.double() - exact).abs().max() / 4
    # inside a CUDA graph, as the step's forwards run it
    static = torch.zeros_like(x).copy_(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head_logits(static, weight)
    static.copy_(x.flip(0))
    graph.replay()
    torch.testing.assert_close(out, head_logits(x.flip(0), weight), rtol=0, atol=0)


@gpu
@pytest.mark.gpu
def test_under_autograd_it_differentiates():
    weight = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)
    head_logits(x, weight).sum().backward()
    assert weight.grad is not None and weight.grad.shape == weight.shape
