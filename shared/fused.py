"""The fused decoder layer both services' graphed forwards run: about ten launches a layer.

One GEMM for q/k/v and one for gate/up (the layer's projection weights concatenated once, the modules'
own weights becoming views of the result, so nothing is stored twice and the eager forward reads the
same memory), the residual add fused into each RMSNorm, RoPE fused with the write of k/v into a paged
pool, SiLU·mul in one kernel. Each projection goes through `kernels.skinny_linear.linear`: cuBLAS, but
for a few rows against a weight too large for L2 (a wide model's decode step) a kernel that streams it.
(Fusing SiLU·mul into the down projection, or the post-attention norm into gate/up, was measured slower
on the H200 in whole steps: every program of the GEMM recomputes the activation or the norm for its rows;
see the README's fifteenth session, and kernels/skinny_linear.py for the same at Qwen3-8B's widths.)
Where keys come from and how queries attend is the caller's: the target attends causally over its KV
cache, the DFlash drafter's block over its context pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specsplit.kernels.activation import silu_mul
from specsplit.kernels.norm import add_rms_norm, rms_norm
from specsplit.kernels.skinny_linear import linear
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


def fused_layer(cfg: ModelConfig, index: int, layer: DecoderLayer, weights: FusedWeights, h: torch.Tensor,
                residual: torch.Tensor, attend: Attend, next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm decoder layer. h: this layer's normed input, residual: its input. Returns the next
    layer's normed input (normed with `next_norm`: the next layer's input norm, or the final norm) and
    this layer's output."""
    attn = layer.self_attn
    qkv = linear(h, weights.qkv, weights.qkv_bias)
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q, k, v = (t.view(t.shape[0], -1, cfg.head_dim) for t in (q, k, v))
    if attn.q_norm is not None:
        q, k = rms_norm(q, attn.q_norm.weight, cfg.rms_norm_eps), rms_norm(k, attn.k_norm.weight, cfg.rms_norm_eps)
    out = attend(index, q, k, v)
    attended = linear(out.reshape(out.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
    h, residual = add_rms_norm(attended, residual, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
    mlp_out = linear(silu_mul(linear(h, weights.gate_up)), layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)
    return add_rms_norm(mlp_out, residual, next_norm, cfg.rms_norm_eps)


def first_norm(cfg: ModelConfig, layers: Sequence[DecoderLayer], x: torch.Tensor) -> torch.Tensor:
    """The first layer's normed input."""
    return rms_norm(x, layers[0].input_layernorm.weight, cfg.rms_norm_eps)


def next_norm_weight(layers: Sequence[DecoderLayer], final_norm: torch.nn.Module, index: int) -> torch.Tensor:
    return layers[index + 1].input_layernorm.weight if index + 1 < len(layers) else final_norm.weight
