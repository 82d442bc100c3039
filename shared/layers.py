"""Decoder building blocks shared by the target and the drafters: RMSNorm, RoPE, GQA attention, SwiGLU.

Parameter names equal HF checkpoint names (`self_attn.q_proj`, `mlp.gate_proj`, ...), so loading a
checkpoint is a name lookup. Tensors here are flat over tokens: [T, ...] with no batch dimension;
ragged batches are described by the caller.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch import nn

from specsplit.kernels import skinny_linear
from specsplit.kernels._triton import _switch
from specsplit.kernels.rope import rotary_tables
from specsplit.shared.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the input dtype, as HF Llama/Qwen3 do, so bf16 matches.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# Embedding rows by advanced indexing instead of F.embedding (SPECSPLIT_EMBED_BY_INDEXING=0, read at import, turns it
# off; a value that is no switch is refused). F.embedding is an index_select, and for up to 16 indices PyTorch takes
# its small-index kernel: 5 blocks of 128 threads for SmolLM2's 576 columns, each thread walking the indices one after
# another. A tree verify's 16 tokens and the drafter's block of 16 took 8-10 µs each so (H100, fifty-fifth session's
# in-process tree step at one stream), where 128 indices at eight streams took the vectorized gather, 2.4 µs. Indexing
# gathers every element in parallel whatever the count. On since the fifty-sixth session's H100 run
# (`bench/profile_step.py --draft-tree 15`, off and on alternating): trees of 15 at one stream 1.000 / 1.008 ms a step
# off, 0.995 / 0.989 on, GPU busy 1.640 / 1.641 against 1.631 / 1.631 ms; at eight streams 1.286 / 1.290 against 1.291
# / 1.288 (the same). Its GPU tests (the static target step and the drafter's static forwards against eager, the
# chained trees) passed with it.
EMBED_BY_INDEXING = _switch("SPECSPLIT_EMBED_BY_INDEXING", True)


def embed_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids]: the embeddings of token ids (any shape) from weight [vocab, hidden], as F.embedding gives."""
    if EMBED_BY_INDEXING:
        return weight[ids]
    return F.embedding(ids, weight)


def head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 logits x @ weight.T over the last dimension of x (weight [vocab, hidden]): the LM head.

    On CUDA with 16-bit weights one GEMM writes its float32 accumulator (`mm`'s out_dtype) instead of
    rounding it to 16 bits and converting after: the logits keep the accumulator's precision, and the
    conversion's launch goes. Measured on the H200 with SmolLM2's head (49,152 x 576, cold weights,
    `bench/lm_head_bench.py`): 24.4 µs against 38.9 at 128 rows (an eight-stream verify), 17.1 against 21.0
    at 16, 16.1 against 19.2 at one. Every logits path of the target and the drafters goes through here
    (a drafter's own logits under autograd keep F.linear, whose backward is torch's). At most 16 rows
    against a head too large for L2 with K >= 2048 (Qwen3-8B's 151,936 x 4,096 is 1.2 GB; never SmolLM2's)
    stream it through `kernels.skinny_linear` instead: its float32 sums run in another order than cuBLAS's,
    as cuBLAS's own kernels for other row counts do, so a step of few rows and one of many may differ in the
    logits' low bits (greedy tokens only at near-ties)."""
    if skinny_linear.takes_kernel(x, weight):
        return skinny_linear.linear_triton(x, weight, out_dtype=torch.float32)
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype and not grads:
        flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return flat.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight).float()


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.scaling_type == "linear":
        return (inv_freq / rope.factor).float()
    if rope.scaling_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary integer positions (positions need not be contiguous)."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] (`kernels.rope.rotary_tables`: one launch on a GPU where it is on)."""
        return rotary_tables(positions, self.inv_freq, dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def visibility_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool = True, window: int | None = None
) -> torch.Tensor:
    """[Tq, Tk] bool, True where query i may attend key j, judged by positions, not row indices."""
    diff = q_pos[:, None] - k_pos[None, :]
    visible = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        visible = visible & (diff < window)
        if not causal:
            visible = visible & (-diff < window)
    return visible


# cuDNN's attention builds an execution plan for every new shape it meets (about 3 ms of host time
# per call on an H200, measured), and prefill, decode over a growing cache and ragged batches bring
# new shapes all the time: at 30 layers that is ~100 ms a step. The other backends plan nothing.
_MASKED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with any backend but cuDNN's."""
    with sdpa_kernel(_MASKED_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention. q [Tq, Hq, D], k/v [Tk, Hkv, D], mask [Tq, Tk] bool → [Tq, Hq, D]."""
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)  # [Hq, Tq, D]
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)
    out = masked_sdpa(qh, kh, vh, mask, scale)
    return out.transpose(0, 1)


def padded_visibility(q_pos: torch.Tensor, q_valid: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor,
                      window: int | None) -> torch.Tensor:
    """[B, Tq, Tk] causal-by-position visibility over padded rows; padding queries see everything
    (their outputs are dropped), so no softmax row is empty."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    visible = k_valid[:, None, :] & (diff >= 0)
    if window is not None:
        visible = visible & (diff < window)
    return visible | ~q_valid[:, :, None]


def grouped_mask(visible: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Tq, Tk] → [B, 1, groups * Tq, Tk], the query layout `grouped_attention` folds GQA groups into."""
    return visible.repeat(1, groups, 1)[:, None]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """GQA over a padded batch. q [B, Tq, Hq, D], k/v [B, Hkv, Tk, D], mask from `grouped_mask` → [B, Tq, Hq, D].

    The query heads sharing a KV head are folded into the query axis, so keys and values are read
    as they lie instead of being repeated per query head.
    """
    batch, tq, hq, dim = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    qg = q.view(batch, tq, hkv, groups, dim).permute(0, 2, 3, 1, 4).reshape(batch, hkv, groups * tq, dim)
    out = masked_sdpa(qg, k, v, mask, scale)
    return out.view(batch, hkv, groups, tq, dim).permute(0, 3, 1, 2, 4).reshape(batch, tq, hq, dim)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn.reshape(attn.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# Mixes a layer's normed input into its attention output: (attention module, normed x) -> [T, hidden].
TokenMixer = Callable[[SelfAttention, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. Where keys and values come from is the caller's business (`mix`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, mix: TokenMixer) -> torch.Tensor:
        x = x + mix(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))
