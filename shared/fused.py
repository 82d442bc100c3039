"""The fused decoder layer both services' graphed forwards run: ten launches a layer, or seven.

One GEMM for q/k/v and one for gate/up (the layer's projection weights concatenated once, the modules' own
weights becoming views of the result, so nothing is stored twice and the eager forward reads the same memory),
the residual add fused into each RMSNorm, RoPE fused with the write of k/v into a paged pool, SiLU·mul in one
kernel: ten launches a layer. For up to 16 rows of 16-bit CUDA tensors (decode steps, one stream's verify), or
up to 128 where every weight of the layer is small enough to stay in L2 (a model of SmolLM2's size: eight
streams' verify, the DFlash drafter's blocks), every projection goes through `kernels.skinny_linear`'s kernel
whatever its width (`folds_into_projections`), which also does the residual adds and SiLU·mul on the tile it
stores, and the norms between projections: the projection that writes a norm's input also writes it times the
norm's weight and its programs' sums of squares (`kernels.skinny_linear.PendingNorm`), and the one that reads
it scales its sums by 1/rms at the end (bfloat16 only, see `HANDED_NORM_DTYPES`): seven launches a layer.
(Fusing them into cuBLAS's neighbours instead was measured slower on the H200: every program of a GEMM
recomputed the activation or the norm for its rows; see the README's fifteenth session and
kernels/skinny_linear.py.)
Where keys come from and how queries attend is the caller's: the target attends causally over its KV
cache, the DFlash drafter's block over its context pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Protocol, Sequence

import torch

from specsplit.kernels import rope
from specsplit.kernels.activation import silu_mul
from specsplit.kernels.norm import add_rms_norm, rms_norm
from specsplit.kernels.skinny_linear import (PendingNorm, linear, linear_triton, linear_triton_norm_out,
                                             takes_kernel)
from specsplit.shared.config import ModelConfig
from specsplit.shared.layers import DecoderLayer


@dataclass(frozen=True)
class FusedWeights:
    """One layer's projections concatenated, so each is one GEMM."""

    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]


def fuse_projections(owner: torch.nn.Module, layers: Sequence[DecoderLayer]) -> list[FusedWeights]:
    """The fused projections of `layers`, made on first use and kept on `owner` (the same list for
    every later caller)."""
    if getattr(owner, "fused_projections", None) is None:
        owner.fused_projections = [
            FusedWeights(
                qkv=_concat_into_views([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                        layer.self_attn.v_proj.weight]),
                qkv_bias=(None if layer.self_attn.q_proj.bias is None else _concat_into_views(
                    [layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias])),
                gate_up=_concat_into_views([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
            )
            for layer in layers
        ]
    return owner.fused_projections


def _concat_into_views(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """cat(params) along dim 0, after which each parameter is a view of its rows of the result."""
    whole = torch.cat([p.data for p in params])
    offset = 0
    for p in params:
        p.data = whole[offset:offset + p.shape[0]]
        offset += p.shape[0]
    return whole


class Attend(Protocol):
    """A fused layer's attention: (layer index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> its output
    [T, Hq, D]. q and k come not rotated: the attention rotates them and writes k and v where its keys live. They
    come normed where the layer has per-head norms (Qwen3), or, where `kernels.rope.QK_NORM_IN_ROPE`, unnormed
    with those norms' weights as `norms`, for the callee to apply first (in the rotary kernel's launch)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 norms: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor: ...


class PagedAttend:
    """An `Attend` whose keys live in paged pools: each layer's q and k rotated and k and v written to rows
    `slots` of its pools (`kernels.rope.rope_and_cache_write`), then `attention(layer, rotated q)`: the
    target's step graphs and the drafter's block forward attend through one."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, k_pools: Sequence[torch.Tensor],
                 v_pools: Sequence[torch.Tensor], slots: torch.Tensor, eps: float,
                 attention: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        self.cos, self.sin, self.k_pools, self.v_pools, self.slots, self.eps = cos, sin, k_pools, v_pools, slots, eps
        self.attention = attention

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 norms: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q = rope.rope_and_cache_write(q, k, v, self.cos, self.sin, self.k_pools[layer], self.v_pools[layer],
                                      self.slots, norms, self.eps)
        return self.attention(layer, q)


FOLD = True  # benches set it False to compare a step with the folds and without ...
FOLD_NORMS = True  # ... or only this, to keep the norms' own launches
# The dtypes whose norms are handed between projections: the writer stores its output times the norm's weight
# before 1/rms applies, which float16 cannot hold for residual channels in the thousands (3,000 x a weight of
# 30 is past its 65,504); bfloat16 has float32's range. Float16 keeps the norms' own launches.
HANDED_NORM_DTYPES = (torch.bfloat16,)


def folds_into_projections(x: torch.Tensor, layer: DecoderLayer, weights: FusedWeights) -> bool:
    """Whether, for x's rows, every projection of this layer takes the few-rows kernel (whatever the
    weights' size), which then also does the layer's residual adds and SiLU·mul on the way out and (in
    bfloat16) hands each norm on to the next projection (a PendingNorm): seven launches a layer instead of
    ten. On the H200 (bench/floor_profile.py, one stream's decode step) that took SmolLM2-135M's step from
    0.90 ms to 0.77 and the Qwen3-8B-shaped one from 4.51 to 4.41."""
    attn, mlp = layer.self_attn, layer.mlp
    return FOLD and all(takes_kernel(x, weight, bias, bounded=False) for weight, bias in (
        (weights.qkv, weights.qkv_bias), (attn.o_proj.weight, attn.o_proj.bias), (weights.gate_up, None),
        (mlp.down_proj.weight, mlp.down_proj.bias)))


def fused_layer(cfg: ModelConfig, index: int, layer: DecoderLayer, weights: FusedWeights,
                h: torch.Tensor | PendingNorm, residual: torch.Tensor, attend: Attend, next_norm: torch.Tensor,
                fold: bool = False, fold_next: bool = False) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """One pre-norm decoder layer. residual: its input; h: that normed with the layer's input norm, or
    where the layer folds (`fold`: `folds_into_projections` holds for it) the norm pending. Returns the next
    layer's normed input (normed with `next_norm`: the next layer's input norm, or the final norm; left
    pending where this layer folds and so does the next, `fold_next`) and this layer's output."""
    attn, mlp, eps = layer.self_attn, layer.mlp, cfg.rms_norm_eps
    if isinstance(h, PendingNorm):
        assert fold, "a norm is left pending only to a layer that folds"
        qkv = linear_triton(h.weighted, weights.qkv, weights.qkv_bias, norm_in=h.squares, eps=eps)
    else:
        qkv = linear(h, weights.qkv, weights.qkv_bias)
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q, k, v = (t.view(t.shape[0], -1, cfg.head_dim) for t in (q, k, v))
    if attn.q_norm is None:
        out = attend(index, q, k, v)
    elif rope.QK_NORM_IN_ROPE:  # normed in the rotary kernel's launch
        out = attend(index, q, k, v, norms=(attn.q_norm.weight, attn.k_norm.weight))
    else:
        out = attend(index, rms_norm(q, attn.q_norm.weight, eps), rms_norm(k, attn.k_norm.weight, eps), v)
    out = out.reshape(out.shape[0], -1)
    post_norm, down, down_bias = layer.post_attention_layernorm.weight, mlp.down_proj.weight, mlp.down_proj.bias
    if not fold:
        h, residual = add_rms_norm(linear(out, attn.o_proj.weight, attn.o_proj.bias), residual, post_norm, eps)
        return add_rms_norm(linear(silu_mul(linear(h, weights.gate_up)), down, down_bias), residual, next_norm, eps)
    hand_norms = FOLD_NORMS and residual.dtype in HANDED_NORM_DTYPES
    if hand_norms:
        residual, pending = linear_triton_norm_out(out, attn.o_proj.weight, attn.o_proj.bias, residual=residual,
                                                   norm=post_norm)
        act = linear_triton(pending.weighted, weights.gate_up, swiglu=True, norm_in=pending.squares, eps=eps)
    else:
        residual = linear_triton(out, attn.o_proj.weight, attn.o_proj.bias, residual=residual)
        act = linear_triton(rms_norm(residual, post_norm, eps), weights.gate_up, swiglu=True)
    if fold_next and hand_norms:
        residual, pending = linear_triton_norm_out(act, down, down_bias, residual=residual, norm=next_norm)
        return pending, residual
    residual = linear_triton(act, down, down_bias, residual=residual)
    return rms_norm(residual, next_norm, eps), residual


def run_fused_layers(cfg: ModelConfig, layers: Sequence[DecoderLayer], fused: Sequence[FusedWeights],
                     x: torch.Tensor, attend: Attend, final_norm: torch.Tensor,
                     keep: Collection[int] = ()) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The layers over x [T, hidden] (the embeddings): (the last layer's output normed with `final_norm`,
    that output, {i: layer i's output for i in keep}). Between two layers that fold, the norm is left
    pending from the first's down projection to the second's qkv projection."""
    folds = [folds_into_projections(x, layer, weights) for layer, weights in zip(layers, fused)]
    h = rms_norm(x, layers[0].input_layernorm.weight, cfg.rms_norm_eps)
    residual, kept = x, {}
    for i, (layer, weights) in enumerate(zip(layers, fused)):
        last = i + 1 == len(layers)
        h, residual = fused_layer(cfg, i, layer, weights, h, residual, attend,
                                  final_norm if last else layers[i + 1].input_layernorm.weight,
                                  fold=folds[i], fold_next=not last and folds[i + 1])
        if i in keep:
            kept[i] = residual
    assert isinstance(h, torch.Tensor)
    return h, residual, kept
