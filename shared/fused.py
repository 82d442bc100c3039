"""The fused decoder layer both services' graphed forwards run: about ten launches a layer, or six.

One GEMM for q/k/v and one for gate/up (the layer's projection weights concatenated once, the modules'
own weights becoming views of the result, so nothing is stored twice and the eager forward reads the
same memory), the residual add fused into each RMSNorm, RoPE fused with the write of k/v into a paged
pool, SiLU·mul in one kernel. Each projection goes through `kernels.skinny_linear.linear`: cuBLAS, but
for a few rows against a weight too large for L2 (a wide model's decode step) a kernel that streams it.
Where every projection of a layer takes that kernel, it also does the norms, the residual adds and SiLU·mul
(`folds_into_projections`): the sum of squares and the norm's weight ride on the tiles it loads anyway,
and SiLU·mul and the residual on the tile it stores, so no program recomputes anything. (Fusing them into
cuBLAS's neighbours instead was measured slower on the H200: every program of a GEMM recomputed the
activation or the norm for its rows; see the README's fifteenth session and kernels/skinny_linear.py.)
Where keys come from and how queries attend is the caller's: the target attends causally over its KV
cache, the DFlash drafter's block over its context pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch

from specsplit.kernels.activation import silu_mul
from specsplit.kernels.norm import add_rms_norm, rms_norm
from specsplit.kernels.skinny_linear import linear, linear_triton, takes_kernel
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


# (layer index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> attention output [T, Hq, D]; q and k
# are normed (Qwen3) but not rotated: the attention writes k/v where they belong and rotates.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


FOLD = True  # benches set it False to compare a step with the folds and without


def folds_into_projections(x: torch.Tensor, layer: DecoderLayer, weights: FusedWeights) -> bool:
    """Whether, for x's rows, every projection of this layer takes the few-rows kernel, which then also does
    the layer's norms (on the way in), its residual adds and SiLU·mul (on the way out): six launches a layer
    instead of ten. Each of the four small kernels cost 1.3-2.2 µs and ~0.45 µs of gap after it at Qwen3-8B's
    widths, where the kernel's extra work is a multiply and a sum per loaded tile."""
    attn, mlp = layer.self_attn, layer.mlp
    return FOLD and all(takes_kernel(x, weight, bias) for weight, bias in (
        (weights.qkv, weights.qkv_bias), (attn.o_proj.weight, attn.o_proj.bias), (weights.gate_up, None),
        (mlp.down_proj.weight, mlp.down_proj.bias)))


def fused_layer(cfg: ModelConfig, index: int, layer: DecoderLayer, weights: FusedWeights, h: torch.Tensor | None,
                residual: torch.Tensor, attend: Attend,
                next_norm: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One pre-norm decoder layer. residual: its input; h: that normed with the layer's input norm, or None
    where the layer folds (`folds_into_projections`) and its qkv projection norms on the way in. Returns the
    next layer's normed input (normed with `next_norm`: the next layer's input norm, or the final norm; None
    where next_norm is None, left to the next layer, which must fold) and this layer's output."""
    attn, mlp, eps = layer.self_attn, layer.mlp, cfg.rms_norm_eps
    fold = folds_into_projections(residual, layer, weights)
    assert fold or (h is not None and next_norm is not None), "only a folding layer leaves a norm to another"
    if h is None:
        qkv = linear_triton(residual, weights.qkv, weights.qkv_bias, norm=layer.input_layernorm.weight, eps=eps)
    else:
        qkv = linear(h, weights.qkv, weights.qkv_bias)
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q, k, v = (t.view(t.shape[0], -1, cfg.head_dim) for t in (q, k, v))
    if attn.q_norm is not None:
        q, k = rms_norm(q, attn.q_norm.weight, eps), rms_norm(k, attn.k_norm.weight, eps)
    out = attend(index, q, k, v)
    out = out.reshape(out.shape[0], -1)
    down, down_bias = mlp.down_proj.weight, mlp.down_proj.bias
    if fold:
        residual = linear_triton(out, attn.o_proj.weight, attn.o_proj.bias, residual=residual)
        act = linear_triton(residual, weights.gate_up, norm=layer.post_attention_layernorm.weight, eps=eps,
                            swiglu=True)
        if next_norm is None:
            return None, linear_triton(act, down, down_bias, residual=residual)
    else:
        h, residual = add_rms_norm(linear(out, attn.o_proj.weight, attn.o_proj.bias), residual,
                                   layer.post_attention_layernorm.weight, eps)
        act = silu_mul(linear(h, weights.gate_up))
    return add_rms_norm(linear(act, down, down_bias), residual, next_norm, eps)


def run_fused_layers(cfg: ModelConfig, layers: Sequence[DecoderLayer], fused: Sequence[FusedWeights],
                     x: torch.Tensor, attend: Attend, final_norm: torch.Tensor,
                     keep: Collection[int] = ()) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The layers over x [T, hidden] (the embeddings): (the last layer's output normed with `final_norm`,
    that output, {i: layer i's output for i in keep}). Between two layers that fold, the first's down
    projection adds the residual and the second's qkv projection norms it; otherwise one kernel does both."""
    folds = [folds_into_projections(x, layer, weights) for layer, weights in zip(layers, fused)]
    h = None if folds[0] else rms_norm(x, layers[0].input_layernorm.weight, cfg.rms_norm_eps)
    residual, kept = x, {}
    for i, (layer, weights) in enumerate(zip(layers, fused)):
        leave_next = i + 1 < len(layers) and folds[i] and folds[i + 1]
        next_norm = None if leave_next else (layers[i + 1].input_layernorm.weight if i + 1 < len(layers)
                                             else final_norm)
        h, residual = fused_layer(cfg, i, layer, weights, h, residual, attend, next_norm)
        if i in keep:
            kept[i] = residual
    return h, residual, kept
