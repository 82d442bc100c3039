"""Rotary embedding of q and k fused with the KV-cache write of k and v: torch reference, Triton kernel, dispatcher.

RoPE is the NeoX/HF "rotate_half" form, out = x*cos + rotate_half(x)*sin, computed in the model dtype
with cos/sin [T, D] as the model computes them (once per forward, shared by every layer: so they stay an
input rather than being recomputed in here). The kernel rounds where the torch ops round (each product,
then the sum) and is built without FMA contraction, so on the GPU it equals the reference bit for bit.

Measured and dropped (fifty-second session, H100, `gpu_round.sh qkv-rope`, `bench/profile_step.py` on and off
alternating in one call): the rotation and the cache write done by the q/k/v projection on its way out (a program a
head over the whole of K, both halves in registers), one launch a layer fewer. 30 kernels fewer a target-only step
(190 against 220) and 36 a tree step (258 against 294), yet no faster: target only at one stream 0.719 ms against
0.707, trees of 15 at one stream 1.000 against 0.999, at eight streams 1.258 against 1.283. Its 15 programs (one a
head of SmolLM2's 9 + 3 + 3) each streamed a head's 64 rows of the weight: 9.0 µs a launch against the
projection's 6.9 plus this module's 4.1, and the attention after it waited longer (7.3 µs against 3.2). Its bf16
GPU test also parted from the reference past the tolerance. The code is gone.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, _switch, dependent_launch, gdc_enter, tl, triton


# Whether `rotary_tables` computes a step's cos/sin tables in one launch on a GPU (this module's kernel)
# instead of torch's seven (a cast, a product, a concatenation, cos, sin and two casts). On: the thirty-first
# session's H200 replays of a decode step at one stream, side by side (`bench/floor_profile.py --rotary-tables`),
# 679.6 -> 666.0 us for SmolLM2-135M and 4,410 -> 4,400 us for the Qwen3-8B shape. The kernel's cos and sin
# are libdevice's, as torch's CUDA ones are: the tables equal torch's bit for bit (GPU tests).
TABLES_IN_ONE_LAUNCH = True
# Whether a DFlash drafter's graphed context forward writes every layer's context k and v in one launch
# (`context_kv_write`: a program per row and layer, the k norm folded in) instead of two a layer (the k norm,
# then rope_and_cache_write): 12 launches fewer a step for the shipped 6-layer drafter. On: the thirty-fourth
# session's H200 run of 15 drafts a step side by side (`bench/draft_length.py --also-context-apart`), 1.98x
# target-only against 1.96x at one stream, 1.30x against 1.28x at eight kept full. Read when the forward is
# captured; SPECSPLIT_CONTEXT_ONE_LAUNCH=0 (read at import) turns it off.
CONTEXT_IN_ONE_LAUNCH = _switch("SPECSPLIT_CONTEXT_ONE_LAUNCH", True)
# Whether a fused layer's per-head q and k norms (Qwen3-style, as the shipped DFlash drafter's layers have) run in
# `rope_and_cache_write`'s launch (`norms=`) instead of two launches of their own before it: 12 launches fewer a
# step for the shipped 6-layer drafter. On since the fiftieth session's H100 run (`gpu_round.sh qk-norm-in-rope`:
# its GPU tests passed; a tree step at one stream 1.000 / 1.005 ms in 294 kernels against 1.006 / 1.012 in 306,
# alternating). The Qwen3-8B shape's profiled step goes through cuBLAS and its unfused layers, so it keeps its
# 438 launches either way. Read when a forward is captured (shared.fused.fused_layer);
# SPECSPLIT_QK_NORM_IN_ROPE=0 (read at import) turns it off.
QK_NORM_IN_ROPE = _switch("SPECSPLIT_QK_NORM_IN_ROPE", True)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, D] of positions [T] (integers) at the rotary frequencies inv_freq [D / 2] (float32),
    each half of D the same, in dtype: the one launch where TABLES_IN_ONE_LAUNCH and the positions are on a
    GPU, else torch's ops (`rotary_tables_reference`)."""
    if TABLES_IN_ONE_LAUNCH and HAVE_TRITON and positions.is_cuda:
        return rotary_tables_triton(positions, inv_freq, dtype)
    return rotary_tables_reference(positions, inv_freq, dtype)


def rotary_tables_reference(positions: torch.Tensor, inv_freq: torch.Tensor,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


TABLE_TOKENS = 16  # tokens a program of the tables kernel computes


def rotary_tables_triton(positions: torch.Tensor, inv_freq: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    assert HAVE_TRITON, "triton is not installed"
    assert positions.dim() == 1 and positions.dtype in (torch.int32, torch.int64) and positions.is_contiguous()
    assert inv_freq.dim() == 1 and inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
    half = inv_freq.numel()
    assert half >= 1 and triton.next_power_of_2(half) == half, half
    tokens = positions.numel()
    cos = torch.empty(tokens, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if tokens:
        _rotary_tables_kernel[(triton.cdiv(tokens, TABLE_TOKENS),)](
            positions, inv_freq.to(positions.device), cos, sin, tokens, HALF=half, BLOCK_T=TABLE_TOKENS,
            num_warps=4, enable_fp_fusion=False, **dependent_launch(positions.device, "rotary_tables"))
    return cos, sin


@triton.jit
def _rotary_tables_kernel(positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, tokens, HALF: tl.constexpr,
                          BLOCK_T: tl.constexpr, USE_GDC: tl.constexpr):
    """Program p: the tables' rows of tokens p*BLOCK_T.., as `rotary_tables_reference` computes them (the
    position cast to float32 and multiplied by each frequency once; tl.cos and tl.sin are libdevice's)."""
    gdc_enter(USE_GDC)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HALF)
    real = t < tokens
    angle = tl.load(positions_ptr + t, mask=real, other=0).to(tl.float32)[:, None] * tl.load(inv_freq_ptr + d)[None, :]
    dtype = cos_ptr.dtype.element_ty
    row = t.to(tl.int64)[:, None] * (2 * HALF) + d[None, :]
    c, s = tl.cos(angle).to(dtype), tl.sin(angle).to(dtype)
    tl.store(cos_ptr + row, c, mask=real[:, None])
    tl.store(cos_ptr + row + HALF, c, mask=real[:, None])
    tl.store(sin_ptr + row, s, mask=real[:, None])
    tl.store(sin_ptr + row + HALF, s, mask=real[:, None])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_and_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, slots, norms=None, eps=0.0) -> torch.Tensor:
    """Rotated q [T, Hq, D]; rotated k and v land in rows `slots` [T] of the caches viewed as
    [num_blocks * block_size, Hkv, D] (the `PagedKVCache.write_slots` layout). With `norms` (the per-head q and k
    norm weights [D]), q and k are normed first (as `kernels.norm.rms_norm`, with `eps`)."""
    if norms is not None:
        from .norm import rms_norm_reference

        q, k = rms_norm_reference(q, norms[0], eps), rms_norm_reference(k, norms[1], eps)
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, apply_rope_reference(k, cos, sin).to(k_cache.dtype))
    v_flat.index_copy_(0, slots, v.to(v_cache.dtype))
    return apply_rope_reference(q, cos, sin)


def rope_and_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                         eps: float = 0.0) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (any strides with a unit last one: column views of a fused qkv
    projection are read in place), cos/sin [T, D], caches [num_blocks, block_size, Hkv, D], slots [T]
    int64. Returns rotated q as a new contiguous tensor; q, k and v are not modified. Hq may be 0: k
    and v alone (the DFlash drafter's context rows have no queries). `norms`: (q norm, k norm) weights [D],
    each head of q and k normed with them before its rotation (eps: theirs), in the same launch."""
    if q.is_cuda and HAVE_TRITON:
        return rope_and_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, slots, norms, eps)
    return rope_and_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, slots, norms, eps)


def rope_and_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, slots, norms=None, eps=0.0) -> torch.Tensor:
    assert HAVE_TRITON, "triton is not installed"
    tokens, hq, dim = q.shape
    hkv = k.shape[1]
    assert k.shape == v.shape == (tokens, hkv, dim) and hq % hkv == 0, (q.shape, k.shape, v.shape)
    assert cos.shape == sin.shape == (tokens, dim), (cos.shape, sin.shape)
    assert dim % 2 == 0 and triton.next_power_of_2(dim) == dim, dim
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (hkv, dim), k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slots.shape == (tokens,) and slots.dtype == torch.int64, (slots.shape, slots.dtype)
    assert q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype, \
        (q.dtype, k.dtype, v.dtype, cos.dtype, sin.dtype, k_cache.dtype)
    assert all(t.stride(-1) == 1 for t in (q, k, v, cos, sin)), "the last dimension must be contiguous"
    assert cos.stride() == sin.stride()
    if norms is not None:
        assert all(w.shape == (dim,) and w.dtype == q.dtype and w.is_contiguous() for w in norms), \
            [(w.shape, w.dtype) for w in norms]
    q_norm, k_norm = norms if norms is not None else (q, q)  # (not read without NORM)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _rope_kernel[(tokens,)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        cos, sin, cos.stride(0), slots, q_out, k_cache, v_cache, hq, hkv, q_norm, k_norm, eps,
        NORM=norms is not None, DIM=dim, BLOCK_HQ=max(triton.next_power_of_2(hq), 1),
        BLOCK_HKV=triton.next_power_of_2(hkv),
        # no FMA: x*cos + r*sin rounds each product, as torch does
        num_warps=4, enable_fp_fusion=False, **dependent_launch(q.device, "rope"))
    return q_out


@triton.jit
def _rotate(x_ptr, x_sh, out_ptr, out_sh, heads, cos1, cos2, sin1, sin2, w_ptr, eps, NORM: tl.constexpr,
            DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates one token's `heads` heads at x_ptr (head stride x_sh) into out_ptr (head stride out_sh); with
    NORM each head normed first by the weight at w_ptr [DIM] (in float32, rounded to the model dtype, then
    scaled by the weight in that dtype, as kernels/norm.py)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, DIM // 2)[None, :]
    mask = h < heads
    x1 = tl.load(x_ptr + h * x_sh + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + h * x_sh + DIM // 2 + d, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if NORM:
        scale = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / DIM + eps)[:, None]
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + DIM // 2 + d).to(tl.float32)
        x1 = (w1 * (x1 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # rotate_half(x) = (-x2, x1); each product and the sum rounded to the model dtype as in torch
    out1 = (x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(out_ptr + h * out_sh + d, out1.to(dtype), mask=mask)
    tl.store(out_ptr + h * out_sh + DIM // 2 + d, out2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, q_st, q_sh, k_ptr, k_st, k_sh, v_ptr, v_st, v_sh, cos_ptr, sin_ptr, cs_st, slots_ptr,
                 q_out_ptr, k_cache_ptr, v_cache_ptr, hq, hkv, q_norm_ptr, k_norm_ptr, eps, NORM: tl.constexpr,
                 DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, USE_GDC: tl.constexpr):
    """One program per token: rotates its q heads into q_out and its k heads into the cache row
    slots[t] (with NORM each head normed first, q's by q_norm and k's by k_norm), and copies its v heads
    there."""
    gdc_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, DIM // 2)
    cos1 = tl.load(cos_ptr + t * cs_st + d).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + t * cs_st + DIM // 2 + d).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + t * cs_st + d).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + t * cs_st + DIM // 2 + d).to(tl.float32)[None, :]
    _rotate(q_ptr + t * q_st, q_sh, q_out_ptr + t * hq * DIM, DIM, hq, cos1, cos2, sin1, sin2, q_norm_ptr, eps,
            NORM, DIM, BLOCK_HQ)
    row = tl.load(slots_ptr + t) * hkv * DIM  # the caches are contiguous [num_slots, Hkv, D]
    _rotate(k_ptr + t * k_st, k_sh, k_cache_ptr + row, DIM, hkv, cos1, cos2, sin1, sin2, k_norm_ptr, eps, NORM,
            DIM, BLOCK_HKV)
    h = tl.arange(0, BLOCK_HKV)[:, None]
    dd = tl.arange(0, DIM)[None, :]
    mask = h < hkv
    tl.store(v_cache_ptr + row + h * DIM + dd, tl.load(v_ptr + t * v_st + h * v_sh + dd, mask=mask), mask=mask)


def context_kv_write_reference(kv: torch.Tensor, k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor,
                               sin: torch.Tensor, k_pools: torch.Tensor, v_pools: torch.Tensor,
                               slots: torch.Tensor) -> None:
    """A DFlash drafter's context rows into every layer's pool: kv [T, layers, 2, Hkv, D] (each layer's k and
    v of the rows, one GEMM's output), k_norm [layers, D] (each layer's per-head k norm) or None, cos/sin
    [T, D], pools [layers, num_blocks, block_size, Hkv, D], slots [T]. Per layer: k normed (as
    `kernels.norm.rms_norm`), rotated and written to its slots, v written."""
    from .norm import rms_norm_reference

    no_queries = kv.new_empty((kv.shape[0], 0, kv.shape[-1]))
    for layer in range(kv.shape[1]):
        k, v = kv[:, layer, 0], kv[:, layer, 1]
        if k_norm is not None:
            k = rms_norm_reference(k, k_norm[layer], eps)
        rope_and_cache_write_reference(no_queries, k, v, cos, sin, k_pools[layer], v_pools[layer], slots)


def context_kv_write(kv: torch.Tensor, k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor, k_pools: torch.Tensor, v_pools: torch.Tensor, slots: torch.Tensor) -> None:
    """`context_kv_write_reference` in one launch on a GPU (a program per row and layer) instead of two a
    layer (the k norm, then the rotation and the writes)."""
    if kv.is_cuda and HAVE_TRITON:
        context_kv_write_triton(kv, k_norm, eps, cos, sin, k_pools, v_pools, slots)
    else:
        context_kv_write_reference(kv, k_norm, eps, cos, sin, k_pools, v_pools, slots)


def context_kv_write_triton(kv, k_norm, eps, cos, sin, k_pools, v_pools, slots) -> None:
    assert HAVE_TRITON, "triton is not installed"
    tokens, layers, two, hkv, dim = kv.shape
    assert two == 2 and dim % 2 == 0 and triton.next_power_of_2(dim) == dim, kv.shape
    assert kv.stride(4) == 1 and kv.stride(3) == dim and kv.stride(2) == hkv * dim and kv.stride(1) == 2 * hkv * dim, \
        "each row's layers, k/v and heads contiguous (a view of one GEMM's output)"
    assert k_pools.shape == v_pools.shape and k_pools.shape[0] == layers and k_pools.shape[3:] == (hkv, dim)
    assert k_pools.is_contiguous() and v_pools.is_contiguous()
    assert cos.shape == sin.shape == (tokens, dim) and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert slots.shape == (tokens,) and slots.dtype == torch.int64
    assert kv.dtype == cos.dtype == sin.dtype == k_pools.dtype == v_pools.dtype
    if k_norm is not None:
        assert k_norm.shape == (layers, dim) and k_norm.is_contiguous() and k_norm.dtype == kv.dtype
    _context_kv_kernel[(tokens, layers)](
        kv, kv.stride(0), kv if k_norm is None else k_norm, eps, cos, sin, cos.stride(0), slots, k_pools, v_pools,
        k_pools.stride(0), hkv, NORM=k_norm is not None, DIM=dim, BLOCK_HKV=triton.next_power_of_2(hkv),
        # no FMA in the rotation: x*cos + r*sin rounds each product, as torch does
        num_warps=4, enable_fp_fusion=False, **dependent_launch(kv.device, "rope"))


@triton.jit
def _context_kv_kernel(kv_ptr, kv_st, w_ptr, eps, cos_ptr, sin_ptr, cs_st, slots_ptr, k_pool_ptr, v_pool_ptr,
                       pool_st, hkv, NORM: tl.constexpr, DIM: tl.constexpr, BLOCK_HKV: tl.constexpr,
                       USE_GDC: tl.constexpr):
    """One program per (row, layer): the layer's k heads normed (in float32, rounded to the model dtype,
    then scaled by the weight in that dtype, as kernels/norm.py), rotated (rounded where torch rounds, as
    _rope_kernel) and stored in the row's slot of the layer's k pool; its v heads copied to the v pool."""
    gdc_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    dtype = k_pool_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_HKV)[:, None]
    d = tl.arange(0, DIM // 2)[None, :]
    mask = h < hkv
    k_ptr = kv_ptr + t * kv_st + layer * 2 * hkv * DIM + h * DIM  # [t, layer, 0, h, :]
    x1 = tl.load(k_ptr + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_ptr + DIM // 2 + d, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        scale = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / DIM + eps)[:, None]
        w1 = tl.load(w_ptr + layer * DIM + d).to(tl.float32)
        w2 = tl.load(w_ptr + layer * DIM + DIM // 2 + d).to(tl.float32)
        x1 = (w1 * (x1 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    cos1 = tl.load(cos_ptr + t * cs_st + d).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * cs_st + DIM // 2 + d).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * cs_st + d).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * cs_st + DIM // 2 + d).to(tl.float32)
    out1 = (x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    row = layer * pool_st + tl.load(slots_ptr + t) * hkv * DIM + h * DIM  # pools [layers, slots, Hkv, D]
    tl.store(k_pool_ptr + row + d, out1.to(dtype), mask=mask)
    tl.store(k_pool_ptr + row + DIM // 2 + d, out2.to(dtype), mask=mask)
    dd = tl.arange(0, DIM)[None, :]
    tl.store(v_pool_ptr + row + dd, tl.load(k_ptr + hkv * DIM + dd, mask=mask), mask=mask)
