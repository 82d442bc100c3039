"""DFlash block-diffusion drafter (z-lab `DFlashDraftModel` format): γ-1 drafts from one forward.

Math, as z-lab's reference: context features c = hidden_norm(fc(rows)), rows being the target's
layer outputs at `target_layer_ids`, concatenated. The block [anchor, mask × (γ-1)] at positions
p..p+γ-1 is embedded with the target's embedding; every layer's queries come from the block and its
keys/values are [k_norm(k_proj(c)) ; block keys] and [v_proj(c) ; block values], the same c for every
layer, RoPE at each row's stamped position. Attention is non-causal, except in `sliding_attention`
layers (causal with the window). Drafts are the argmax of the block rows 1..γ-1, unshifted.

Context K/V depend only on c, so they are computed once per row when it is committed and cached per
layer; a propose runs only the γ block rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.drafter_service.base import (
    Append, Draft, Drafter, DraftVocab, Rows, SequenceState, batch_allowed, batched_attention, pad_rows, pick,
    proposals, valid_rows, visibility,
)
from specsplit.drafter_service.graphs import ContextGraphs, ProposeGraphs
from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.shared.config import ModelConfig
from specsplit.shared.errors import CheckpointError
from specsplit.shared.layers import DecoderLayer, RMSNorm, RotaryEmbedding, SelfAttention, TokenMixer
from specsplit.shared.proposer import DrafterKind, DrafterSpec, FeatureKind, Proposal

ARCHITECTURE = "DFlashDraftModel"


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
    """The batch's cached context, padded to the longest."""

    k: torch.Tensor  # [B, N, layers, Hkv, D]
    v: torch.Tensor  # [B, N, layers, Hkv, D]
    pos: torch.Tensor  # [B, N] stamped positions
    valid: torch.Tensor  # [B, N] False on padding


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

    def context(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Committed rows [n, feature_dim] at positions [n] → features [n, hidden], K and V [n, layers, Hkv, D]."""
        feat = self.hidden_norm(self.fc(rows))
        cos, sin = self.rotary_emb(positions, feat.dtype)
        kv = [layer.self_attn.key_value(feat, cos, sin) for layer in self.layers]
        return feat, torch.stack([k for k, _ in kv], 1), torch.stack([v for _, v in kv], 1)

    def embed_block(self, anchors: torch.Tensor, head: TargetHead) -> torch.Tensor:
        """anchors [B] → [B, γ, hidden]: embeddings of [anchor, mask × (γ-1)]."""
        ids = torch.full((anchors.shape[0], self.cfg.block_size), self.cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = anchors.cpu()
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

    def logits(self, hidden: torch.Tensor, head: TargetHead) -> torch.Tensor:
        """Draft-vocabulary logits (float32), scaled and soft-capped as the reference's compute_logits."""
        weight = head.lm_head if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden.to(weight.device, weight.dtype), weight).float()
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


@dataclass
class DFlashState(SequenceState):
    ctx: Rows | None = None  # feat, k, v, pos of the newest committed rows, at most the window

    @property
    def rows_held(self) -> int:
        return len(self.ctx)


class DFlashDrafter(Drafter):
    """A DFlash model behind the Proposer verbs; context K/V cached per sequence in a sliding window."""

    def __init__(self, model: DFlashModel, head: TargetHead, *, window: int = 4096, max_batch: int = 64,
                 cuda_graphs: bool = True) -> None:
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
        self.context_graphs: ContextGraphs | None = None
        self.propose_graphs: ProposeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            self.use_static_forwards(use_graphs=True)

    def use_static_forwards(self, *, use_graphs: bool) -> None:
        """Run the context and block forwards over static buffers, as CUDA graphs when `use_graphs`
        (captured per size bucket on first use). Without graphs it is the CPU test of the same code."""
        pool = torch.cuda.graph_pool_handle() if use_graphs else None
        rows = self.spec.max_batch * self.spec.block_size
        self.context_graphs = ContextGraphs(self.model, max_rows=rows, use_graphs=use_graphs, pool=pool)
        self.propose_graphs = ProposeGraphs(self.model, self.vocab.table, max_batch=self.spec.max_batch,
                                            window=self.spec.window, device=self.device, dtype=self.dtype,
                                            use_graphs=use_graphs, pool=pool, staging=self.staging)

    def forget_head(self, head: TargetHead) -> None:
        """A target that leaves takes its head: drop the graphs made over it."""
        if self.propose_graphs is not None:
            self.propose_graphs.forget(head)

    def new_state(self, budget: int) -> DFlashState:
        dec = self.model.cfg.decoder
        kv = ((dec.num_hidden_layers, dec.num_key_value_heads, dec.head_dim), self.dtype)
        schema = {"feat": ((dec.hidden_size,), self.dtype), "k": kv, "v": kv, "pos": ((), torch.long)}
        return DFlashState(budget, ctx=Rows(schema, self.device, limit=min(self.spec.window, budget)))

    defers_appends = True  # a context row's features depend on that row alone

    def append_rows(self, state: DFlashState, tokens: list[int], rows: torch.Tensor, base_pos: int) -> None:
        self.append_rows_batch([Append(state, tokens, rows, base_pos)])

    def append_rows_batch(self, appends: Sequence[Append]) -> None:
        """One context forward for every sequence's new rows; rows that would slide straight out of a
        window are never computed."""
        kept, spans = [], []
        for a in appends:
            n, keep = a.rows.shape[0], min(a.rows.shape[0], a.state.ctx.limit)
            kept.append(a.rows[n - keep:])
            spans.append(range(a.base_pos + n - keep, a.base_pos + n))
        pos = self.staging.put([p for span in spans for p in span])
        rows = torch.cat(kept) if len(kept) > 1 else kept[0]
        graphs = self.context_graphs
        feat, k, v = (graphs if graphs is not None and graphs.fits(rows.shape[0]) else self.model.context)(rows, pos)
        start, items = 0, []
        for a, span in zip(appends, spans):
            end = start + len(span)
            items.append((a.state.ctx, dict(feat=feat[start:end], k=k[start:end], v=v[start:end], pos=pos[start:end])))
            start = end
        Rows.append_many(items)

    def drop_speculative(self, state: DFlashState) -> None:
        """DFlash keeps nothing speculative: proposes never write the context."""

    def fit_budget(self, state: DFlashState, budget: int) -> None:
        state.ctx.relimit(min(self.spec.window, budget))

    def _graph_draft(self, batch: Sequence[Draft]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drafts and log-probabilities [B, γ-1] on the device from the static block forward, or None
        when the batch does not fit it (a bitmask, a size past the buckets, a head on another device)."""
        graphs = self.propose_graphs
        if graphs is None or any(d.allowed is not None for d in batch) or self.head.embed.device != self.device \
                or not graphs.fits(len(batch), max(len(d.state.ctx) for d in batch)):
            return None
        return graphs(self.head, [d.request.last_token for d in batch], [d.request.position for d in batch],
                      [d.state.ctx for d in batch])

    def draft_on_device(self, batch: Sequence[Draft]) -> torch.Tensor | None:
        drafted = self._graph_draft(batch)
        return None if drafted is None else drafted[0]

    def draft(self, batch: Sequence[Draft]) -> list[Proposal]:
        drafted = self._graph_draft(batch)
        if drafted is not None:
            return proposals(*drafted, batch)
        anchors = torch.tensor([d.request.last_token for d in batch])
        positions = torch.tensor([d.request.position for d in batch], device=self.device)
        block = self.model.embed_block(anchors, self.head)
        hidden = self.model.block_hidden(block, positions, self._context([d.state for d in batch]))
        most = max(d.request.num_drafts for d in batch)
        logits = self.model.logits(hidden[:, 1:1 + most], self.head)  # [B, n, draft vocab]
        allowed = batch_allowed([d.allowed for d in batch], self.vocab.size, logits.device)
        ids, logp = pick(logits, None if allowed is None else allowed[:, None, :])
        return proposals(self.vocab.to_target(ids), logp, batch)

    def _context(self, states: Sequence[DFlashState]) -> BlockContext:
        lengths = [len(s.ctx) for s in states]
        pos = pad_rows([s.ctx["pos"] for s in states])
        return BlockContext(
            k=pad_rows([s.ctx["k"] for s in states]), v=pad_rows([s.ctx["v"] for s in states]),
            pos=pos, valid=valid_rows(lengths, pos.shape[1], self.device),
        )
