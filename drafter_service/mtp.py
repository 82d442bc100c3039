"""DeepSeek-V3-style multi-token-prediction (MTP) drafter: one decoder layer over (token, previous hidden).

For token x_i at position i the layer's input is eh_proj([enorm(embed(x_i)) ; hnorm(h_{i-1})]) —
embedding first, as DeepSeek-V3 — where h_{i-1} is the target's last hidden row (before its final
norm) at position i-1. The layer attends causally over its own KV cache with RoPE at i; then
shared_head.norm and the target's LM head predict x_{i+1}. Draft t+1 feeds (embed(d_t), the layer's
own output at the previous position, before shared_head.norm) at the next position.

Exact rows are KV rows built from committed target rows, pair (h_{i-1}, x_i) at position i (so
position 0 has none). They are built lazily at propose time, up to the anchor x_L paired with
h_{L-1}. Rows fed by the drafter's own outputs are speculative: trim drops them, and the anchor's
row goes with them (it is rebuilt from committed data at the next propose), so nothing built from a
draft is ever reused as an exact row.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specsplit.drafter_service.base import (
    Append, Draft, Drafter, DraftVocab, Rows, SequenceState, batch_allowed, batched_attention, pad_rows, pick, proposals,
    valid_rows, visibility,
)
from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.drafter_service.mtp_graphs import ChainGraphs
from specsplit.shared.config import ModelConfig
from specsplit.shared.errors import CheckpointError, StateConflict
from specsplit.shared.layers import DecoderLayer, RMSNorm, RotaryEmbedding, SelfAttention, TokenMixer
from specsplit.shared.proposer import DrafterKind, DrafterSpec, FeatureKind, Proposal, ProposeRequest

log = logging.getLogger(__name__)
ARCHITECTURE = "SpecsplitMTP"  # marker only; loading keys on num_nextn_predict_layers

# Whether an MTP drafter on a GPU drafts through CUDA graphs of its chain (`mtp_graphs.ChainGraphs`).
# On by default since the H200 measured it (3 drafts, one stream: propose 2.75 ms against the eager
# chain's 6.40, README); SPECSPLIT_MTP_CHAIN_GRAPHS=0 keeps the eager chain (a drafter service the
# bench starts inherits it). On the CPU `use_static_chain` runs the same code without capture.
CHAIN_GRAPHS = os.environ.get("SPECSPLIT_MTP_CHAIN_GRAPHS", "1") != "0"


@dataclass(frozen=True)
class MTPConfig:
    """config.json: the target's decoder fields plus `num_nextn_predict_layers: 1` and `mtp_layer_index`."""

    decoder: ModelConfig  # target-like geometry; num_hidden_layers is the target's
    layer_index: int  # `mtp_layer_index`: tensors live under model.layers.{layer_index} (= target layers)
    draft_vocab_size: int | None = None  # set when the checkpoint ships lm_head + d2t

    def __post_init__(self) -> None:
        if isinstance(self.layer_index, bool) or not isinstance(self.layer_index, int) or self.layer_index < 0:
            raise CheckpointError(f"mtp_layer_index must be a non-negative integer, got {self.layer_index!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size <= 0:
            raise CheckpointError("draft_vocab_size must be positive")

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> "MTPConfig":
        if raw.get("num_nextn_predict_layers") != 1:
            raise CheckpointError(
                f"num_nextn_predict_layers must be 1, got {raw.get('num_nextn_predict_layers')!r}"
            )
        # The MTP layer attends over the whole sequence whatever the target's layers do.
        decoder = ModelConfig.from_hf({k: v for k, v in raw.items() if k not in ("layer_types", "sliding_window")})
        return MTPConfig(decoder=decoder, layer_index=raw.get("mtp_layer_index", decoder.num_hidden_layers),
                         draft_vocab_size=raw.get("draft_vocab_size"))

    def to_hf(self) -> dict[str, Any]:
        out = self.decoder.to_hf()
        out.pop("sliding_window", None)
        out.update(architectures=[ARCHITECTURE], num_nextn_predict_layers=1, mtp_layer_index=self.layer_index,
                   tie_word_embeddings=False)
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        return out

    def check_target(self, info: TargetInfo) -> None:
        if self.decoder.hidden_size != info.hidden_size:
            raise CheckpointError(f"hidden_size {self.decoder.hidden_size} ≠ the target's {info.hidden_size}")
        if self.decoder.vocab_size != info.vocab_size:
            raise CheckpointError(f"vocab_size {self.decoder.vocab_size} ≠ the target's {info.vocab_size}")
        if self.layer_index != info.num_hidden_layers:
            raise CheckpointError(f"mtp_layer_index {self.layer_index} ≠ the target's num_hidden_layers "
                                  f"{info.num_hidden_layers}")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's MTP module: input norms and projection around a decoder layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


@dataclass(frozen=True)
class CachedKV:
    """The batch's MTP KV caches, padded to the longest."""

    k: torch.Tensor  # [B, C, Hkv, D]
    v: torch.Tensor  # [B, C, Hkv, D]
    pos: torch.Tensor  # [B, C]
    valid: torch.Tensor  # [B, C] False on padding


class MTPModel(nn.Module):
    """The MTP weights, named as DeepSeek-V3 names its MTP layer (model.layers.{L}.*)."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        dec = cfg.decoder
        self.cfg = cfg
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(cfg.layer_index): MTPLayer(dec)})
        self.rotary_emb = RotaryEmbedding(dec.head_dim, dec.rope)
        vocab = cfg.draft_vocab_size
        self.lm_head = nn.Linear(dec.hidden_size, vocab, bias=False) if vocab else None
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long) if vocab else None)

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.cfg.layer_index)]

    def inputs(self, tokens: torch.Tensor, hidden: torch.Tensor, head: TargetHead) -> torch.Tensor:
        """tokens [T] (target ids) and previous hiddens [T, hidden] → layer inputs [T, hidden]."""
        weight = self.layer.eh_proj.weight
        embeds = F.embedding(tokens.to(head.embed.device), head.embed).to(weight.device, weight.dtype)
        return self.layer.fuse(embeds, hidden)

    def extend(self, x: torch.Tensor, pos: torch.Tensor, lengths: Sequence[int],
               cache: CachedKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run new rows x [T, hidden] at positions [T] (lengths[b] per sequence) over each cache.

        Returns the layer outputs [T, hidden] and the new rows' K and V [T, Hkv, D] to cache.
        """
        cos, sin = self.rotary_emb(pos, x.dtype)
        q_pos = pad_rows(pos.split(list(lengths)))  # [B, M]
        q_valid = valid_rows(lengths, q_pos.shape[1], x.device)
        k_pos, k_valid = torch.cat([cache.pos, q_pos], 1), torch.cat([cache.valid, q_valid], 1)
        # Padding queries see everything so no softmax row is empty; their outputs are dropped.
        visible = visibility(q_pos, k_pos, k_valid, causal=True, window=None) | ~q_valid[:, :, None]
        new: dict[str, torch.Tensor] = {}
        out = self.layer(x, _cached_mixer(cache, cos, sin, visible, lengths, q_valid, new))
        return out, new["k"], new["v"]

    def logits(self, out: torch.Tensor, head: TargetHead) -> torch.Tensor:
        """Layer outputs [.., hidden] → draft-vocabulary logits (float32)."""
        weight = head.lm_head if self.lm_head is None else self.lm_head.weight
        normed = self.layer.shared_head.norm(out)
        return F.linear(normed.to(weight.device, weight.dtype), weight).float()


def _cached_mixer(cache: CachedKV, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor,
                  lengths: Sequence[int], q_valid: torch.Tensor, new: dict[str, torch.Tensor]) -> TokenMixer:
    """New rows attend [cache ; new rows]; their K/V are left in `new` for the caller to cache."""
    split = list(lengths)

    def mix(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, cos, sin)
        new["k"], new["v"] = attn.key_value(x, cos, sin)
        qp, kp, vp = (pad_rows(t.split(split)) for t in (q, new["k"], new["v"]))
        out = batched_attention(qp, torch.cat([cache.k, kp], 1), torch.cat([cache.v, vp], 1), visible, attn.scale)
        return attn.output(out[q_valid])

    return mix


@dataclass
class MTPState(SequenceState):
    kv: Rows | None = None  # k, v, pos of the MTP layer: `exact` rows, then speculative ones
    exact: int = 0
    # h, tok of committed positions next_pos - len(pending) .. next_pos - 1; the first is kept only
    # for its hidden, which pairs with the next position's token.
    pending: Rows | None = None

    @property
    def rows_held(self) -> int:
        return self.exact


class MTPDrafter(Drafter):
    """An MTP layer behind the Proposer verbs; greedy drafts, `max_drafts` autoregressive steps."""

    def __init__(self, model: MTPModel, head: TargetHead, *, max_drafts: int = 4, max_batch: int = 64) -> None:
        dec = model.cfg.decoder
        if head.hidden_size != dec.hidden_size or head.vocab_size != dec.vocab_size:
            raise CheckpointError(f"target head [{head.vocab_size}, {head.hidden_size}] does not fit a drafter "
                                  f"for [{dec.vocab_size}, {dec.hidden_size}]")
        spec = DrafterSpec(
            kind=DrafterKind.MTP, feature=FeatureKind.LAST_HIDDEN, feature_dim=dec.hidden_size,
            hidden_size=dec.hidden_size, vocab_size=dec.vocab_size, max_drafts=max_drafts,
            max_batch=max_batch, window=0,  # no window: the MTP cache covers the whole sequence
        )
        weight = model.layer.eh_proj.weight
        super().__init__(spec, head, DraftVocab(model.d2t, dec.vocab_size), dtype=weight.dtype, device=weight.device)
        self.model = model
        self.chain_graphs: ChainGraphs | None = None
        if CHAIN_GRAPHS and self.device.type == "cuda":
            self.use_static_chain(use_graphs=True)

    def use_static_chain(self, *, use_graphs: bool) -> None:
        """Draft through the static chain (`mtp_graphs.ChainGraphs`), CUDA graphs when `use_graphs`
        (captured per bucket on first use); without graphs it is the CPU test of the same code."""
        pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.chain_graphs = ChainGraphs(self.model, self.vocab.table, max_batch=self.spec.max_batch,
                                        max_drafts=self.spec.max_drafts, use_graphs=use_graphs, pool=pool,
                                        staging=self.staging)

    def forget_head(self, head: TargetHead) -> None:
        """A target that leaves takes its head: drop the graphs made over it."""
        if self.chain_graphs is not None:
            self.chain_graphs.forget(head)

    def new_state(self, budget: int) -> MTPState:
        dec = self.model.cfg.decoder
        kv = ((dec.num_key_value_heads, dec.head_dim), self.dtype)
        return MTPState(
            budget,
            kv=Rows({"k": kv, "v": kv, "pos": ((), torch.long)}, self.device),
            pending=Rows({"h": ((dec.hidden_size,), self.dtype), "tok": ((), torch.long)}, self.device),
        )

    # Committed rows only enter `pending` (the exact rows are built at propose time, which follows the
    # block), so a step's commits may wait for the end of a batched block and go in together.
    defers_appends = True

    def append_rows(self, state: MTPState, tokens: list[int], rows: torch.Tensor, base_pos: int) -> None:
        self.append_rows_batch([Append(state, tokens, rows, base_pos)])

    def append_rows_batch(self, appends: Sequence[Append]) -> None:
        """Every append's rows and tokens into its pending rows: one copy of all the tokens to the device,
        one multi-tensor copy per column (a step commits to every sequence of the batch)."""
        tokens = self.staging.put([t for a in appends for t in a.tokens]).split([len(a.tokens) for a in appends])
        Rows.append_many([(a.state.pending, dict(h=a.rows, tok=tok)) for a, tok in zip(appends, tokens)])

    def drop_speculative(self, state: MTPState) -> None:
        state.kv.truncate(state.exact)

    def _check_request(self, state: MTPState, request: ProposeRequest) -> torch.Tensor | None:
        allowed = super()._check_request(state, request)
        if request.num_drafts and not len(state.pending):
            raise StateConflict(f"sequence {request.seq_id}: MTP needs the target row before the anchor; "
                                "nothing is committed yet")
        if state.exact + len(state.pending) != state.next_pos:  # exact rows, then pending ones, reach next_pos
            raise StateConflict(f"sequence {request.seq_id}: committed rows up to position {state.next_pos - 1} "
                                "are not all in (a batched block still holds them, or entering them failed)")
        return allowed

    def draft(self, batch: Sequence[Draft]) -> list[Proposal]:
        tokens, logps = self._draft_tensors(batch)
        return proposals(tokens, logps, batch)  # the one wait for the device, after the last step

    def draft_on_device(self, batch: Sequence[Draft]) -> torch.Tensor:
        """The drafts [B, max num_drafts] left on the device (row i's first num_drafts are request i's)."""
        return self._draft_tensors(batch)[0]

    def _draft_tensors(self, batch: Sequence[Draft]) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids and log-probabilities [B, max num_drafts] on the device, without a host sync: which
        sequences go on drafting is known from the requests alone."""
        states = [d.state for d in batch]
        for state in states:  # rows of an earlier propose at this anchor, if trim was not called
            self.drop_speculative(state)
        static = self._static_chain(batch)
        if static is not None:
            return static
        x, pos, lengths = self._exact_inputs(batch)
        out = self._extend(states, x, pos, lengths)
        for state, n in zip(states, lengths):  # all but the anchor's row are exact
            state.exact += n - 1
            state.pending.drop_front(n - 1)
        last = out[self.staging.put(lengths).cumsum(0) - 1]  # [B, hidden] at the anchors
        return self._autoregress(batch, last)

    def _static_chain(self, batch: Sequence[Draft]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The drafts from the static propose (`mtp_graphs`), or None when the batch does not take it (no
        static chain, a bitmask, a head on another device, no drafts, a cache past its buckets). The
        pending pairs but the anchor's become exact rows of the caches; the speculative rows stay in
        the chain's own buffers."""
        graphs = self.chain_graphs
        counts = [d.request.num_drafts for d in batch]
        if graphs is None or any(d.allowed is not None for d in batch) or max(counts) == 0 \
                or any(t.device != self.device for t in (self.head.embed, self.head.lm_head)):
            return None
        states = [d.state for d in batch]
        over = [max(len(s.pending) - graphs.prefix, 0) for s in states]
        if not graphs.fits(len(batch), max(len(s.kv) + o for s, o in zip(states, over))):
            return None
        if any(over):  # after a prefill or catch-up: the oldest pairs eagerly, P are left for the graph
            self._build_oldest([(d, o) for d, o in zip(batch, over) if o])
        try:
            out = graphs(self.head, [s.pending["h"] for s in states], [s.pending["tok"] for s in states],
                         [d.request.last_token for d in batch], [s.kv["k"] for s in states],
                         [s.kv["v"] for s in states], [d.request.position for d in batch], counts)
        except torch.cuda.OutOfMemoryError:
            log.warning("the MTP chain's static buffers do not fit: drafting with the eager chain from now on")
            self.chain_graphs = None
            return self._draft_tensors(batch)
        exact = [len(s.pending) - 1 for s in states]
        positions = np.concatenate([np.arange(d.request.position - n, d.request.position)
                                    for d, n in zip(batch, exact)])
        pos = self.staging.put(positions).split(exact)
        built_k, built_v = out.k.contiguous(), out.v.contiguous()  # contiguous rows: one multi-tensor copy
        Rows.append_many([(s.kv, dict(k=built_k[i, :n], v=built_v[i, :n], pos=pos[i]))
                          for i, (s, n) in enumerate(zip(states, exact)) if n])
        for state, n in zip(states, exact):
            state.exact += n
            state.pending.drop_front(n)
        return out.tokens.clone(), out.logps.clone()  # the chain's outputs are its buffers, rewritten by the next

    def _build_oldest(self, over: Sequence[tuple[Draft, int]]) -> None:
        """Build the oldest `count` pending pairs of each (draft, count) eagerly, as exact rows."""
        drafts, counts = [d for d, _ in over], [count for _, count in over]
        x, pos, lengths = self._exact_inputs(drafts, counts)
        self._extend([d.state for d in drafts], x, pos, lengths)
        for d, count in over:
            d.state.exact += count
            d.state.pending.drop_front(count)

    def _autoregress(self, batch: Sequence[Draft], last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft from the anchors' outputs; each step feeds (embed(draft), output) one position on. Column
        s of the result is step s+1's draft of each sequence still drafting (0 past a sequence's count)."""
        most = max(d.request.num_drafts for d in batch)
        tokens = torch.zeros(len(batch), most, dtype=torch.long, device=self.device)
        logps = torch.zeros(len(batch), most, dtype=torch.float32, device=self.device)
        live = list(range(len(batch)))  # batch indices still drafting
        rows = None  # their rows of `tokens` on the device (None: all of them)
        for step in range(1, most + 1):
            ids, logp = self._pick(last, [batch[i] for i in live])
            if rows is None:
                tokens[:, step - 1], logps[:, step - 1] = ids, logp
            else:
                tokens[:, step - 1].index_copy_(0, rows, ids)
                logps[:, step - 1].index_copy_(0, rows, logp.float())
            keep = [j for j, i in enumerate(live) if batch[i].request.num_drafts > step]
            if not keep:
                break
            if len(keep) < len(live):
                live = [live[j] for j in keep]
                rows, sel = self.staging.put(live), self.staging.put(keep)
                ids, last = ids[sel], last[sel]
            x = self.model.inputs(ids, last, self.head)
            pos = self.staging.put([batch[i].request.position + step for i in live])
            last = self._extend([batch[i].state for i in live], x, pos, [1] * len(live))
        return tokens, logps

    def _exact_inputs(self, batch: Sequence[Draft], counts: Sequence[int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Pairs (h_{i-1}, x_i) for every position from the first unbuilt one up to the anchor (or only
        the first counts[b] of them)."""
        hidden, tokens, positions, lengths = [], [], [], []
        for i, d in enumerate(batch):
            pending, anchor = d.state.pending, d.request.position
            n = len(pending)
            count = n if counts is None else counts[i]
            hidden.append(pending["h"][:count])
            tokens.append(torch.cat([pending["tok"][1:], self.staging.put([d.request.last_token])])[:count])
            positions.append(torch.arange(anchor - n + 1, anchor - n + 1 + count, device=self.device))
            lengths.append(count)
        x = self.model.inputs(torch.cat(tokens), torch.cat(hidden), self.head)
        return x, torch.cat(positions), lengths

    def _extend(self, states: Sequence[MTPState], x: torch.Tensor, pos: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """Run the layer over new rows and append their K/V to each sequence's cache."""
        cached = [len(s.kv) for s in states]
        cache_pos = pad_rows([s.kv["pos"] for s in states])
        cache = CachedKV(k=pad_rows([s.kv["k"] for s in states]), v=pad_rows([s.kv["v"] for s in states]),
                         pos=cache_pos, valid=valid_rows(cached, cache_pos.shape[1], self.device))
        out, k, v = self.model.extend(x, pos, lengths, cache)
        Rows.append_many([(state.kv, dict(k=k_s, v=v_s, pos=pos_s))
                          for state, k_s, v_s, pos_s in zip(states, k.split(lengths), v.split(lengths), pos.split(lengths))])
        return out

    def _pick(self, hidden: torch.Tensor, batch: Sequence[Draft]) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy draft per row of hidden [B, hidden] → target ids [B], log-probabilities [B]."""
        logits = self.model.logits(hidden, self.head)
        allowed = batch_allowed([d.allowed for d in batch], self.vocab.size, logits.device)
        ids, logp = pick(logits, allowed)
        return self.vocab.to_target(ids), logp
