"""A batched dense path through the target's own modules: rectangular [B, T] batches, a static KV cache.

Serving uses the ragged, paged `TargetModel.forward`; training and data generation want many whole
sequences at once (hundreds of rows, one forward per decode step), which a dense [B, S] cache serves
better. The math is the model's: every layer is `model.model.layers[i]` called with a token mixer
that takes q/k/v from its own `SelfAttention`; only where keys live and which are visible differ.
Rows may be left-padded (generation) or right-padded (feature capture): visibility is judged by
each row's positions and a validity mask, never by column index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.cuda_graphs import capture
from specsplit.shared.layers import (SelfAttention, TokenMixer, grouped_attention, grouped_mask, head_logits,
                                     padded_visibility)
from specsplit.shared.tree import DraftTree
from specsplit.target_service.model import CaptureSpec, TargetModel


@dataclass
class DenseKV:
    """A static KV cache over columns 0..S-1 for B rows; `filled` columns have been written."""

    k: torch.Tensor  # [layers, B, Hkv, S, D] (head-major, as attention reads it)
    v: torch.Tensor  # [layers, B, Hkv, S, D]
    pos: torch.Tensor  # [B, S] position of each written column
    valid: torch.Tensor  # [B, S] False on padding and unwritten columns
    filled: int = 0

    @staticmethod
    def empty(model: TargetModel, batch: int, width: int) -> "DenseKV":
        cfg, weight = model.config, model.embed_weight
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, width, cfg.head_dim)
        return DenseKV(
            k=weight.new_zeros(shape), v=weight.new_zeros(shape),
            pos=torch.zeros((batch, width), dtype=torch.long, device=weight.device),
            valid=torch.zeros((batch, width), dtype=torch.bool, device=weight.device),
        )


@dataclass
class DenseOutput:
    logits: torch.Tensor | None  # [B, vocab] float32 at each row's last column, when asked
    layer_features: torch.Tensor | None  # [B, T, len(layer_ids) * hidden], when captured
    last_hidden: torch.Tensor | None  # [B, T, hidden] before the final norm, when captured


@dataclass(frozen=True)
class _Keys:
    """Where one forward's queries find their keys, and which they may see per attention window."""

    cache: DenseKV | None  # None: the batch attends to itself only
    start: int  # first cache column this batch writes (when `column` is None)
    visible: dict[int | None, torch.Tensor]  # window -> [B, 1, groups * T, K] bool, see `grouped_attention`
    column: torch.Tensor | None = None  # [1] the column a graph-shaped decode step writes, on the device
    width: int = 0  # key columns a graph-shaped decode step attends over


def _mixer(keys: _Keys, layer: int, window: int | None, cos: torch.Tensor, sin: torch.Tensor,
           batch: int) -> TokenMixer:
    def mix(attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, cos, sin)
        k, v = attn.key_value(x, cos, sin)
        q = q.view(batch, -1, *q.shape[1:])  # [B, T, Hq, D]
        k, v = (t.view(batch, -1, *t.shape[1:]).transpose(1, 2) for t in (k, v))  # [B, Hkv, T, D]
        if keys.column is not None:  # the column is data, not a Python slice: one graph serves every step
            keys.cache.k[layer].index_copy_(2, keys.column, k)
            keys.cache.v[layer].index_copy_(2, keys.column, v)
            k, v = keys.cache.k[layer, :, :, :keys.width], keys.cache.v[layer, :, :, :keys.width]
        elif keys.cache is not None:
            end = keys.start + q.shape[1]
            keys.cache.k[layer, :, :, keys.start:end] = k
            keys.cache.v[layer, :, :, keys.start:end] = v
            k, v = keys.cache.k[layer, :, :, :end], keys.cache.v[layer, :, :, :end]
        out = grouped_attention(q, k, v, keys.visible[window], attn.scale)
        return attn.output(out.reshape(-1, *out.shape[2:]))

    return mix


def _plan(model: TargetModel, positions: torch.Tensor, valid: torch.Tensor, cache: DenseKV | None) -> _Keys:
    """Record the batch's columns in the cache and build one visibility mask per distinct window."""
    if cache is None:
        k_pos, k_valid, start = positions, valid, 0
    else:
        start, end = cache.filled, cache.filled + positions.shape[1]
        if end > cache.pos.shape[1]:
            raise InvalidRequest(f"the dense cache holds {cache.pos.shape[1]} columns; the batch needs {end}")
        cache.pos[:, start:end], cache.valid[:, start:end] = positions, valid
        cache.filled = end
        k_pos, k_valid = cache.pos[:, :end], cache.valid[:, :end]
    return _Keys(cache, start, _masks(model, positions, valid, k_pos, k_valid))


def _masks(model: TargetModel, positions: torch.Tensor, valid: torch.Tensor, k_pos: torch.Tensor,
           k_valid: torch.Tensor) -> dict[int | None, torch.Tensor]:
    """One visibility mask per distinct attention window of the model's layers."""
    cfg = model.config
    windows = {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    return {w: grouped_mask(padded_visibility(positions, valid, k_pos, k_valid, w), groups) for w in windows}


@torch.no_grad()
def dense_forward(model: TargetModel, token_ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, *,
                  cache: DenseKV | None = None, capture: CaptureSpec = CaptureSpec(),
                  last_logits: bool = False) -> DenseOutput:
    """token_ids/positions/valid [B, T]. With a cache, the batch fills its next T columns and attends to all
    written ones; without, it attends to itself. `last_logits` gives logits of column T-1 of every row."""
    capture.validate(model.config.num_hidden_layers)
    device = model.embed_weight.device
    token_ids, positions, valid = token_ids.to(device), positions.to(device), valid.to(device)
    return _layers(model, _plan(model, positions, valid, cache), token_ids, positions, capture, last_logits)


def _layers(model: TargetModel, keys: _Keys, token_ids: torch.Tensor, positions: torch.Tensor,
            capture: CaptureSpec, last_logits: bool) -> DenseOutput:
    batch, width = token_ids.shape
    x = model.model.embed_tokens(token_ids.reshape(-1))  # [B * T, hidden]
    cos, sin = model.model.rotary_emb(positions.reshape(-1), x.dtype)
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        x = layer(x, _mixer(keys, i, model.config.layer_window(i), cos, sin, batch))
        if i in capture.layer_ids:
            captured[i] = x
    features = capture.features(captured, lambda: model.model.norm(x), len(model.model.layers))
    x = x.view(batch, width, -1)
    return DenseOutput(
        logits=head_logits(model.model.norm(x[:, -1]), model.lm_head.weight) if last_logits else None,
        layer_features=None if features is None else features.view(batch, width, -1),
        last_hidden=x if capture.last_hidden else None,
    )


@dataclass
class TreeOutput:
    logits: torch.Tensor  # [N + 1, vocab] float32: after the root (the context's last token), then after each node
    features: torch.Tensor | None  # [L + N, feature_dim]: the context's rows, then each node's, when captured


@torch.no_grad()
def tree_forward(model: TargetModel, context: Sequence[int], tree: DraftTree,
                 capture: CaptureSpec = CaptureSpec()) -> TreeOutput:
    """The target over `context` (its last token the tree's root) and a draft tree's nodes in one forward,
    recomputed whole: node i at the root's position plus its depth, seeing the context and its own ancestors
    (`DraftTree.visibility`), so its row is the one a plain forward over the context and its path gives. The
    reference that a cached, paged tree verify is tested against."""
    if not context:
        raise InvalidRequest("a tree's context holds at least its root")
    capture.validate(model.config.num_hidden_layers)
    device = model.embed_weight.device
    length, nodes = len(context), len(tree)
    depths = torch.tensor(tree.depths, dtype=torch.long)
    positions = torch.cat([torch.arange(length), length - 1 + depths]).to(device)
    token_ids = torch.tensor(list(context) + list(tree.tokens), dtype=torch.long, device=device)
    visible = torch.zeros(length + nodes, length + nodes, dtype=torch.bool)
    visible[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    visible[length:, :length] = True
    visible[length:, length:] = tree.visibility()
    visible = visible.to(device)
    cfg = model.config
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    masks = {}
    for window in {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}:
        seen = visible if window is None else visible & (positions[:, None] - positions[None, :] < window)
        masks[window] = grouped_mask(seen[None], groups)
    keys = _Keys(cache=None, start=0, visible=masks)
    spec = CaptureSpec(layer_ids=capture.layer_ids, last_hidden=True)
    out = _layers(model, keys, token_ids[None], positions[None], spec, last_logits=False)
    logits = head_logits(model.model.norm(out.last_hidden[0, length - 1:]), model.lm_head.weight)
    features = None if out.layer_features is None else out.layer_features[0]
    return TreeOutput(logits=logits, features=features)


# ---- generation ---------------------------------------------------------------------------------


@dataclass
class Generated:
    """Sequences packed to the left: row b is tokens[b, :lengths[b]], its first prompt_lengths[b] the prompt."""

    tokens: torch.Tensor  # [B, max prompt + max_new_tokens] int64, zero after each row's end
    prompt_lengths: torch.Tensor  # [B] int64
    lengths: torch.Tensor  # [B] int64: prompt + generated, through the first EOS when there is one
    # With a capturing decoder, rows packed like the tokens; column lengths[b]-1 (the last token, never
    # fed back) and those after it hold no rows of this sequence.
    features: torch.Tensor | None = None  # [B, S, feature] see `DenseDecoder.set_capture`
    final: torch.Tensor | None = None  # [B, S, hidden]

    def rows(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths.tolist())]


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Prompts right-aligned in [B, P]: token ids, positions (0 on padding) and validity."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidRequest("generation needs at least one prompt, and no empty prompt")
    width = max(len(p) for p in prompts)
    pads = torch.tensor([width - len(p) for p in prompts], device=device)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    cols = torch.arange(width, device=device)[None, :]
    return ids, (cols - pads[:, None]).clamp(min=0), cols >= pads[:, None]


def _next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """[B, vocab] → [B]: argmax when greedy, else a sample at `temperature`."""
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


class DenseDecoder:
    """Decode steps of one token per row over a DenseKV, shaped for CUDA graphs.

    A step is launch-bound in eager mode (about 50 small kernels per layer whatever the batch), so
    on CUDA each key width is captured once as a graph and replayed. The written column is a device
    tensor and the keys are a fixed width rounded up to `bucket` columns; columns not yet written are
    invalid, hence masked, so a step attends to exactly the keys it would attend to in eager mode.
    One decoder serves many `generate` calls of up to `batch` rows: `reset` forgets the sequences.

    With `set_capture`, prefill and every step also keep each column's feature rows (and the target's
    final-normed last hidden row), so generated sequences need no second pass to be captured.
    """

    def __init__(self, model: TargetModel, batch: int, width: int, *, bucket: int = 64,
                 use_graphs: bool | None = None) -> None:
        device = model.embed_weight.device
        self.model, self.batch, self.width, self.bucket = model, batch, width, bucket
        self.cache = DenseKV.empty(model, batch, width)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)  # static inputs of a step
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # key width -> graph, its logits
        self.capture, self.features, self.final = CaptureSpec(), None, None

    def set_capture(self, capture: CaptureSpec, final: bool) -> None:
        """Keep the rows `capture` names ([B, width, feature], as `capture_features` returns them) and,
        when `final`, the final-normed last hidden rows [B, width, hidden] of every column from now on."""
        capture.validate(self.model.config.num_hidden_layers)
        cfg, weight = self.model.config, self.model.embed_weight
        dim = cfg.hidden_size * (len(capture.layer_ids) or 1)
        wanted = bool(capture.layer_ids) or capture.last_hidden
        self.capture = CaptureSpec(capture.layer_ids, last_hidden=capture.last_hidden or final)
        self.features = weight.new_zeros((self.batch, self.width, dim)) if wanted else None
        self.final = weight.new_zeros((self.batch, self.width, cfg.hidden_size)) if final else None
        self.graphs.clear()  # they were captured without the copies

    def _keep(self, out: DenseOutput, columns: torch.Tensor) -> None:
        """Copy a forward's captured rows into `columns` [T] of the row buffers."""
        if self.features is not None:
            self.features.index_copy_(1, columns, out.layer_features if self.capture.layer_ids else out.last_hidden)
        if self.final is not None:
            self.final.index_copy_(1, columns, self.model.model.norm(out.last_hidden))

    def reset(self) -> None:
        self.cache.valid.zero_()
        self.cache.pos.zero_()
        self.cache.filled = 0

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Prompts [B, P] into columns 0..P-1 (eager); logits [B, vocab] float32 of their last column."""
        self.reset()
        out = dense_forward(self.model, ids, positions, valid, cache=self.cache, capture=self.capture,
                            last_logits=True)
        self._keep(out, torch.arange(ids.shape[1], device=out.logits.device))
        return out.logits

    def step(self, token: torch.Tensor, pos: torch.Tensor, column: int) -> torch.Tensor:
        """token/pos [B] into `column` of every row → logits [B, vocab] float32 (a static buffer on CUDA:
        read it before the next step)."""
        if not self.cache.filled <= column < self.width:
            raise InvalidRequest(f"decode column {column} is outside {self.cache.filled}..{self.width - 1}")
        self.token.copy_(token[:, None])
        self.pos.copy_(pos[:, None])
        self.column.fill_(column)
        keys = min(self.width, -(-(column + 1) // self.bucket) * self.bucket)
        if not self.use_graphs:
            return self._run(keys)
        if keys not in self.graphs:
            self.graphs[keys] = capture(lambda: self._run(keys), self.pool)
        graph, logits = self.graphs[keys]
        graph.replay()
        return logits

    def _run(self, keys: int) -> torch.Tensor:
        cache = self.cache
        cache.pos.index_copy_(1, self.column, self.pos)
        cache.valid.index_fill_(1, self.column, True)
        q_valid = torch.ones_like(self.pos, dtype=torch.bool)
        masks = _masks(self.model, self.pos, q_valid, cache.pos[:, :keys], cache.valid[:, :keys])
        plan = _Keys(cache, 0, masks, column=self.column, width=keys)
        out = _layers(self.model, plan, self.token, self.pos, self.capture, last_logits=True)
        self._keep(out, self.column)
        return out.logits


@torch.no_grad()
def generate(model: TargetModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, generator: torch.Generator | None = None,
             eos_ids: Sequence[int] = (), decoder: DenseDecoder | None = None) -> Generated:
    """Continue every prompt by up to `max_new_tokens` tokens in one batch; stops early once all rows ended.

    `decoder` (reused across calls, so its graphs are captured once) must hold at least len(prompts)
    rows of the longest prompt plus max_new_tokens; fewer prompts are padded with copies of the first."""
    if max_new_tokens < 1 or temperature < 0:
        raise InvalidRequest("max_new_tokens must be ≥ 1 and temperature ≥ 0")
    device = model.embed_weight.device
    count_real = len(prompts)
    if decoder is not None:
        if count_real > decoder.batch:
            raise InvalidRequest(f"{count_real} prompts exceed the decoder's {decoder.batch} rows")
        prompts = list(prompts) + [prompts[0]] * (decoder.batch - count_real) if prompts else prompts
    ids, positions, valid = left_pad(prompts, device)
    batch, width = ids.shape
    if decoder is None:
        decoder = DenseDecoder(model, batch, width + max_new_tokens)
    elif width + max_new_tokens > decoder.width:
        raise InvalidRequest(f"prompts of {width} tokens + {max_new_tokens} new exceed the decoder's {decoder.width}")
    logits = decoder.prefill(ids, positions, valid)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    out = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    count = torch.zeros(batch, dtype=torch.long, device=device)
    next_pos = positions[:, -1] + 1
    for step in range(max_new_tokens):
        token = _next_tokens(logits, temperature, generator)
        out[:, step] = token
        count += (~done).long()
        done |= torch.isin(token, eos)
        # Checking for the end reads the device, so only every few steps: the host keeps queueing work.
        if step + 1 == max_new_tokens or (step % 8 == 7 and bool(done[:count_real].all())):
            break
        logits = decoder.step(token, next_pos + step, width + step)
    packed = _pack(ids, valid, out, count)
    index = _packing(valid, packed.tokens.shape[1])
    features, final = (None if t is None else t[:count_real, :index.shape[1]].gather(
        1, index[:count_real, :, None].expand(-1, -1, t.shape[2])) for t in (decoder.features, decoder.final))
    return Generated(packed.tokens[:count_real], packed.prompt_lengths[:count_real], packed.lengths[:count_real],
                     features, final)


def _pack(prompt_ids: torch.Tensor, prompt_valid: torch.Tensor, new: torch.Tensor, count: torch.Tensor) -> Generated:
    """Left-padded prompts + continuations → rows packed to the left, zero after each row's end."""
    prompt_lengths = prompt_valid.sum(1)
    full = torch.cat([prompt_ids, new], 1)  # [B, P + G]
    cols = torch.arange(full.shape[1], device=full.device)[None, :]
    packed = full.gather(1, _packing(prompt_valid, full.shape[1]))
    lengths = prompt_lengths + count
    return Generated(packed.masked_fill(cols >= lengths[:, None], 0), prompt_lengths, lengths)


def _packing(prompt_valid: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] the left-padded column each packed column reads (prompts right-aligned in prompt_valid)."""
    pads = prompt_valid.shape[1] - prompt_valid.sum(1)
    cols = torch.arange(width, device=prompt_valid.device)[None, :]
    return (cols + pads[:, None]).clamp(max=width - 1)


@torch.no_grad()
def capture_features(model: TargetModel, tokens: torch.Tensor, lengths: torch.Tensor, capture: CaptureSpec,
                     *, chunk: int = 64) -> torch.Tensor:
    """Feature rows of left-packed sequences tokens [B, S] (row b real up to lengths[b]) → [B, S, feature]."""
    out = capture_rows(model, tokens, lengths, capture, chunk=chunk)
    return out.layer_features if capture.layer_ids else out.last_hidden


@torch.no_grad()
def capture_rows(model: TargetModel, tokens: torch.Tensor, lengths: torch.Tensor, capture: CaptureSpec,
                 *, chunk: int = 64) -> DenseOutput:
    """The captured layers [B, S, len(layer_ids) * hidden] and/or last hidden rows [B, S, hidden] of
    left-packed sequences tokens [B, S] (row b real up to lengths[b]), in one pass."""
    if not capture.layer_ids and not capture.last_hidden:
        raise InvalidRequest("capture_rows needs layer ids or last_hidden")
    device = model.embed_weight.device
    cols = torch.arange(tokens.shape[1], device=device)[None, :]
    features, last = [], []
    for start in range(0, tokens.shape[0], chunk):
        ids = tokens[start:start + chunk].to(device)
        valid = cols < lengths[start:start + chunk].to(device)[:, None]
        out = dense_forward(model, ids, cols.expand_as(ids), valid, capture=capture)
        features.append(out.layer_features)
        last.append(out.last_hidden)
    return DenseOutput(None, torch.cat(features) if capture.layer_ids else None,
                       torch.cat(last) if capture.last_hidden else None)
