"""The few-rows projection kernel (kernels/skinny_linear.py) against F.linear: under Triton's CPU interpreter
here (a child process, see tests/kernel_checks.py), on CUDA at Qwen3-8B's widths and inside a CUDA graph in
the gpu tests; and which calls `linear` sends to it."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels import skinny_linear
from specsplit.kernels.skinny_linear import MAX_ROWS, linear, linear_reference, linear_triton, takes_kernel
from tests.kernel_checks import captured, run_interpreted

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def operands(rows: int, k: int, n: int, bias: bool, seed: int, device: str = "cpu", dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    return x, w, b


def assert_matches(x, w, b) -> None:
    """Float32 output within float32-accumulation error of the exact product; the 16-bit output is that
    float32 result rounded once."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = linear_triton(x, w, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    err = (got.double() - exact).abs().max().item()
    assert err <= 2e-5 * math.sqrt(x.shape[-1]), err
    rounded = linear_triton(x, w, b)
    assert rounded.dtype == x.dtype and torch.equal(rounded, got.to(x.dtype))


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does). Float16:
    the interpreter computes with numpy, which has no bfloat16 (its bf16 loads read garbage)."""
    for rows, k, n, bias, seed in ((1, 300, 40, False, 0), (MAX_ROWS, 520, 33, True, 1), (5, 64, 16, False, 2),
                                   (1, 520, 33, True, 3)):
        assert_matches(*operands(rows, k, n, bias, seed, dtype=torch.float16))
    print("interpreted skinny linear ok")


def test_triton_interpreted():
    run_interpreted(__file__, "skinny linear ok")


def test_a_broken_kernel_fails_the_check(monkeypatch):
    """The check catches a kernel that drops the last partial K tile (a bound off by one tile)."""
    x, w, b = operands(3, 300, 40, False, 3)

    def short_k(x_, w_, b_=None, out_dtype=None):
        cut = (x_.shape[-1] // 256) * 256
        return F.linear(x_[..., :cut].float(), w_[:, :cut].float()).to(out_dtype or x_.dtype)

    monkeypatch.setattr(sys.modules[__name__], "linear_triton", short_k)
    with pytest.raises(AssertionError):
        assert_matches(x, w, b)


def test_which_calls_take_the_kernel(monkeypatch):
    x, w, _ = operands(4, 64, 32, False, 4)
    assert not takes_kernel(x, w), "a CPU tensor never does"
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert torch.equal(linear_reference(x, w, out_dtype=torch.float32), F.linear(x, w).float())
    monkeypatch.setattr(skinny_linear, "HAVE_TRITON", True)

    class Cuda:  # what takes_kernel reads of a tensor, on a pretend device
        def __init__(self, shape, dtype=torch.bfloat16, grad=False, itemsize=2, contiguous=True, last_stride=1):
            self.shape, self.dtype, self.is_cuda, self.requires_grad = torch.Size(shape), dtype, True, grad
            self._itemsize, self._contiguous, self._last_stride = itemsize, contiguous, last_stride

        def numel(self):
            return math.prod(self.shape)

        def dim(self):
            return len(self.shape)

        def stride(self, dim):
            return self._last_stride if dim in (-1, len(self.shape) - 1) else self.shape[-1]

        def is_contiguous(self):
            return self._contiguous

        def element_size(self):
            return self._itemsize

    big = Cuda((6144, 4096))  # 48 MiB
    small = Cuda((960, 576))  # SmolLM2's qkv, 1.1 MiB: cuBLAS
    narrow = Cuda((49152, 576))  # SmolLM2's head, 57 MB but K = 576: cuBLAS
    with torch.no_grad():
        assert takes_kernel(Cuda((1, 4096)), big) and takes_kernel(Cuda((2, 8, 4096)), big)
        assert not takes_kernel(Cuda((MAX_ROWS + 1, 4096)), big), "more rows than a tile"
        assert not takes_kernel(Cuda((1, 576)), small), "a weight below MIN_WEIGHT_BYTES"
        assert not takes_kernel(Cuda((1, 576)), narrow), "K below MIN_K"
        assert takes_kernel(Cuda((16, 12288)), Cuda((4096, 12288))), "Qwen3-8B's down projection"
        assert not takes_kernel(Cuda((1, 4096), torch.float32, itemsize=4), Cuda((6144, 4096), torch.float32,
                                                                                   itemsize=4)), "float32"
        assert not takes_kernel(Cuda((0, 4096)), big), "no rows"
        assert takes_kernel(Cuda((1, 4096)), big, Cuda((6144,))), "a bias of the weight's rows"
        assert not takes_kernel(Cuda((1, 4096)), big, Cuda((6145,))), "a bias of another length"
        assert not takes_kernel(Cuda((1, 4096)), big, Cuda((6144,), torch.float32, itemsize=4)), "a float32 bias"
        assert not takes_kernel(Cuda((1, 4096)), big, Cuda((6144,), contiguous=False)), "a strided bias"
        assert not takes_kernel(Cuda((1, 4096), last_stride=2), big), "x's columns strided"
    assert not takes_kernel(Cuda((1, 4096), grad=True), big), "under autograd: F.linear's backward"
    assert not takes_kernel(Cuda((1, 4096)), big, Cuda((6144,), grad=True)), "a bias that wants its gradient"
    monkeypatch.setattr(skinny_linear, "MIN_WEIGHT_BYTES", math.inf)
    with torch.no_grad():
        assert not takes_kernel(Cuda((1, 4096)), big), "benches turn it off this way"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936),
                                 (1000, 777)])
@pytest.mark.parametrize("rows", [1, 8, MAX_ROWS])
def test_triton_matches_torch_cuda(k, n, rows):
    x, w, b = operands(rows, k, n, n == 6144, 5, "cuda")
    assert_matches(x, w, b)
    torch.testing.assert_close(linear_triton(x, w, b), linear_reference(x, w, b), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
def test_the_layouts_it_takes_cuda():
    """Rows further apart than K (a slice of wider rows) and a 3-D x, through `linear`, equal the kernel on
    a contiguous copy; x with strided columns goes to F.linear."""
    wide, w, b = operands(4, 8192, 6144, True, 13, "cuda")
    x = wide[:, :4096]
    w = w[:, :4096].contiguous()
    with torch.no_grad():
        assert x.stride(0) == 8192 and takes_kernel(x, w, b)
        assert torch.equal(linear(x, w, b), linear_triton(x.contiguous(), w, b))
        cube = x.contiguous().view(2, 2, 4096)
        assert torch.equal(linear(cube, w, b), linear_triton(x.contiguous(), w, b).view(2, 2, 6144))
        strided = wide[:, ::2]
        assert not takes_kernel(strided, w, b)
        assert torch.equal(linear(strided, w, b), F.linear(strided, w, b))


@pytest.mark.gpu
@gpu
def test_triton_in_cuda_graph_and_dispatch():
    x, w, b = operands(4, 4096, 6144, True, 6, "cuda")
    with torch.no_grad():
        assert takes_kernel(x, w)
        graph, out = captured(lambda: linear(x, w, b))
        for seed in (7, 8):
            x.copy_(operands(4, 4096, 6144, True, seed, "cuda")[0])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, linear_triton(x, w, b))


if __name__ == "__main__":
    check_triton_interpreted()
