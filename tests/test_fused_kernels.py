"""Fused elementwise kernels: each torch reference is the model's math, and each Triton kernel matches its
reference under the Triton interpreter (CPU), compiled on CUDA, and replayed inside a captured CUDA graph.

The interpreter runs in a child process (`python tests/test_fused_kernels.py CHECK`) with TRITON_INTERPRET=1:
triton reads that variable when a kernel is decorated, so setting it in this process would turn the
CUDA tests' kernels (and other modules' kernels) into interpreted ones.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass

import pytest
import torch

from specsplit.kernels import activation, norm, rope
from specsplit.shared.config import RopeConfig
from specsplit.shared.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope
from specsplit.target_service.kv_cache import PagedKVCache

EPS = 1e-6
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    hidden: int
    hq: int
    hkv: int
    dim: int
    ffn: int


SMOLLM2 = Shape(hidden=576, hq=9, hkv=3, dim=64, ffn=1536)
QWEN3_8B = Shape(hidden=4096, hq=32, hkv=8, dim=128, ffn=12288)

# The most a kernel may differ from its reference, in units in the last place of the reference's result.
# rms_norm: the kernel sums the squares in another order and uses another rsqrt, so its float32 h is a few
#   ulps off (float32: <= 8); in a half type that can flip the rounding of h by one ulp (2^-8..2^-7
#   relative), which the product with the weight (exact in float32, rounded once) makes <= 3 ulps.
# silu_mul: tl.exp is exp2(x * log2 e); rounding x * log2 e costs |x| * 2^-23 relative, <= 32 ulps for
#   |x| <= 16, plus a few for exp2 and the division (float32: <= 64); in a half type, again one flipped
#   rounding of silu(gate) before the product: <= 3 ulps.
# rope_and_cache_write: the kernel rounds where torch rounds and is built without FMA: exact. So is the
#   residual sum of add_rms_norm, and the v rows copied into the cache.
# rotary_tables: on CUDA exact (libdevice's cos and sin, as torch's); under the interpreter numpy's float32
#   cos and sin against torch's CPU ones, which may part by an ulp (an ulp or a flipped rounding in a half type).
MAX_ULPS = {("rms_norm", torch.float32): 8, ("silu_mul", torch.float32): 64}
HALF_MAX_ULPS = 3


def max_ulps(kernel: str, dtype: torch.dtype) -> int:
    return MAX_ULPS.get((kernel, dtype), HALF_MAX_ULPS)


def ulps(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in units in the last place of `expected` (in its dtype)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    _, exponent = torch.frexp(expected.float())
    ulp = torch.finfo(expected.dtype).eps * torch.pow(2.0, (exponent - 1).float())
    return ((actual.float() - expected.float()).abs() / ulp).max().item()


# ---- inputs, shaped as the model makes them ------------------------------------------------------

def randn(*size, dtype, device, gen, scale=1.0) -> torch.Tensor:
    return (scale * torch.randn(*size, generator=gen)).to(dtype=dtype, device=device)


def norm_inputs(shape: Shape, tokens: int, dtype, device, seed: int = 0):
    """(x, residual, weight): an attention output, the residual stream, a norm weight near 1."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(tokens, shape.hidden, dtype=dtype, device=device, gen=gen)
    residual = randn(tokens, shape.hidden, dtype=dtype, device=device, gen=gen, scale=4.0)
    weight = randn(shape.hidden, dtype=dtype, device=device, gen=gen, scale=0.2) + 1
    return x, residual, weight


def gate_up_inputs(shape: Shape, tokens: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (randn(tokens, 2 * shape.ffn, dtype=dtype, device=device, gen=gen, scale=3.0),)


def rope_inputs(shape: Shape, tokens: int, dtype, device, seed: int = 0):
    """(q, k, v, cos, sin, k_cache, v_cache, slots): q/k/v are column views of one fused qkv output,
    cos/sin from the model's RotaryEmbedding at random positions, distinct random slots of a zeroed pool."""
    gen = torch.Generator().manual_seed(seed)
    qkv = randn(tokens, (shape.hq + 2 * shape.hkv) * shape.dim, dtype=dtype, device=device, gen=gen)
    q, k, v = qkv.split([shape.hq * shape.dim, shape.hkv * shape.dim, shape.hkv * shape.dim], dim=1)
    positions = torch.randint(0, 32768, (tokens,), generator=gen).to(device)
    cos, sin = RotaryEmbedding(shape.dim, RopeConfig(theta=1e6)).to(device)(positions, dtype)
    num_blocks = 2 * (tokens // BLOCK_SIZE + 1)
    cache = torch.zeros(num_blocks, BLOCK_SIZE, shape.hkv, shape.dim, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    return (q.view(tokens, shape.hq, shape.dim), k.view(tokens, shape.hkv, shape.dim),
            v.view(tokens, shape.hkv, shape.dim), cos, sin, cache, cache.clone(), slots)


def context_inputs(shape: Shape, tokens: int, dtype, device, seed: int = 0, layers: int = 6):
    """(kv, k_norm, eps, cos, sin, k_pools, v_pools, slots) of a DFlash drafter's context forward: one GEMM's
    output viewed [T, layers, 2, Hkv, D], per-layer k norm weights near 1, zeroed pools, distinct slots."""
    gen = torch.Generator().manual_seed(seed)
    kv = randn(tokens, layers * 2 * shape.hkv * shape.dim, dtype=dtype, device=device, gen=gen, scale=2.0)
    k_norm = randn(layers, shape.dim, dtype=dtype, device=device, gen=gen, scale=0.2) + 1
    positions = torch.randint(0, 32768, (tokens,), generator=gen).to(device)
    cos, sin = RotaryEmbedding(shape.dim, RopeConfig(theta=1e6)).to(device)(positions, dtype)
    num_blocks = 2 * (tokens // BLOCK_SIZE + 1)
    pools = torch.zeros(layers, num_blocks, BLOCK_SIZE, shape.hkv, shape.dim, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    return (kv.view(tokens, layers, 2, shape.hkv, shape.dim), k_norm, EPS, cos, sin, pools, pools.clone(), slots)


def tables_inputs(shape: Shape, tokens: int, dtype, device, seed: int = 0):
    """(positions [T] int64, inv_freq [D/2] float32): random positions of up to 2^17, the model's frequencies
    (llama3-scaled for the 8B shape's width, plain for SmolLM2's)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 2 ** 17, (tokens,), generator=gen).to(device)
    scaled = RopeConfig(theta=5e5, scaling_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)
    rope_cfg = scaled if shape.dim == 128 else RopeConfig(theta=1e4)
    return positions, RotaryEmbedding(shape.dim, rope_cfg).inv_freq.to(device)


def clone_caches(args):
    """rope inputs with caches of their own, so kernel and reference each write into a fresh pair."""
    return (*args[:5], args[5].clone(), args[6].clone(), args[7])


# ---- checks: a Triton kernel against its reference (run here on CUDA, in a child for the interpreter) ----

def check_rms_norm(shape: Shape, tokens: int, dtype, device) -> None:
    x, residual, weight = norm_inputs(shape, tokens, dtype, device)
    bound = max_ulps("rms_norm", dtype)
    heads = x.view(tokens, -1, 64), weight[:64].contiguous()  # a per-head q/k norm: [T, H, 64]
    strided = x[:, 64:], weight[64:].contiguous()  # rows of a wider tensor, read in place
    # heads of a wider tensor, as q/k columns of a fused qkv projection: [T, H, 64], token stride > H * 64
    strided_heads = x[:, 64:64 + 64 * (x.shape[1] // 64 - 2)].view(tokens, -1, 64), weight[:64].contiguous()
    for rows, w in ((x, weight), heads, strided, strided_heads):
        assert ulps(norm.rms_norm_triton(rows, w, EPS), norm.rms_norm_reference(rows, w, EPS)) <= bound
    normed, new_residual = norm.add_rms_norm_triton(x, residual, weight, EPS)
    ref_normed, ref_residual = norm.add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(new_residual, ref_residual)
    assert ulps(normed, ref_normed) <= bound


def check_silu_mul(shape: Shape, tokens: int, dtype, device) -> None:
    (gate_up,) = gate_up_inputs(shape, tokens, dtype, device)
    bound = max_ulps("silu_mul", dtype)
    assert ulps(activation.silu_mul_triton(gate_up), activation.silu_mul_reference(gate_up)) <= bound
    strided = gate_up[:, : gate_up.shape[1] - 2]  # a row stride wider than the row
    assert ulps(activation.silu_mul_triton(strided), activation.silu_mul_reference(strided)) <= bound


def check_rope(shape: Shape, tokens: int, dtype, device) -> None:
    args = rope_inputs(shape, tokens, dtype, device)
    kernel_args, reference_args = clone_caches(args), clone_caches(args)
    q_out = rope.rope_and_cache_write_triton(*kernel_args)
    assert torch.equal(q_out, rope.rope_and_cache_write_reference(*reference_args))
    assert torch.equal(kernel_args[5], reference_args[5]) and torch.equal(kernel_args[6], reference_args[6])
    assert q_out.is_contiguous()


def qk_norms(shape: Shape, dtype, device, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q and k norm weights [D] near 1 (a Qwen3-style layer's)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(shape.dim, dtype=dtype, device=device, gen=gen, scale=0.2) + 1 for _ in "qk")


def check_rope_qk_norm(shape: Shape, tokens: int, dtype, device) -> None:
    """q and k normed per head in the rotary launch (`norms=`): against the reference, which norms them with the
    model's RMSNorm first, within the norm's few ulps carried through the rotation (bounded against the rows'
    magnitude, as the context kernel's); v and the rows not written exact, only the tokens' slots written.
    Without heads of q (the context's rows) k alone."""
    for hq in (shape.hq, 0):
        args = rope_inputs(dataclasses.replace(shape, hq=hq), tokens, dtype, device)
        norms = qk_norms(shape, dtype, device)
        kernel_args, reference_args = clone_caches(args), clone_caches(args)
        q_out = rope.rope_and_cache_write_triton(*kernel_args, norms, EPS)
        q_ref = rope.rope_and_cache_write_reference(*reference_args, norms, EPS)
        bound = 8 * torch.finfo(dtype).eps
        for got, want in ((q_out, q_ref), (kernel_args[5], reference_args[5])):
            error = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
            assert error <= bound * max(want.float().abs().max().item() if want.numel() else 0.0, 1.0), error
        assert torch.equal(kernel_args[6], reference_args[6])
        # the norm did something: without it the rotated k differs by more than the bound
        plain = clone_caches(args)
        rope.rope_and_cache_write_reference(*plain)
        assert not torch.allclose(plain[5].float(), reference_args[5].float(), rtol=0, atol=1e-2)
        assert kernel_args[5].abs().sum(dim=(2, 3)).count_nonzero() == tokens


def check_rope_kv_only(shape: Shape, tokens: int, dtype, device) -> None:
    """No queries (the DFlash drafter's context rows): k rotated and written, v written."""
    check_rope(dataclasses.replace(shape, hq=0), tokens, dtype, device)


def check_context_kv(shape: Shape, tokens: int, dtype, device) -> None:
    """Every layer's context k and v in one launch: without a k norm exact (as rope_and_cache_write), with
    one within the norm's few ulps, carried through the rotation (bounded against the rows' magnitude: a
    rotation's difference of two products can cancel); v and the untouched pool rows exact."""
    args = context_inputs(shape, tokens, dtype, device)
    for k_norm, bound in ((None, 0.0), (args[1], 8 * torch.finfo(dtype).eps)):
        kernel, reference = [(args[0], k_norm, *args[2:5], args[5].clone(), args[6].clone(), args[7]) for _ in "kr"]
        rope.context_kv_write_triton(*kernel)
        rope.context_kv_write_reference(*reference)
        assert torch.equal(kernel[6], reference[6])
        error = (kernel[5].float() - reference[5].float()).abs().max().item()
        assert error <= bound * reference[5].float().abs().max().item(), (error, k_norm is None)
        assert kernel[5].abs().sum(dim=(0, 3, 4)).count_nonzero() == tokens  # only the rows' slots written


def check_rotary_tables(shape: Shape, tokens: int, dtype, device) -> None:
    positions, inv_freq = tables_inputs(shape, tokens, dtype, device)
    bound = 0 if device == "cuda" else 1
    for got, want in zip(rope.rotary_tables_triton(positions, inv_freq, dtype),
                         rope.rotary_tables_reference(positions, inv_freq, dtype)):
        assert ulps(got, want) <= bound, ulps(got, want)
        assert torch.equal(got[:, :shape.dim // 2], got[:, shape.dim // 2:])


CHECKS = {"rms_norm": check_rms_norm, "silu_mul": check_silu_mul, "rope": check_rope,
          "rope_kv_only": check_rope_kv_only, "rope_qk_norm": check_rope_qk_norm, "rotary_tables": check_rotary_tables, "context_kv": check_context_kv}


# ---- the references are the model's math -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_references_are_the_models_rmsnorm(dtype):
    x, residual, weight = norm_inputs(SMOLLM2, 5, dtype, "cpu")
    module = RMSNorm(SMOLLM2.hidden, EPS).to(dtype)
    module.weight.data.copy_(weight)
    assert torch.equal(norm.rms_norm_reference(x, weight, EPS), module(x))
    normed, new_residual = norm.add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(new_residual, residual + x)  # the decoder layer's `x = x + attn(...)`
    assert torch.equal(normed, module(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_reference_is_apply_rope_then_write_slots(dtype):
    q, k, v, cos, sin, k_cache, v_cache, slots = rope_inputs(SMOLLM2, 40, dtype, "cpu")
    cache = PagedKVCache(1, SMOLLM2.hkv, SMOLLM2.dim, k_cache.shape[0], BLOCK_SIZE, dtype)
    cache.write_slots(0, slots, apply_rope(k, cos, sin), v)
    q_out = rope.rope_and_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(q_out, apply_rope(q, cos, sin))
    assert torch.equal(k_cache, cache.k_pool[0]) and torch.equal(v_cache, cache.v_pool[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_reference_is_the_models_mlp_activation(dtype):
    torch.manual_seed(0)
    mlp = MLP(SMOLLM2.hidden, SMOLLM2.ffn).to(dtype)
    x = torch.randn(5, SMOLLM2.hidden).to(dtype)
    with torch.no_grad():
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        assert torch.equal(mlp.down_proj(activation.silu_mul_reference(gate_up)), mlp(x))


def test_rotary_tables_are_the_models_and_one_launch_on_a_gpu(monkeypatch):
    """The reference is what RotaryEmbedding computed before it called rotary_tables; the model's rotary
    embedding takes the kernel on a GPU, unless TABLES_IN_ONE_LAUNCH is off."""
    positions, inv_freq = tables_inputs(SMOLLM2, 9, torch.float32, "cpu")
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    module = RotaryEmbedding(SMOLLM2.dim, RopeConfig(theta=1e4))
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = module(positions, dtype)
        assert torch.equal(cos, emb.cos().to(dtype)) and torch.equal(sin, emb.sin().to(dtype))
    seen = []
    monkeypatch.setattr(rope, "HAVE_TRITON", True)
    monkeypatch.setattr(rope, "rotary_tables_triton", lambda *a: seen.append("kernel") or (None, None))
    monkeypatch.setattr(rope, "rotary_tables_reference", lambda *a: seen.append("torch") or (None, None))
    on_gpu = type("OnGpu", (), {"is_cuda": True})()
    assert rope.TABLES_IN_ONE_LAUNCH is True  # (the default)
    rope.rotary_tables(on_gpu, inv_freq, torch.float32)
    rope.rotary_tables(positions, inv_freq, torch.float32)  # on the CPU: torch's
    monkeypatch.setattr(rope, "TABLES_IN_ONE_LAUNCH", False)
    rope.rotary_tables(on_gpu, inv_freq, torch.float32)
    assert seen == ["kernel", "torch", "torch"]


def test_dispatchers_take_the_reference_on_cpu():
    x, residual, weight = norm_inputs(SMOLLM2, 3, torch.float32, "cpu")
    assert torch.equal(norm.rms_norm(x, weight, EPS), norm.rms_norm_reference(x, weight, EPS))
    for got, want in zip(norm.add_rms_norm(x, residual, weight, EPS),
                         norm.add_rms_norm_reference(x, residual, weight, EPS)):
        assert torch.equal(got, want)
    (gate_up,) = gate_up_inputs(SMOLLM2, 3, torch.float32, "cpu")
    assert torch.equal(activation.silu_mul(gate_up), activation.silu_mul_reference(gate_up))
    args = rope_inputs(SMOLLM2, 3, torch.float32, "cpu")
    assert torch.equal(rope.rope_and_cache_write(*args), rope.rope_and_cache_write_reference(*clone_caches(args)))


# ---- the Triton kernels under the interpreter (CPU) --------------------------------------------------

@pytest.fixture(scope="module")
def interpreted() -> str:
    """The output of one child running every check under the interpreter (one interpreter start-up, not one
    a check): a line `ok NAME` per check that passed, its traceback for one that failed."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.run([sys.executable, __file__, *sorted(CHECKS)], env=env, capture_output=True, text=True,
                           timeout=600)
    return child.stdout + child.stderr


@pytest.mark.slow  # (20 s on the CPU in all: the default run stays under five minutes; CI runs it after)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_kernel_matches_reference_interpreted(check, interpreted):
    """float32 and float16 (the interpreter truncates float32 -> bfloat16 instead of rounding to nearest,
    so bfloat16, which takes the same code path as float16, is checked on CUDA)."""
    assert f"ok {check}\n" in interpreted, interpreted


def run_interpreted(checks: list[str]) -> None:
    for check in checks:
        try:
            for shape in (SMOLLM2, QWEN3_8B):
                for dtype in (torch.float32, torch.float16):
                    CHECKS[check](shape, 3, dtype, "cpu")
        except Exception:  # noqa: BLE001 - reported by its own test; the other checks still run
            traceback.print_exc()
            print(f"failed {check}", flush=True)
        else:
            print(f"ok {check}", flush=True)


# ---- the compiled kernels on CUDA ---------------------------------------------------------------------

@pytest.fixture
def compiled():
    """Fails when this process built the kernels with TRITON_INTERPRET set (they would run interpreted)."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    assert not isinstance(norm._rms_norm_kernel, InterpretedFunction), "run the gpu tests without TRITON_INTERPRET"


def on_cuda(test):
    """A gpu test: skipped without CUDA, and run only with compiled kernels."""
    test = pytest.mark.usefixtures("compiled")(test)
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [SMOLLM2, QWEN3_8B], ids=["smollm2", "qwen3_8b"])
@pytest.mark.parametrize("check", sorted(CHECKS))
@on_cuda
def test_kernel_matches_reference_on_cuda(check, shape, dtype, tokens):
    CHECKS[check](shape, tokens, dtype, "cuda")


def replay(fn, static_args, new_args):
    """fn's output from a CUDA graph captured over static_args, replayed after new_args are copied into them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: triton compiles on first launch
        fn(*static_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_args)
    for static, new in zip(static_args, new_args):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    return out


GRAPHED = {  # kernel: (dispatcher, reference, inputs)
    "rms_norm": (lambda x, r, w: norm.rms_norm(x, w, EPS), lambda x, r, w: norm.rms_norm_reference(x, w, EPS),
                 norm_inputs),
    "add_rms_norm": (lambda *a: norm.add_rms_norm(*a, EPS), lambda *a: norm.add_rms_norm_reference(*a, EPS),
                     norm_inputs),
    "silu_mul": (activation.silu_mul, activation.silu_mul_reference, gate_up_inputs),
    "rope": (rope.rope_and_cache_write, rope.rope_and_cache_write_reference, rope_inputs),
    "rope_qk_norm": (lambda *a: rope.rope_and_cache_write(*a[:8], (a[8], a[9]), EPS),
                     lambda *a: rope.rope_and_cache_write_reference(*a[:8], (a[8], a[9]), EPS),
                     lambda shape, tokens, dtype, device, seed=0: (*rope_inputs(shape, tokens, dtype, device, seed),
                                                                   *qk_norms(shape, dtype, device, seed))),
    "rotary_tables": (lambda p, f: rope.rotary_tables_triton(p, f, torch.bfloat16),
                      lambda p, f: rope.rotary_tables_reference(p, f, torch.bfloat16), tables_inputs),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [SMOLLM2, QWEN3_8B], ids=["smollm2", "qwen3_8b"])
@pytest.mark.parametrize("kernel", sorted(GRAPHED))
@on_cuda
def test_kernel_replays_in_a_cuda_graph(kernel, shape, dtype):
    """Captured over one batch, replayed over another (new activations, positions and slots): the output
    (and for rope the cache) equals the reference on the new batch."""
    fn, reference, inputs = GRAPHED[kernel]
    static, new = inputs(shape, 8, dtype, "cuda", seed=1), inputs(shape, 8, dtype, "cuda", seed=2)
    out = replay(fn, static, new)
    expected = reference(*new)  # for rope this writes the reference's cache rows into `new`'s caches
    outs, expecteds = (out, expected) if isinstance(out, tuple) else ((out,), (expected,))
    if kernel == "rope_qk_norm":  # (the norm's few ulps, carried through the rotation: see check_rope_qk_norm)
        relative = 8 * torch.finfo(dtype).eps
        for got, want in ((out, expected), (static[5], new[5])):
            assert (got.float() - want.float()).abs().max().item() <= relative * want.float().abs().max().item()
        assert torch.equal(static[6], new[6])
        return
    bound = 0 if kernel in ("rope", "rotary_tables") else max_ulps(kernel.removeprefix("add_"), dtype)
    for got, want in zip(outs, expecteds):
        assert ulps(got, want) <= bound
    if kernel == "rope":
        assert torch.equal(static[5], new[5]) and torch.equal(static[6], new[6])


if __name__ == "__main__":  # the child of the `interpreted` fixture
    run_interpreted(sys.argv[1:])
