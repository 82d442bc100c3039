"""The few-rows projection kernel (kernels/skinny_linear.py) against F.linear: under Triton's CPU interpreter
here (a child process, see tests/kernel_checks.py), on CUDA at Qwen3-8B's widths and inside a CUDA graph in
the gpu tests; and which calls `linear` sends to it. Also what it folds in (a norm on the way in, SiLU·mul
and a residual on the way out) against its reference, alone and in whole fused layers (shared/fused.py)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels import skinny_linear
from specsplit.shared import fused
from specsplit.shared.config import ModelConfig
from specsplit.shared.layers import DecoderLayer
from specsplit.kernels.norm import rms_norm_reference
from specsplit.kernels.skinny_linear import (MAX_FOLD_ROWS, MAX_ROWS, linear, linear_reference, linear_triton,
                                             linear_triton_norm_out, takes_kernel)
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


def fold_operands(rows: int, k: int, n: int, bias: bool, seed: int, device: str = "cpu", dtype=torch.bfloat16):
    """x (at an RMS of ~3, so that a norm left out shows), weight [n, k] and bias as `operands`; residuals of
    n and n / 2 columns; a norm's weight over n (not ones, so that it shows too); and a next weight [48, n]."""
    x, w, b = operands(rows, k, n, bias, seed, device, dtype)
    gen = torch.Generator().manual_seed(seed + 100)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)

    return (3 * x, w, b, rand(rows, n), rand(rows, n // 2), (1 + 0.3 * torch.randn(n, generator=gen)).to(
        device=device, dtype=dtype), rand(48, n, scale=n ** -0.5))


def assert_close_enough(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within a few roundings of the output dtype (a folded norm rounds elsewhere, by design)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 0.02 * max(1.0, want.abs().max().item()), (what, err)


def assert_folds_match(x, w, b, residual, half_residual, norm, w2, eps: float = 1e-6) -> None:
    """What the kernel folds in against `linear_reference` (in float32): SiLU·mul and a residual on the way
    out, and a norm handed from one projection (its output y) to the next (linear_triton_norm_out)."""
    def ref(x_, w_, b_=None, **kwargs):
        kwargs = {key: value.float() if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
        return linear_reference(x_.float(), w_.float(), None if b_ is None else b_.float(), **kwargs)

    for swiglu, res in ((False, residual), (True, half_residual)):
        got = linear_triton(x, w, b, swiglu=swiglu, residual=res)
        assert got.dtype == x.dtype
        assert_close_enough(got, ref(x, w, b, swiglu=swiglu, residual=res), f"swiglu {swiglu} and residual")
    y, pending = linear_triton_norm_out(x, w, b, residual=residual, norm=norm)
    assert torch.equal(y, linear_triton(x, w, b, residual=residual)), "the output is the plain kernel's"
    for swiglu in (False, True):
        got = linear_triton(pending.weighted, w2, swiglu=swiglu, norm_in=pending.squares, eps=eps)
        assert_close_enough(got, ref(y, w2, norm=norm, eps=eps, swiglu=swiglu), f"norm handed on, swiglu {swiglu}")


def fold_config(model_type: str = "qwen3") -> ModelConfig:
    return ModelConfig(model_type=model_type, vocab_size=64, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       qk_norm=model_type == "qwen3", attention_bias=model_type == "qwen3")


def random_layers(cfg: ModelConfig, device: str, dtype) -> list[DecoderLayer]:
    torch.manual_seed(11)
    layers = [DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
    for layer in layers:
        for name, param in layer.named_parameters():
            if "norm" in name:  # not ones: a norm's weight left out must show
                param.data = 1 + 0.3 * torch.randn_like(param)
    return [layer.to(device=device, dtype=dtype) for layer in layers]


def fused_outputs(cfg: ModelConfig, layers, x: torch.Tensor, final_norm: torch.Tensor):
    """run_fused_layers over x with a stand-in attention (each query plus its group's value)."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def attend(i, q, k, v, norms=None):
        if norms is not None:  # (kernels.rope.QK_NORM_IN_ROPE: q and k handed over unnormed, with their norms)
            q = rms_norm_reference(q, norms[0], cfg.rms_norm_eps)
        return q * 0.5 + v.repeat_interleave(group, dim=1) + 0.1 * i

    weights = fused.fuse_projections(torch.nn.Module(), layers)
    with torch.no_grad():
        return fused.run_fused_layers(cfg, layers, weights, x, attend, final_norm, keep=(0, 1))


def assert_fused_layers_fold(device: str, dtype, cfg: ModelConfig, layers, rows: int) -> None:
    """The layers with every projection folding equal them unfolded, up to rounding: with the norms handed
    on between projections, and with the norms' own launches."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(rows, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    final_norm = (1 + 0.3 * torch.randn(cfg.hidden_size, generator=gen)).to(device=device, dtype=dtype)
    fused.FOLD = False
    try:
        want = fused_outputs(cfg, layers, x, final_norm)
    finally:
        fused.FOLD = True
    with torch.no_grad():
        assert all(fused.folds_into_projections(x, layer, w) for layer, w in
                   zip(layers, fused.fuse_projections(torch.nn.Module(), layers)))
    for fold_norms in (True, False):
        fused.FOLD_NORMS = fold_norms
        try:
            got = fused_outputs(cfg, layers, x, final_norm)
        finally:
            fused.FOLD_NORMS = True
        for g, w in ((got[0], want[0]), (got[1], want[1]), *((got[2][i], want[2][i]) for i in (0, 1))):
            scale = w.float().abs().max().item()
            assert (g.float() - w.float()).abs().max().item() <= 0.03 * scale, (fold_norms, (g - w).abs().max())
        assert sorted(got[2]) == [0, 1]


def check_fused_layers_interpreted() -> None:
    """Whole fused layers, every projection folding (takes_kernel forced: the interpreter runs on the CPU),
    against the same layers unfolded (F.linear and the norms' references), Llama's and Qwen3's."""
    fused.takes_kernel = lambda x, weight, bias=None, bounded=True: True
    fused.HANDED_NORM_DTYPES = (torch.float16,)  # the interpreter has no bfloat16; these values stay in range
    for model_type in ("llama", "qwen3"):
        cfg = fold_config(model_type)
        layers = random_layers(cfg, "cpu", torch.float16)
        for rows in (3, WIDE + 3):
            assert_fused_layers_fold("cpu", torch.float16, cfg, layers, rows)


WIDE = skinny_linear.WIDE_TILE[0]


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does). Float16:
    the interpreter computes with numpy, which has no bfloat16 (its bf16 loads read garbage)."""
    for rows, k, n, bias, seed in ((1, 300, 40, False, 0), (MAX_ROWS, 520, 33, True, 1), (5, 64, 16, False, 2),
                                   (1, 520, 33, True, 3), (MAX_FOLD_ROWS - 3, 300, 40, True, 4)):
        assert_matches(*operands(rows, k, n, bias, seed, dtype=torch.float16))
    for rows, k, n, bias, seed in ((1, 300, 40, False, 0), (MAX_ROWS, 520, 34, True, 1), (5, 64, 32, True, 2),
                                   (MAX_FOLD_ROWS - 3, 300, 34, True, 3)):  # (row tiles side by side, one partial)
        assert_folds_match(*fold_operands(rows, k, n, bias, seed, dtype=torch.float16))
    check_fused_layers_interpreted()
    print("interpreted skinny linear ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
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


def stand_in_kernels(forgets: str = "nothing"):
    """linear_triton and linear_triton_norm_out built from the reference, forgetting one thing (or nothing)."""
    def plain(x, w, b=None, out_dtype=None, *, swiglu=False, residual=None, norm_in=None, eps=0.0):
        if norm_in is not None and forgets != "rms":  # 1/rms scales the sums: x, before bias and SiLU·mul
            x = (x.float() * torch.rsqrt(norm_in.sum(-1, keepdim=True) / x.shape[-1] + eps)).to(x.dtype)
        return linear_reference(x, w, b, swiglu=swiglu, residual=None if forgets == "residual" else residual)

    def norm_out(x, w, b=None, *, residual=None, norm):
        y = plain(x, w, b, residual=residual)
        squares = (y.float() ** 2).sum(-1, keepdim=True)
        return y, skinny_linear.PendingNorm(y if forgets == "weight" else y * norm, squares)

    return plain, norm_out


def test_a_fold_left_out_fails_the_check(monkeypatch):
    """The fold check catches a kernel that forgets the residual, the norm's weight or its 1/rms (here
    stand-ins built from the reference, which pass when they forget nothing)."""
    operands_ = fold_operands(3, 300, 40, True, 4, dtype=torch.float32)
    for forgets in ("residual", "weight", "rms", "nothing"):
        plain, norm_out = stand_in_kernels(forgets)
        monkeypatch.setattr(sys.modules[__name__], "linear_triton", plain)
        monkeypatch.setattr(sys.modules[__name__], "linear_triton_norm_out", norm_out)
        if forgets == "nothing":
            assert_folds_match(*operands_)
        else:
            with pytest.raises(AssertionError):
                assert_folds_match(*operands_)


def test_float16_layers_keep_their_norms_launches(monkeypatch):
    """Folding layers hand their norms between projections in bfloat16 only: float16 cannot hold a residual
    channel times the norm's weight before 1/rms applies. (Stand-in kernels: this is the CPU.)"""
    plain, norm_out = stand_in_kernels()
    handed = []
    monkeypatch.setattr(fused, "takes_kernel", lambda x, weight, bias=None, bounded=True: True)
    monkeypatch.setattr(fused, "linear_triton", plain)
    monkeypatch.setattr(fused, "linear_triton_norm_out", lambda *a, **k: handed.append(1) or norm_out(*a, **k))
    cfg = fold_config("llama")
    for dtype in (torch.float16, torch.bfloat16):
        handed.clear()
        layers = random_layers(cfg, "cpu", dtype)
        h, last, _ = fused_outputs(cfg, layers, torch.randn(3, cfg.hidden_size).to(dtype), torch.ones(64).to(dtype))
        assert h.dtype == last.dtype == dtype
        assert len(handed) == (0 if dtype == torch.float16 else 3), (dtype, len(handed))  # o, down, o


def test_layers_fold_only_where_every_projection_takes_the_kernel(monkeypatch):
    """On the CPU nothing folds and run_fused_layers is the plain layer stack; forced, a layer folds, and a
    layer that does not is refused a norm left to it."""
    cfg = fold_config("llama")
    layers = random_layers(cfg, "cpu", torch.float32)
    x = torch.randn(2, cfg.hidden_size)
    weights = fused.fuse_projections(torch.nn.Module(), layers)
    assert not fused.folds_into_projections(x, layers[0], weights[0])
    h, last, kept = fused_outputs(cfg, layers, x, torch.ones(cfg.hidden_size))
    with torch.no_grad():
        y = x
        for i, layer in enumerate(layers):
            y = layer(y, lambda attn, hn: attn.o_proj(
                0.5 * attn.q_proj(hn) + attn.v_proj(hn).view(2, 2, 16).repeat_interleave(2, dim=1).flatten(1)
                + 0.1 * i))
            if i in (0, 1):
                torch.testing.assert_close(kept[i], y)
    torch.testing.assert_close(last, y)
    torch.testing.assert_close(h, rms_norm_reference(y, torch.ones(cfg.hidden_size), cfg.rms_norm_eps))
    pending = skinny_linear.PendingNorm(x, torch.ones(2, 1))
    with torch.no_grad(), pytest.raises(AssertionError, match="only to a layer that folds"):
        fused.fused_layer(cfg, 0, layers[0], weights[0], pending, x, lambda *a: a[1], torch.ones(64))
    monkeypatch.setattr(fused, "takes_kernel", lambda x, weight, bias=None, bounded=True: weight.shape[0] != 2 * 96)
    assert not fused.folds_into_projections(x, layers[0], weights[0]), "gate/up to cuBLAS: no fold"
    monkeypatch.setattr(fused, "FOLD", False)
    monkeypatch.setattr(fused, "takes_kernel", lambda x, weight, bias=None, bounded=True: True)
    assert not fused.folds_into_projections(x, layers[0], weights[0]), "benches turn the folds off"


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
        assert takes_kernel(Cuda((1, 576)), small, bounded=False) and takes_kernel(Cuda((16, 576)), narrow,
                                                                                   bounded=False), "a layer's ask"
        assert takes_kernel(Cuda((MAX_FOLD_ROWS, 576)), small, bounded=False), "row tiles of a weight in L2"
        assert not takes_kernel(Cuda((MAX_FOLD_ROWS + 1, 576)), small, bounded=False), "more rows than that"
        assert not takes_kernel(Cuda((MAX_ROWS + 1, 4096)), big, bounded=False), "a heavy weight: one tile"
        assert not takes_kernel(Cuda((1, 576)), Cuda((16 * 65536, 576)), bounded=False), "past the grid's columns"
        assert not takes_kernel(Cuda((1, 576), torch.float32, itemsize=4), Cuda((960, 576), torch.float32,
                                                                               itemsize=4), bounded=False)
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
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 24576), (12288, 4096), (4096, 4096)])
@pytest.mark.parametrize("rows", [1, 8, MAX_ROWS])
def test_folds_match_torch_cuda(k, n, rows):
    assert_folds_match(*fold_operands(rows, k, n, n == 6144, 9, "cuda"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (576, 3072), (1536, 576)])  # SmolLM2's projections
@pytest.mark.parametrize("rows", [17, 64, 100, MAX_FOLD_ROWS])
def test_folds_match_torch_cuda_row_tiles(k, n, rows):
    """Past one tile of rows, where a layer's weights stay in L2: the product and every fold."""
    assert_matches(*operands(rows, k, n, n == 960, 5, "cuda"))
    assert_folds_match(*fold_operands(rows, k, n, n == 960, 9, "cuda"))
    assert_folds_match(*fold_operands(rows, k, n, n == 6144, 9, "cuda"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model_type,widths", [("llama", "qwen3-8b"), ("qwen3", "qwen3-8b"), ("llama", "smollm2")])
def test_fused_layers_fold_cuda(model_type, widths):
    """Two layers of Qwen3-8B's or SmolLM2-135M's widths (every projection takes the kernel, none forced)
    folded against unfolded, at one and sixteen rows (SmolLM2's also at 40 and 128: row tiles)."""
    hidden, ffn, heads, kv_heads, head_dim = (4096, 12288, 32, 8, 128) if widths == "qwen3-8b" else (576, 1536, 9,
                                                                                                   3, 64)
    cfg = ModelConfig(model_type=model_type, vocab_size=64, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, qk_norm=model_type == "qwen3")
    layers = random_layers(cfg, "cuda", torch.bfloat16)
    for rows in (1, MAX_ROWS) + ((40, MAX_FOLD_ROWS) if widths == "smollm2" else ()):
        assert_fused_layers_fold("cuda", torch.bfloat16, cfg, layers, rows)


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
