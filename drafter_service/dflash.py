"""DFlash block-diffusion drafter (z-lab `DFlashDraftModel` format): γ-1 drafts from one forward.

Math, as z-lab's reference: context features c = hidden_norm(fc(rows)), rows being the target's
layer outputs at `target_layer_ids`, concatenated. The block [anchor, mask × (γ-1)] at positions
p..p+γ-1 is embedded with the target's embedding; every layer's queries come from the block and its
keys/values are [k_norm(k_proj(c)) ; block keys] and [v_proj(c) ; block values], the same c for every
layer, RoPE at each row's stamped position. Attention is non-causal, except in `sliding_attention`
layers (causal with the window). Drafts are the argmax of the block rows 1..γ-1, unshifted.

Context K/V depend only on c, so they are computed once per row when it is committed and written
into a paged pool (`context_pool`); a propose runs only the γ block rows, which read the pool in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specsplit.drafter_service.base import (
    Append, Draft, Drafter, DraftVocab, SequenceState, batch_allowed, batched_attention, pad_rows, pick, proposals,
    valid_rows, visibility,
)
from specsplit.drafter_service.context_pool import ContextPool, ring_size
from specsplit.drafter_service.graphs import ContextGraphs, GraphDrafts, ProposeGraphs
from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.drafter_service.tree_scores import TreeScores
from specsplit.kernels.norm import rms_norm
from specsplit.kernels.paged_attention import paged_attention
from specsplit.kernels import rope
from specsplit.kernels.rope import rope_and_cache_write
from specsplit.kernels.top_k import top_k_logp
from specsplit.kernels.workspace import arrival_counters
from specsplit.shared.config import ModelConfig
from specsplit.shared.errors import CheckpointError, InvalidRequest, StateConflict
from specsplit.shared.fused import FusedWeights, PagedAttend, fuse_projections, run_fused_layers
from specsplit.shared.layers import DecoderLayer, RMSNorm, RotaryEmbedding, SelfAttention, TokenMixer, head_logits
from specsplit.shared.proposer import DrafterKind, DrafterSpec, FeatureKind, Proposal, ProposeRequest
from specsplit.shared.ragged import ragged_arange

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class RefinePolicy:
    """How many leading drafts of a block's first pass a refining second pass is given (`embed_block`'s
    reveal): `fixed` of them, or those up to the first the drafter gave less than `confident` probability,
    at most `most`. The second pass drafts the rows past them anew, each now seeing the drafts before it,
    which decide whether it counts at all: a draft is accepted only after all those before it were.

    Written `2` (two given) or `p0.6` (leading drafts of probability ≥ 0.6; `p0.6:3`, at most three)."""

    fixed: int | None = None
    confident: float | None = None
    most: int | None = None

    def __post_init__(self) -> None:
        if (self.fixed is None) == (self.confident is None):
            raise InvalidRequest("a refine policy reveals a fixed count or the confident drafts, one of the two")
        if self.fixed is not None and self.fixed < 1:
            raise InvalidRequest(f"a refine policy reveals at least one draft, got {self.fixed}")
        if self.confident is not None and not 0 < self.confident < 1:
            raise InvalidRequest(f"a refine policy's confidence lies in (0, 1), got {self.confident}")
        if self.most is not None and self.most < 1:
            raise InvalidRequest(f"a refine policy's cap is at least one draft, got {self.most}")

    @staticmethod
    def parse(text: str) -> "RefinePolicy":
        try:
            if text.startswith("p"):
                confident, _, most = text[1:].partition(":")
                numbers = {"confident": float(confident), "most": int(most) if most else None}
            else:
                numbers = {"fixed": int(text)}
        except ValueError:
            raise InvalidRequest(f"a refine policy is a count (2) or p<probability>[:<cap>] (p0.6, p0.6:3), "
                                 f"got {text!r}") from None
        return RefinePolicy(**numbers)

    def __str__(self) -> str:
        if self.fixed is not None:
            return str(self.fixed)
        return f"p{self.confident:g}" + ("" if self.most is None else f":{self.most}")

    def reveal(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [..., γ-1], the first pass's probability of each draft → counts [...] in 0..γ-2."""
        top = probs.shape[-1] - 1
        if self.fixed is not None:
            count = torch.full(probs.shape[:-1], self.fixed, dtype=torch.long, device=probs.device)
        else:
            count = (probs >= self.confident).long().cumprod(-1).sum(-1)
        return count.clamp(min=0, max=max(0, min(top, self.most or top)))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default capture layers: the middle one, or evenly spaced over layers 1..n-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def _int_list(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value or \
            any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise CheckpointError(f"{field} must be a non-empty list of integers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class DFlashConfig:
    decoder: ModelConfig  # the drafter's own layers (Qwen3: per-head q/k norm)
    block_size: int  # γ
    target_layer_ids: tuple[int, ...]
    mask_token_id: int  # a target-vocabulary id filling the block after the anchor
    num_target_layers: int | None = None
    draft_vocab_size: int | None = None  # set when the checkpoint ships lm_head + d2t
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.decoder.model_type != "qwen3":
            raise CheckpointError(f"model_type must be 'qwen3' for DFlash, got {self.decoder.model_type!r}")
        if self.decoder.attention_bias:
            raise CheckpointError("attention_bias must be false for DFlash")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise CheckpointError(f"block_size must be an integer ≥ 2, got {self.block_size!r}")
        layers = self.num_target_layers
        if layers is not None and any(not 0 <= i < layers for i in self.target_layer_ids):
            raise CheckpointError(
                f"dflash_config.target_layer_ids {list(self.target_layer_ids)} must lie in 0..{layers - 1}"
            )
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) \
                or not 0 <= self.mask_token_id < self.decoder.vocab_size:
            raise CheckpointError(f"dflash_config.mask_token_id {self.mask_token_id!r} is outside the "
                                  f"vocabulary of {self.decoder.vocab_size}")
        if self.draft_vocab_size is not None and self.draft_vocab_size <= 0:
            raise CheckpointError("draft_vocab_size must be positive")

    @property
    def feature_dim(self) -> int:
        return len(self.target_layer_ids) * self.decoder.hidden_size

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> "DFlashConfig":
        """Read a z-lab config.json; like the reference, dflash_config fields win over top-level ones."""
        extra = raw.get("dflash_config")
        if not isinstance(extra, dict):
            raise CheckpointError("config.json: dflash_config must be an object")

        def value(name: str, default: Any = None) -> Any:
            return extra.get(name, raw.get(name, default))

        if value("target_layer_ids") is None:
            raise CheckpointError("config.json lacks dflash_config.target_layer_ids")
        if value("mask_token_id") is None:
            raise CheckpointError("config.json lacks dflash_config.mask_token_id")
        softcap = value("final_logit_softcapping")
        try:
            return DFlashConfig(
                decoder=ModelConfig.from_hf(raw),
                block_size=value("block_size", 16),
                target_layer_ids=_int_list(value("target_layer_ids"), "dflash_config.target_layer_ids"),
                mask_token_id=value("mask_token_id"),
                num_target_layers=raw.get("num_target_layers"),
                draft_vocab_size=raw.get("draft_vocab_size"),
                input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                output_multiplier=float(value("output_multiplier", 1.0)),
                final_logit_softcapping=None if softcap is None else float(softcap),
            )
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json has a malformed DFlash field: {exc}") from None

    def to_hf(self) -> dict[str, Any]:
        out = self.decoder.to_hf()
        if not self.decoder.layer_types:
            out.pop("sliding_window", None)
        elif "sliding_attention" in self.decoder.layer_types:
            out["use_sliding_window"] = True  # else transformers' Qwen3Config drops sliding_window
        extra: dict[str, Any] = {"target_layer_ids": list(self.target_layer_ids),
                                 "mask_token_id": self.mask_token_id}
        for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                              ("final_logit_softcapping", None)):
            if getattr(self, name) != default:
                extra[name] = getattr(self, name)
        out.update(architectures=[ARCHITECTURE], block_size=self.block_size, dflash_config=extra,
                   attention_bias=False, tie_word_embeddings=False, hidden_act="silu")
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        return out

    def check_target(self, info: TargetInfo) -> None:
        """Refuse a drafter made for another target."""
        if self.decoder.hidden_size != info.hidden_size:
            raise CheckpointError(f"hidden_size {self.decoder.hidden_size} ≠ the target's {info.hidden_size}")
        if self.decoder.vocab_size != info.vocab_size:
            raise CheckpointError(f"vocab_size {self.decoder.vocab_size} ≠ the target's {info.vocab_size}")
        if self.num_target_layers is not None and self.num_target_layers != info.num_hidden_layers:
            raise CheckpointError(f"num_target_layers {self.num_target_layers} ≠ the target's "
                                  f"{info.num_hidden_layers} layers")
        bad = [i for i in self.target_layer_ids if not 0 <= i < info.num_hidden_layers]
        if bad:
            raise CheckpointError(f"dflash_config.target_layer_ids {bad} are outside the target's "
                                  f"layers 0..{info.num_hidden_layers - 1}")


@dataclass(frozen=True)
class BlockContext:
    """The batch's cached context, padded to the longest (the eager reference's input)."""

    k: torch.Tensor  # [B, N, layers, Hkv, D]
    v: torch.Tensor  # [B, N, layers, Hkv, D]
    pos: torch.Tensor  # [B, N] stamped positions
    valid: torch.Tensor  # [B, N] False on padding


@dataclass(frozen=True)
class PagedContext:
    """The batch's context where it lies, in the pool (the propose forward's input).

    Positions are read through `tables` relative to `base`: a sequence's table is its ring repeated, so
    shifting every position by a multiple of the ring's period changes no slot, and the shift keeps
    them within the table however long the sequence has run.
    """

    k_pool: torch.Tensor  # [layers, blocks, block_size, Hkv, D]
    v_pool: torch.Tensor  # [layers, blocks, block_size, Hkv, D]
    tables: torch.Tensor  # [B, width] int32: each sequence's ring, repeated
    base: torch.Tensor  # [B] a multiple of the ring's period, at most the oldest visible position
    window: int  # context rows a block sees: positions p - window .. p - 1


class DFlashModel(nn.Module):
    """The drafter's weights; parameter names equal the checkpoint's tensor names."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        dec = cfg.decoder
        self.cfg = cfg
        self.fc = nn.Linear(cfg.feature_dim, dec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(dec) for _ in range(dec.num_hidden_layers))
        self.norm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(dec.head_dim, dec.rope)
        vocab = cfg.draft_vocab_size
        self.lm_head = nn.Linear(dec.hidden_size, vocab, bias=False) if vocab else None
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long) if vocab else None)

    def context(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed rows [n, feature_dim] at positions [n] → K and V [layers, n, Hkv, D]."""
        feat = self.hidden_norm(self.fc(rows))
        cos, sin = self.rotary_emb(positions, feat.dtype)
        kv = [layer.self_attn.key_value(feat, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def context_into(self, rows: torch.Tensor, positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """`context`, written into the pool's `slots` [n] (k/v_pool [layers, blocks, block_size, Hkv, D])
        with a few launches: every layer's k and v from one GEMM (the rows enter each layer's
        attention the same way), then per layer its k norm and one kernel that rotates k and writes
        k and v into their slots. The graphed context forward; `context` + `ContextPool.write` is its
        reference."""
        dec = self.cfg.decoder
        n, layers = rows.shape[0], len(self.layers)
        feat = rms_norm(self.fc(rows), self.hidden_norm.weight, dec.rms_norm_eps)
        cos, sin = self.rotary_emb(positions, feat.dtype)
        weight, bias = self.context_projection()
        kv = F.linear(feat, weight, bias).view(n, layers, 2, dec.num_key_value_heads, dec.head_dim)
        norms = [layer.self_attn.k_norm is not None for layer in self.layers]
        if rope.CONTEXT_IN_ONE_LAUNCH and len(set(norms)) == 1:  # k norm, rotation and writes in one launch
            rope.context_kv_write(kv, self.context_k_norms() if norms[0] else None, dec.rms_norm_eps, cos, sin,
                                  k_pool, v_pool, slots)
            return
        no_queries = feat.new_empty((n, 0, dec.head_dim))
        for i, layer in enumerate(self.layers):
            k, v = kv[:, i, 0], kv[:, i, 1]
            if layer.self_attn.k_norm is not None:
                k = rms_norm(k, layer.self_attn.k_norm.weight, dec.rms_norm_eps)
            rope_and_cache_write(no_queries, k, v, cos, sin, k_pool[i], v_pool[i], slots)

    def context_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer's k and v projections, stacked [layers * 2 * kv_size, hidden] (and their biases):
        copies made on first use, for the inference-only graphed forwards (the layers' own k/v weights
        are views of their fused qkv projection, so they cannot also be views of this)."""
        if getattr(self, "_context_projection", None) is None:
            attns = [layer.self_attn for layer in self.layers]
            weight = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)]).detach().clone()
            bias = None if attns[0].k_proj.bias is None else torch.cat(
                [b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)]).detach().clone()
            self._context_projection = (weight, bias)
        return self._context_projection

    def context_k_norms(self) -> torch.Tensor:
        """Every layer's k norm weight, stacked [layers, head_dim]: a copy made on first use, as
        `context_projection`'s (every layer has a k norm)."""
        if getattr(self, "_context_k_norms", None) is None:
            weights = [layer.self_attn.k_norm.weight for layer in self.layers]
            self._context_k_norms = torch.stack(weights).detach().clone()
        return self._context_k_norms

    def embed_block(self, anchors: torch.Tensor, head: TargetHead, revealed: torch.Tensor | None = None,
                    reveal: torch.Tensor | None = None) -> torch.Tensor:
        """anchors [B] → [B, γ, hidden]: embeddings of [anchor, mask × (γ-1)].

        With `revealed` [B, γ-1] (token ids) and `reveal` [B] (counts r, 0 ≤ r ≤ γ-2), rows 1..r hold
        revealed[:, :r] instead of the mask: a refining pass's block, its first r drafts given."""
        ids = torch.full((anchors.shape[0], self.cfg.block_size), self.cfg.mask_token_id, dtype=torch.long,
                         device=anchors.device)
        ids[:, 0] = anchors
        if reveal is not None:
            given = torch.arange(1, self.cfg.block_size, device=ids.device) <= reveal.to(ids.device)[:, None]
            ids[:, 1:] = torch.where(given, revealed.to(ids.device, torch.long), ids[:, 1:])
        emb = F.embedding(ids.to(head.embed.device), head.embed) * self.cfg.input_embedding_scale
        return emb.to(self.fc.weight.device, self.fc.weight.dtype)

    def block_hidden(self, block: torch.Tensor, positions: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        """block [B, γ, hidden] with anchors at positions [B] → final-normed hidden [B, γ, hidden]."""
        batch, gamma, hidden = block.shape
        q_pos = positions[:, None] + torch.arange(gamma, device=positions.device)  # [B, γ]
        cos, sin = self.rotary_emb(q_pos.reshape(-1), block.dtype)
        k_pos = torch.cat([ctx.pos, q_pos], 1)  # [B, N + γ]
        k_valid = torch.cat([ctx.valid, torch.ones_like(q_pos, dtype=torch.bool)], 1)
        x = block.reshape(batch * gamma, hidden)
        for i, layer in enumerate(self.layers):
            window = self.cfg.decoder.layer_window(i)
            visible = visibility(q_pos, k_pos, k_valid, causal=window is not None, window=window)
            x = layer(x, _block_mixer(ctx.k[:, :, i], ctx.v[:, :, i], cos, sin, visible, batch))
        return self.norm(x).view(batch, gamma, hidden)

    def block_hidden_paged(self, block: torch.Tensor, positions: torch.Tensor, ctx: PagedContext,
                           fused: Sequence[FusedWeights] | None = None) -> torch.Tensor:
        """`block_hidden` reading the context in place: each layer writes the block's K/V into the slots
        of positions p..p+γ-1 (past the committed context; the next commit overwrites them) and attends
        over the pool. Graph-shaped: no host sync, shapes fixed by the batch. With `fused` (the layers'
        concatenated projections) the layers run as `shared.fused` layers: about ten launches each."""
        batch, gamma, hidden = block.shape
        q_pos = positions[:, None] + torch.arange(gamma, device=positions.device)  # [B, γ]
        cos, sin = self.rotary_emb(q_pos.reshape(-1), block.dtype)
        local = q_pos - ctx.base[:, None]  # [B, γ] positions as the tables index them
        size = ctx.k_pool.shape[2]
        slots = ctx.tables.gather(1, local // size).long() * size + local % size
        # The block is non-causal: every query masks as the block's last position, so it sees the whole
        # block and the `window` context rows before it. RoPE still uses each row's own position.
        last = local[:, -1:].expand(-1, gamma)
        x = block.reshape(batch * gamma, hidden)
        if fused is not None:
            return self._fused_layers(x, cos, sin, slots.view(-1), local, last, ctx, fused).view(batch, gamma, hidden)
        for i, layer in enumerate(self.layers):
            sliding = self.cfg.decoder.layer_window(i)
            mask_pos, window = (last, ctx.window + gamma) if sliding is None else (local, sliding)
            mix = _paged_mixer(ctx.k_pool[i], ctx.v_pool[i], ctx.tables, slots.view(-1), mask_pos, window, cos, sin)
            x = layer(x, mix)
        return self.norm(x).view(batch, gamma, hidden)

    def _fused_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                      local: torch.Tensor, last: torch.Tensor, ctx: PagedContext,
                      fused: Sequence[FusedWeights]) -> torch.Tensor:
        """`block_hidden_paged`'s layers, fused; returns the final-normed hidden [B·γ, hidden]."""
        dec, gamma = self.cfg.decoder, local.shape[1]

        def attention(i: int, q: torch.Tensor) -> torch.Tensor:  # q rotated, the block's k and v in the pool
            sliding = dec.layer_window(i)
            mask_pos, window = (last, ctx.window + gamma) if sliding is None else (local, sliding)
            return paged_attention(q.view(*local.shape, *q.shape[1:]), ctx.k_pool[i], ctx.v_pool[i], ctx.tables,
                                   mask_pos, self.layers[i].self_attn.scale, window).flatten(0, 1)

        attend = PagedAttend(cos, sin, ctx.k_pool, ctx.v_pool, slots, dec.rms_norm_eps, attention)
        return run_fused_layers(dec, self.layers, fused, x, attend, self.norm.weight)[0]

    def logits(self, hidden: torch.Tensor, head: TargetHead) -> torch.Tensor:
        """Draft-vocabulary logits (float32), scaled and soft-capped as the reference's compute_logits."""
        weight = head.lm_head if self.lm_head is None else self.lm_head.weight
        logits = head_logits(hidden.to(weight.device, weight.dtype), weight)
        if self.cfg.output_multiplier != 1.0:  # a multiply by 1 is exact: no launch for it
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _block_mixer(ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 visible: torch.Tensor, batch: int) -> TokenMixer:
    """Block queries attend [cached context ; block] keys. ctx_k/v [B, N, Hkv, D], visible [B, γ, N + γ]."""

    def mix(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, cos, sin)
        k, v = attn.key_value(x, cos, sin)
        q, k, v = (t.view(batch, -1, *t.shape[1:]) for t in (q, k, v))
        out = batched_attention(q, torch.cat([ctx_k, k], 1), torch.cat([ctx_v, v], 1), visible, attn.scale)
        return attn.output(out.reshape(-1, *out.shape[2:]))

    return mix


def _paged_mixer(k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor,
                 mask_pos: torch.Tensor, window: int, cos: torch.Tensor, sin: torch.Tensor) -> TokenMixer:
    """Block queries attend their sequence's pool slots. k/v_pool [blocks, block_size, Hkv, D] of one
    layer, slots [B·γ] the block rows' own, mask_pos [B, γ] the position each query masks as."""

    def mix(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, cos, sin)
        k, v = attn.key_value(x, cos, sin)
        k_pool.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        v_pool.view(-1, *v.shape[1:]).index_copy_(0, slots, v)
        q = q.view(*mask_pos.shape, *q.shape[1:])  # [B, γ, Hq, D]
        out = paged_attention(q, k_pool, v_pool, tables, mask_pos, attn.scale, window)
        return attn.output(out.reshape(-1, *out.shape[2:]))

    return mix


@dataclass(frozen=True)
class ChainBatch:
    """Sequences of a chained step as the device reads them (`DFlashDrafter.chain_batch`)."""

    seq_ids: list[int]
    states: list["DFlashState"]
    tables: list[torch.Tensor]  # each state's table, as it was when stacked
    stacked: torch.Tensor  # [B, table_width] int32
    periods: torch.Tensor  # [B] int64: each ring's positions (blocks x block size)


@dataclass
class DFlashState(SequenceState):
    window: int = 0  # W = min(spec.window, budget): the newest W committed rows are visible
    ring: list[int] = field(default_factory=list)  # pool blocks; logical block j lives in ring[j % len(ring)]
    table: torch.Tensor | None = None  # [DFlashDrafter.table_width] int32 on the device: the ring, repeated

    @property
    def rows_held(self) -> int:
        return min(self.next_pos, self.window)

    def held_positions(self) -> np.ndarray:
        return np.arange(self.next_pos - self.rows_held, self.next_pos)


class DFlashDrafter(Drafter):
    """A DFlash model behind the Proposer verbs; context K/V in a paged pool, a window's ring per sequence.

    `pool_blocks` sizes the pool (blocks of 16 positions); the default holds `max_batch` sequences at the
    full window. An alloc the pool cannot serve raises CapacityExceeded, which a target takes as "decode
    this sequence without drafts".

    With `refine`, every block is drafted twice, the second pass given the first's leading drafts as the
    policy says (`RefinePolicy`). That runs the eager forwards only (no static forwards, no chained steps):
    it is for measuring a drafter trained for it (`train-drafter --reveal-share`) against teacher forcing.
    """

    def __init__(self, model: DFlashModel, head: TargetHead, *, window: int = 4096, max_batch: int = 64,
                 cuda_graphs: bool = True, pool_blocks: int | None = None,
                 refine: RefinePolicy | None = None, tree_scores: TreeScores | None = None) -> None:
        cfg = model.cfg
        if head.hidden_size != cfg.decoder.hidden_size or head.vocab_size != cfg.decoder.vocab_size:
            raise CheckpointError(f"target head [{head.vocab_size}, {head.hidden_size}] does not fit a drafter "
                                  f"for [{cfg.decoder.vocab_size}, {cfg.decoder.hidden_size}]")
        if window < 1:
            raise CheckpointError("the DFlash context window must hold at least one row")
        spec = DrafterSpec(
            kind=DrafterKind.DFLASH, feature=FeatureKind.LAYER_CONCAT, feature_dim=cfg.feature_dim,
            hidden_size=cfg.decoder.hidden_size, vocab_size=cfg.decoder.vocab_size,
            max_drafts=cfg.block_size - 1, block_size=cfg.block_size, target_layer_ids=cfg.target_layer_ids,
            max_batch=max_batch, window=window,
        )
        weight = model.fc.weight
        super().__init__(spec, head, DraftVocab(model.d2t, cfg.decoder.vocab_size),
                         dtype=weight.dtype, device=weight.device)
        self.model = model
        dec = cfg.decoder
        if pool_blocks is None:
            pool_blocks = max_batch * ring_size(window, cfg.block_size)
        self.pool = ContextPool(pool_blocks,
                                layers=dec.num_hidden_layers, kv_heads=dec.num_key_value_heads,
                                head_dim=dec.head_dim, dtype=self.dtype, device=self.device)
        # Two periods of the longest ring: positions shifted below one period (see `_base`) stay within it.
        self.table_width = 2 * self.pool.ring_size(window, cfg.block_size)
        self.context_graphs: ContextGraphs | None = None
        self.propose_graphs: ProposeGraphs | None = None
        self._chain: ChainBatch | None = None  # the last chained step's sequences (see chain_batch)
        self._chain_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per batch size: tables, periods
        # Arrival counters of the chained tree candidates' one-launch top-k (kernels.workspace): a row each
        self._top_k_workspace = arrival_counters(max_batch * cfg.block_size, self.device)
        self.refine = refine
        self.tree_scores: TreeScores | None = None  # its candidates' scores (None: their log-probabilities)
        self.use_tree_scores(tree_scores)
        if cuda_graphs and self.device.type == "cuda" and refine is None:
            self.use_static_forwards(use_graphs=True)

    def use_tree_scores(self, scores: TreeScores | None) -> None:
        """Score the draft-tree candidates this drafter answers so (`tree_scores`; None: their log-probabilities).
        Set before a chained step's graph captures them."""
        if scores is not None and scores.rows != self.spec.max_drafts:
            raise CheckpointError(f"tree scores for {scores.rows} rows, the drafter drafts {self.spec.max_drafts}")
        if getattr(self, "_tree_scores_answered", False) and scores is not self.tree_scores:
            # (a chained step's graph may hold the candidates as they were scored: it would go on so)
            raise StateConflict("tree scores are set before the drafter answers any candidates")
        self.tree_scores = scores
        self._tree_score_params = None if scores is None else scores.on(self.device)

    def use_static_forwards(self, *, use_graphs: bool) -> None:
        """Run the context and block forwards over static buffers, as CUDA graphs when `use_graphs`
        (captured per size bucket on first use). Without graphs it is the CPU test of the same code."""
        pool = torch.cuda.graph_pool_handle() if use_graphs else None
        rows = self.spec.max_batch * self.spec.block_size
        self.context_graphs = ContextGraphs(self.model, self.pool, max_rows=rows, use_graphs=use_graphs, pool=pool,
                                            fused=self.pages_fit())
        if self.pages_fit():
            scratch = torch.full((self.table_width,), self.pool.scratch, dtype=torch.int32, device=self.device)
            self.propose_graphs = ProposeGraphs(self.model, self.vocab.table, self.pool, scratch,
                                                max_batch=self.spec.max_batch, window=self.spec.window,
                                                use_graphs=use_graphs, pool=pool, staging=self.staging,
                                                fused=fuse_projections(self.model, self.model.layers))

    def pages_fit(self) -> bool:
        """Whether the paged block forward equals `block_hidden` for this model: a sliding layer wider
        than the ctx window would see positions that slid out of it (they stay in the ring a while),
        and the Triton kernel needs a power-of-two head_dim of at least 16."""
        dec = self.model.cfg.decoder
        windows = [dec.layer_window(i) for i in range(dec.num_hidden_layers)]
        if any(w is not None and w > self.spec.window + 1 for w in windows):
            return False
        dim = dec.head_dim
        return self.device.type != "cuda" or (dim >= 16 and dim & (dim - 1) == 0)

    def forget_head(self, head: TargetHead) -> None:
        """A target that leaves takes its head: drop the graphs made over it."""
        if self.propose_graphs is not None:
            self.propose_graphs.forget(head)

    # -- the pool --

    def new_state(self, budget: int) -> DFlashState:
        window = min(self.spec.window, budget)
        ring = self.pool.take(self.pool.ring_size(window, self.spec.block_size))
        return DFlashState(budget, window=window, ring=ring, table=self._table(ring))

    def release(self, state: DFlashState) -> None:
        self.pool.give(state.ring)
        state.ring, state.table = [], None

    def _table(self, ring: list[int]) -> torch.Tensor:
        return self.staging.put([ring[i % len(ring)] for i in range(self.table_width)]).to(torch.int32)

    def _base(self, state: DFlashState, position: int) -> int:
        """The largest multiple of the ring's period at or below the oldest position a block at
        `position` sees: relative to it, the block's positions stay below two periods."""
        period = len(state.ring) * self.pool.block_size
        return max(position - self.spec.window, 0) // period * period

    def held(self, state: DFlashState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The visible context, read from the pool: positions [n], K and V [n, layers, Hkv, D]."""
        positions = state.held_positions()
        pos, slots = self.staging.put([positions, self.pool.slots(state.ring, positions)])
        k, v = self.pool.read(slots)
        return pos, k.transpose(0, 1), v.transpose(0, 1)

    # -- verbs' model math --

    defers_appends = True  # a context row's K/V depend on that row alone

    def append_rows(self, state: DFlashState, tokens: list[int], rows: torch.Tensor, base_pos: int) -> None:
        self.append_rows_batch([Append(state, tokens, rows, base_pos)])

    def append_rows_batch(self, appends: Sequence[Append]) -> None:
        """One context forward for every sequence's new rows, written into their pool slots. Only rows
        still in the window once all of a sequence's appends are in are computed: it keeps the forward
        short, and two of its rows never share a slot. A sequence freed (or its KV taken and freed)
        inside a batched block has released its ring: its rows go with it."""
        appends = [a for a in appends if a.state.ring]
        if not appends:
            return
        ends = {id(a.state): a.base_pos + a.rows.shape[0] for a in appends}  # the last append's end wins
        size = self.pool.block_size
        # Per append only scalars and the ring blocks its rows touch; positions and slots of the whole
        # batch are then a few array ops (a step appends to every sequence of the batch).
        kept, firsts, lasts, offsets, blocks = [], [], [], [], []
        for a in appends:
            end = a.base_pos + a.rows.shape[0]
            first = max(a.base_pos, ends[id(a.state)] - a.state.window)
            if first >= end:
                continue
            kept.append(a.rows[first - a.base_pos:] if first > a.base_pos else a.rows)
            ring, low = a.state.ring, first // size
            firsts.append(first)
            lasts.append(end)
            offsets.append(len(blocks) - low)  # blocks[offset + j] is the append's logical block j
            blocks.extend(ring[j % len(ring)] for j in range(low, (end - 1) // size + 1))
        if not kept:
            return
        counts = np.asarray(lasts, dtype=np.int64) - firsts
        positions = np.repeat(np.asarray(firsts, dtype=np.int64), counts) + ragged_arange(counts)
        physical = np.asarray(blocks, dtype=np.int64)[np.repeat(np.asarray(offsets, dtype=np.int64), counts)
                                                      + positions // size]
        slots = physical * size + positions % size
        rows = torch.cat(kept) if len(kept) > 1 else kept[0]
        graphs = self.context_graphs
        if graphs is not None:  # (more rows than its largest bucket, a long prompt's: in pieces, each row alone)
            most = graphs.buckets[-1]
            for at in range(0, rows.shape[0], most):
                graphs(rows[at:at + most], positions[at:at + most], slots[at:at + most], self.staging)
        else:
            pos, slot = self.staging.put([positions, slots])
            self.pool.write(slot, *self.model.context(rows, pos))

    def drop_speculative(self, state: DFlashState) -> None:
        """DFlash keeps nothing speculative: a propose's block K/V lie past the committed positions."""

    def fit_budget(self, state: DFlashState, fresh: DFlashState) -> None:
        """A ring too small for the new window gives way to the fresh state's, sized for it: the held
        rows move there, and the fresh state (released by the caller) leaves with the small ring."""
        window = min(self.spec.window, fresh.budget)
        if self.pool.ring_size(window, self.spec.block_size) > len(state.ring):
            positions = state.held_positions()
            src, dst = self.staging.put([self.pool.slots(state.ring, positions), self.pool.slots(fresh.ring, positions)])
            self.pool.write(dst, *self.pool.read(src))
            state.ring, fresh.ring = fresh.ring, state.ring
            state.table, fresh.table = fresh.table, state.table
        state.window = window

    def _graph_draft(self, batch: Sequence[Draft]) -> GraphDrafts | None:
        """Drafts [B, γ-1] on the device from the static block forward, or None when the batch does
        not take it (a bitmask, a head on another device, no static forwards)."""
        graphs = self.propose_graphs
        if graphs is None or self.refine is not None or any(d.allowed is not None for d in batch) \
                or self.head.embed.device != self.device:
            return None
        states = [d.state for d in batch]
        positions = [d.request.position for d in batch]
        return graphs(self.head, [d.request.last_token for d in batch], positions,
                      [self._base(s, p) for s, p in zip(states, positions)], [s.table for s in states])

    def draft_on_device(self, batch: Sequence[Draft]) -> torch.Tensor | None:
        drafted = self._graph_draft(batch)
        # A copy, made right after the replay: a graph's outputs live in the graph memory pool this
        # drafter's graphs share, where a graph captured earlier may keep its intermediates, so the
        # next context-forward replay (a prefill admitted before the verify reads these drafts) could
        # overwrite them.
        return None if drafted is None else drafted.tokens.clone()

    # -- chained steps: an in-process engine queues speculative steps back to back on the device, each
    # fed by the last one's picks, and reads their outcomes one step behind (see target_service.chain).
    # Every position the device sees is the host's plus what the steps not yet read accepted, so the
    # propose and the context commit compute their slots and bases there from the positions the verify
    # left; the host catches up with `chain_settle` once it has read a step.

    def chain_batch(self, seq_ids: Sequence[int], anchors_ahead: Sequence[int]) -> "ChainBatch | None":
        """The device-side view of these sequences for a chained step whose anchors may lie up to
        `anchors_ahead[i]` positions past sequence i's next one (the rows of the steps launched and not
        read yet): their tables and ring periods. None when a chained step cannot serve them: no static
        forwards, a head on another device, or an anchor at or past a budget (the engine then steps as
        usual). Anchors below the budget keep every write where a step-by-step propose at that anchor
        writes: its block's rows cover the verified ones (and a ring holds a window and a block)."""
        if self.propose_graphs is None or self.context_graphs is None or self.head.embed.device != self.device \
                or self.refine is not None or not 0 < len(seq_ids) <= self.spec.max_batch \
                or len(set(seq_ids)) != len(seq_ids):
            return None
        states = [self.store.get(seq_id) for seq_id in seq_ids]
        for state, ahead in zip(states, anchors_ahead):
            if not state.ring or state.next_pos + ahead >= state.budget:
                return None
        last = self._chain
        if last is not None and last.seq_ids == list(seq_ids) and all(
                a is b and a.table is t for a, b, t in zip(states, last.states, last.tables)):
            return last  # the same sequences and rings: the stacked tables are in place
        size = self.pool.block_size
        # Into buffers kept per batch size, so that a chained step captured as one graph (the engine's
        # ChainProgram) reads whichever sequences are bound now; stream order keeps a step launched before
        # reading the ones it was launched with.
        n = len(seq_ids)
        if n not in self._chain_buffers:
            self._chain_buffers[n] = (torch.empty((n, self.table_width), dtype=torch.int32, device=self.device),
                                      torch.empty(n, dtype=torch.int64, device=self.device))
        stacked, periods = self._chain_buffers[n]
        tables = [state.table for state in states]
        torch.stack(tables, out=stacked)
        self.staging.put_into(periods, [len(state.ring) * size for state in states])
        self._chain = ChainBatch(list(seq_ids), states, tables, stacked, periods)
        return self._chain

    def chain_bind(self, batch: "ChainBatch") -> None:
        """On the host's side of a chained step: the batch's tables into the propose buffers, before a
        capture or replay of a whole step that reads them there (see `ProposeGraphs.bind`)."""
        self.propose_graphs.bind(self.head, batch.tables)

    def chain_propose(self, batch: "ChainBatch", anchors: torch.Tensor, positions: torch.Tensor,
                      num_drafts: int) -> torch.Tensor:
        """Greedy drafts [B, num_drafts] (target ids, a tensor of their own) for anchors [B] at
        positions [B], both on the device: `draft_on_device` without the host knowing either."""
        shape = (len(batch.seq_ids),)
        if not 0 < num_drafts <= self.spec.max_drafts or anchors.shape != shape or positions.shape != shape:
            raise ValueError(f"a chained propose takes one anchor and position per sequence and 1.."
                             f"{self.spec.max_drafts} drafts, got {num_drafts}")
        return self.propose_graphs.fed_chain(self.head, anchors, positions, batch.periods,
                                             batch.tables).tokens[:, :num_drafts].clone()

    def chain_candidates(self, batch: "ChainBatch", anchors: torch.Tensor, positions: torch.Tensor,
                         keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chained step's draft-tree candidates (`propose_candidates` on the device): each block row's `keep`
        best log-probabilities and their target ids, [B, γ-1, keep] each, for anchors [B] at positions [B]
        that only the device knows. Read from the static block forward's logits: nothing waits."""
        shape = (len(batch.seq_ids),)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1 or anchors.shape != shape \
                or positions.shape != shape:
            raise ValueError(f"chained candidates take one anchor and position per sequence and keep >= 1, got "
                             f"{tuple(anchors.shape)}, {tuple(positions.shape)} and {keep!r}")
        drafted = self.propose_graphs.fed_chain(self.head, anchors, positions, batch.periods, batch.tables)
        logits = drafted.logits
        top, index = top_k_logp(logits.flatten(0, 1), min(keep, logits.shape[-1]), self._top_k_workspace,
                                self._score_params(logits.shape[1], logits.device))  # (scored in its launch)
        shape = (*logits.shape[:2], -1)
        return top.view(shape), self.vocab.to_target(index.view(shape))

    def _score_params(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """The checkpoint's tree scores (`tree_scores`) of a block's first `rows` rows as `top_k_logp` takes them
        [3, rows], on `device`; None where it ships none."""
        self._tree_scores_answered = True
        if self.tree_scores is None:
            return None
        if rows > self.tree_scores.rows:
            raise CheckpointError(f"tree scores for {self.tree_scores.rows} rows, asked for {rows}")
        params = self._tree_score_params
        return (params if params.device == device else self.tree_scores.on(device))[:, :rows]

    def _scored(self, logp: torch.Tensor) -> torch.Tensor:
        """Candidates' scores [B, R, K] from their log-probabilities: the checkpoint's `tree_scores` where it
        ships them."""
        self._tree_scores_answered = True
        if self.tree_scores is None:
            return logp
        params = self._tree_score_params
        return self.tree_scores.apply(logp, params if params.device == logp.device else None)

    def chain_commit(self, batch: "ChainBatch", rows: torch.Tensor, positions: torch.Tensor, count: int) -> None:
        """Context K/V of every verified row, rows [B * count, feature_dim] (sequence i's rows i*count ..,
        at positions[i] ..), into their ring slots. The rows past what the verify accepted lie at or
        past the next anchor's position, where the next propose's block writes first: nobody reads
        them, so they need not be told apart here, and the host is told what was accepted later."""
        rows = self._check_rows(rows)
        if rows.shape[0] != len(batch.seq_ids) * count or not 0 < count <= self.spec.max_drafts + 1:
            raise ValueError(f"a chained commit takes {len(batch.seq_ids)} x count rows, count 1.."
                             f"{self.spec.max_drafts + 1}; got {rows.shape[0]} rows, count {count}")
        self.context_graphs.fed_ring(rows, positions, count, batch.stacked, batch.periods)

    def chain_settle(self, seq_ids: Sequence[int], counts: Sequence[int]) -> None:
        """What a chained step committed, read back: `counts[i]` rows (its accepted drafts and anchor) of
        sequence i from its next position on. All checked before any changes."""
        if len(seq_ids) != len(counts):
            raise InvalidRequest("chain_settle takes one count per sequence")
        states = [self.store.get(seq_id) for seq_id in seq_ids]
        for state, count in zip(states, counts):
            if type(count) is not int or not 0 < count <= self.spec.max_drafts + 1:
                raise InvalidRequest(f"a chained step commits 1..{self.spec.max_drafts + 1} rows, got {count!r}")
            self._check_span(state, state.next_pos, count, "commit")
        for state, count in zip(states, counts):
            state.stash = None
            state.next_pos += count

    def draft(self, batch: Sequence[Draft]) -> list[Proposal]:
        drafted = self._graph_draft(batch)
        if drafted is not None:
            return proposals(drafted.tokens, drafted.logp, batch)
        anchors = torch.tensor([d.request.last_token for d in batch], device=self.device)
        positions = torch.tensor([d.request.position for d in batch], device=self.device)
        ctx = self._context([d.state for d in batch])
        # A refining pass drafts every row, so that what it is given never depends on how many drafts this
        # step asks for (nor on the batch's other requests): teacher forcing gives it the same
        most = self.spec.max_drafts if self.refine is not None else max(d.request.num_drafts for d in batch)

        def drafted(revealed: torch.Tensor | None = None, reveal: torch.Tensor | None = None):
            block = self.model.embed_block(anchors, self.head, revealed, reveal)
            hidden = self.model.block_hidden(block, positions, ctx)
            logits = self.model.logits(hidden[:, 1:1 + most], self.head)  # [B, n, draft vocab]
            allowed = batch_allowed([d.allowed for d in batch], self.vocab.size, logits.device)
            return pick(logits, None if allowed is None else allowed[:, None, :])

        ids, logp = drafted()
        if self.refine is not None and most > 1:
            # Rows 1..r keep the first pass's drafts; the rest are drafted again, given them
            reveal = self.refine.reveal(logp.exp())
            again, again_logp = drafted(self.vocab.to_target(ids), reveal)
            kept = torch.arange(1, most + 1, device=ids.device) <= reveal.to(ids.device)[:, None]
            ids, logp = torch.where(kept, ids, again), torch.where(kept, logp, again_logp)
        return proposals(self.vocab.to_target(ids), logp, batch)

    @torch.no_grad()
    def propose_candidates(self, requests: Sequence[ProposeRequest], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's block rows as a draft tree's candidates (`shared.tree`): the scores (`_scored`) of the
        `keep` best of each of its first num_drafts rows and their target ids, [len(requests), R, keep]
        each (R the widest num_drafts; a shorter request's rows past its own are not its). From the static block
        forward where it serves the batch (`_graph_draft`), eager otherwise. Checks and errors are `propose`'s;
        no grammar masks (a tree's runners-up would need each its own)."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidRequest(f"keep is a number of candidates >= 1, got {keep!r}")
        batch = self._check_requests(requests)
        if not batch or any(d.request.num_drafts < 1 for d in batch):
            raise InvalidRequest("candidates are asked for one or more drafts a request")
        if any(d.allowed is not None for d in batch):
            raise InvalidRequest("draft trees take no grammar bitmask")
        most = max(d.request.num_drafts for d in batch)
        drafted = self._graph_draft(batch) if len(batch) <= self.spec.max_batch else None
        if drafted is not None:  # (read at once: the graph's outputs are valid until its next replay)
            logits = drafted.logits[:, :most]
            top, index = top_k_logp(logits.reshape(-1, logits.shape[-1]), min(keep, logits.shape[-1]),
                                    self._top_k_workspace, self._score_params(most, logits.device))
            shape = (len(batch), most, -1)
            return top.view(shape), self.vocab.to_target(index.view(shape))
        logps, ids = [], []
        for i in range(0, len(batch), self.spec.max_batch):
            chunk = batch[i:i + self.spec.max_batch]
            anchors = torch.tensor([d.request.last_token for d in chunk], device=self.device)
            positions = torch.tensor([d.request.position for d in chunk], device=self.device)
            hidden = self.model.block_hidden(self.model.embed_block(anchors, self.head), positions,
                                             self._context([d.state for d in chunk]))
            logp = torch.log_softmax(self.model.logits(hidden[:, 1:1 + most], self.head).float(), -1)
            top, index = logp.topk(min(keep, logp.shape[-1]), -1)
            logps.append(top)
            ids.append(self.vocab.to_target(index))
        return self._scored(torch.cat(logps)), torch.cat(ids)

    def _context(self, states: Sequence[DFlashState]) -> BlockContext:
        """The eager reference's context: each sequence's visible rows gathered out of the pool."""
        held = [self.held(s) for s in states]
        pos = pad_rows([p for p, _, _ in held])
        return BlockContext(
            k=pad_rows([k for _, k, _ in held]), v=pad_rows([v for _, _, v in held]),
            pos=pos, valid=valid_rows([s.rows_held for s in states], pos.shape[1], self.device),
        )
