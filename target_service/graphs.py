"""CUDA graphs of the target's decode/verify forward: one per (batch bucket, query length), captured
once over static buffers and replayed every step (nano-vllm's `capture_cudagraph`, for a paged cache).

A step of B sequences with up to Q tokens each (decode: Q = 1; verify: Q = k + 1) runs in the
smallest captured bucket (B', Q') with B' >= B and Q' >= Q. Padding is harmless by construction:
a padding token writes its K/V to a scratch block the cache lends us and attends within it, and its
rows are dropped from the output. Everything a step changes (tokens, positions, cache slots, block
tables) lives in device tensors the graph reads; the host builds them from lists it already has, so
the forward itself never synchronises. `TargetModel.forward` stays the eager reference (and runs
prefill); on a CPU the same static forward runs without capture, which is how it is tested there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable

import numpy as np
import torch

from specsplit.kernels.fed_inputs import write_fed_inputs
from specsplit.kernels.paged_attention import MAX_TREE_QUERIES, paged_attention
from specsplit.kernels.row_max import row_max
from specsplit.kernels.workspace import arrival_counters
from specsplit.shared.cuda_graphs import batch_buckets, bucket_for, capture, inlining
from specsplit.shared.errors import InvalidRequest, StateConflict
from specsplit.shared.fused import FusedWeights, PagedAttend, fuse_projections, run_fused_layers
from specsplit.shared.layers import SelfAttention, embed_rows, head_logits
from specsplit.shared.ragged import ragged_arange
from specsplit.shared.tree import block_rows
from specsplit.target_service.kv_cache import PagedKVCache
from specsplit.target_service.model import CaptureSpec, ForwardOutput, TargetModel

_SCRATCH = -1  # the cache sequence id holding the scratch block padding tokens write to


@dataclass(frozen=True)
class StepBatch:
    """One decode/verify step, as the engine knows it on the host."""

    seq_ids: list[int]  # [B] KV cache sequence ids
    tokens: list[list[int]]  # [B] of [n_i] token ids: the last committed token, then drafts
    starts: list[int]  # [B] position of each sequence's first token
    # A tree bucket's step (`StepGraphs.forward_tree`): per sequence None or a draft tree's parents, its tokens
    # the root and then the nodes (`ForwardBatch.trees`)
    trees: list[tuple[int, ...] | None] | None = None


@dataclass(frozen=True)
class DeviceDrafts:
    """A step's drafts still on the device (an in-process drafter's output, fed to the verify without a
    round trip through the host): the step's sequence `seqs[i]` takes `tokens[rows[i], :counts[i]]` as
    its drafts, and its token list in the `StepBatch` holds that many placeholders after its last token."""

    tokens: torch.Tensor  # [R, n] int64 target ids
    seqs: list[int]  # index in the step of each sequence that has drafts
    counts: list[int]  # its number of drafts
    rows: list[int]  # its row of `tokens`
    # Where in each sequence's token list the first of them goes: 1, after its last committed token
    # (drafts); 0 for a decode step fed the picks of the step before it (`StepGraphs.launch_decode`).
    column: int = 1


@dataclass(frozen=True)
class LaunchedStep:
    """A one-token-per-sequence step launched on the device, its picks on their way to the host.

    `device_picks` may be a view of the graph's own argmax buffer: a later step can still read it as
    its input (see `StepGraphs.launch_decode`), since the graph overwrites it only on its next replay,
    which comes after that read in stream order."""

    seq_ids: list[int]
    device_picks: torch.Tensor  # [len(seq_ids)] int64, in sequence order
    host_picks: torch.Tensor  # [>= len(seq_ids)] int64, pinned on a GPU
    ready: torch.cuda.Event | None  # recorded after the copy to host_picks (None: a CPU step, done)
    number: int  # this launch's number, and each host buffer's latest launch (shared, see picks)
    owners: list[int]
    turn: int  # which host buffer is this launch's

    def picks(self) -> list[int]:
        """Each sequence's pick, in order: waits for this step's copy alone. Read them before the launch
        after next, which reuses the buffer (refused after it)."""
        if self.owners[self.turn] != self.number:
            raise StateConflict(f"decode launch {self.number}'s picks were overwritten by launch "
                                f"{self.owners[self.turn]}: read each launch's picks before the one after next")
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_picks[:len(self.seq_ids)].tolist()


def _input_buffers(batch: int, query_len: int, max_blocks: int, device: torch.device, *,
                   pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One zeroed byte buffer and its views: int64 inputs [6, B * Q], then int32 tables [B, max_blocks]."""
    head = 6 * batch * query_len * 8  # bytes of the inputs: a multiple of 8, so the tables stay aligned
    whole = torch.zeros(head + batch * max_blocks * 4, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    inputs = whole[:head].view(torch.int64).view(6, batch * query_len)
    tables = whole[head:].view(torch.int32).view(batch, max_blocks)
    return whole, inputs, tables


class StaticForward:
    """The decode/verify forward as fixed-shape tensor ops over buffers of one bucket (B x Q tokens)."""

    def __init__(self, model: TargetModel, cache: PagedKVCache, capture: CaptureSpec, batch: int,
                 query_len: int, max_blocks: int, scratch_block: int, fused: list[FusedWeights] | None,
                 tree: bool = False) -> None:
        self.model, self.cache, self.capture, self.fused = model, cache, capture, fused
        self.batch, self.query_len = batch, query_len
        device = cache.device
        self.scratch_slot, self.scratch_block = scratch_block * cache.block_size, scratch_block
        # Every per-step input in one buffer, so a step is one host-to-device copy (from pinned staging
        # on a GPU; each copy costs the host tens of µs there): int64 rows tokens / positions / cache
        # slots / output rows, then the int32 block tables, as views of its bytes. Rows 4 and 5 are not
        # read by the forward: where device drafts go in the token row, and from where.
        pinned = device.type == "cuda"
        self._device_bytes, self.inputs, self.block_tables = _input_buffers(batch, query_len, max_blocks, device)
        self._host_bytes, self._host_inputs, self._host_tables = _input_buffers(
            batch, query_len, max_blocks, torch.device("cpu"), pin_memory=pinned)
        self.block_tables.fill_(scratch_block)
        self.token_ids, self.slots, self.rows = self.inputs[0], self.inputs[2], self.inputs[3]  # [B * Q] each
        self.positions = self.inputs[1].view(batch, query_len)  # [B, Q]
        self.slots.fill_(self.scratch_slot)  # the capture's warm-up run writes K/V: only ever to scratch
        self._copied = torch.cuda.Event() if pinned else None
        # A tree bucket's rows: their rotary positions (a node's root's plus its depth) and the block rows each
        # sees (`kernels.paged_attention`'s words; -1, every row up to its own, for a chain or padding)
        self.tree = tree
        self.rotary = self.positions
        self.words: torch.Tensor | None = None
        if tree:
            self._tree_device = torch.zeros(2, batch, query_len, dtype=torch.int64, device=device)
            self._tree_host = torch.zeros(2, batch, query_len, dtype=torch.int64, pin_memory=pinned)
            self.rotary, self.words = self._tree_device[0], self._tree_device[1]
        # Arrival counters of the greedy picks' one-launch row max (kernels.workspace), this bucket's own.
        self.workspace = arrival_counters(batch * query_len, device)
        self.output: ForwardOutput | None = None
        self.host_rows: np.ndarray | None = None  # the last loaded step's rows of [B * Q]
        self._fed: tuple | None = None  # what the last `load_fed` copied, if nothing was loaded since

    def load(self, step: StepBatch, drafts: DeviceDrafts | None = None) -> torch.Tensor:
        """Copy a step into the buffers (device drafts over their placeholders); returns the rows of
        [B * Q] that hold its tokens, in order."""
        self._fed = None  # (see load_fed)
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers' previous copies are done
        q, block_size = self.query_len, self.cache.block_size
        inputs, tables = self._host_inputs.numpy(), self._host_tables.numpy()
        tokens, positions, slots, rows = (row.reshape(self.batch, q) for row in inputs[:4])
        tokens[:], positions[:], slots[:], tables[:] = 0, 0, self.scratch_slot, self.scratch_block
        # Whole-batch array ops: the host's cost of a step must not grow by a Python loop's worth per
        # sequence (at 64 sequences that loop was a good part of a millisecond).
        batch = len(step.seq_ids)
        lengths = np.fromiter(map(len, step.tokens), dtype=np.int64, count=batch)
        starts = np.asarray(step.starts, dtype=np.int64)
        blocks = self.cache.block_lists(step.seq_ids)
        widths = np.fromiter(map(len, blocks), dtype=np.int64, count=batch)
        seq_of = np.arange(batch)
        tables[np.repeat(seq_of, widths), ragged_arange(widths)] = np.fromiter(
            itertools.chain.from_iterable(blocks), dtype=np.int64, count=int(widths.sum()))
        # Padding queries of a real sequence sit at its last position (they read only its own keys)
        # but write to the scratch slot.
        positions[:batch] = np.minimum(starts[:, None] + np.arange(q), (starts + lengths - 1)[:, None])
        token_seq, offset = np.repeat(seq_of, lengths), ragged_arange(lengths)
        count = int(lengths.sum())
        flat = token_seq * q + offset  # each token's row in [B * Q]
        span = np.repeat(starts, lengths) + offset  # each token's position
        tokens.reshape(-1)[flat] = np.fromiter(itertools.chain.from_iterable(step.tokens), dtype=np.int64, count=count)
        slots.reshape(-1)[flat] = tables[token_seq, span // block_size] * block_size + span % block_size
        inputs[3, :count] = flat
        self.host_rows = flat  # the same rows, for picking the step's rows out of the bucket's argmax
        placed = self._place_drafts(drafts, inputs) if drafts is not None else 0
        if self.tree:
            self._load_trees(step, positions)
            self._tree_device.copy_(self._tree_host, non_blocking=True)
        self._device_bytes.copy_(self._host_bytes, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if placed:
            dest, src = self.inputs[4, :placed], self.inputs[5, :placed]
            self.token_ids.index_copy_(0, dest, drafts.tokens.reshape(-1).index_select(0, src).to(torch.int64))
        return self.rows[:count]

    def _load_trees(self, step: StepBatch, positions: np.ndarray) -> None:
        """The host staging of a tree bucket's rotary positions and visibility words."""
        rotary, words = self._tree_host.numpy()
        rotary[:], words[:] = positions, -1
        for b, parents in enumerate(step.trees or ()):
            if parents is None:
                continue
            if len(parents) + 1 != len(step.tokens[b]):
                raise InvalidRequest(f"sequence {b}'s tree has {len(parents)} nodes for {len(step.tokens[b])} tokens")
            depth, word = block_rows(parents)
            n = len(depth)
            rotary[b, :n] = step.starts[b] + np.asarray(depth)
            words[b, :n] = np.asarray([w - (1 << 64) if w >= 1 << 63 else w for w in word], dtype=np.int64)

    def load_fed(self, seq_ids: list[int], tokens: torch.Tensor, starts: torch.Tensor) -> None:
        """A step whose tokens [B, n] and first positions [B] are on the device only (a chained step's:
        the host does not know them yet), every sequence n tokens. The host copies the block tables
        (the cache holds blocks up to the furthest position any of them may reach); positions and
        cache slots are computed on the device from `starts`, as `load` computes them on the host:
        padding queries of a real sequence at its last position and writing to scratch."""
        self.load_fed_tables(seq_ids, tokens.shape[1])
        self.load_fed_device(tokens, starts)

    def load_fed_tables(self, seq_ids: list[int], n: int) -> None:
        """`load_fed`'s host side: the block tables of these sequences, n tokens each."""
        batch, q = len(seq_ids), self.query_len
        blocks = self.cache.block_lists(seq_ids)
        widths = np.fromiter(map(len, blocks), dtype=np.int64, count=batch)
        ids = np.fromiter(itertools.chain.from_iterable(blocks), dtype=np.int64, count=int(widths.sum()))
        # What the host copies (the tables; zeros and scratch slots for padding) changes only when a
        # sequence's blocks do (which ones, not only how many: a truncate and a reserve between two chained
        # steps may hand two sequences each other's freed blocks), or the batch: most chained steps copy
        # nothing, and wait for nothing.
        key = (tuple(seq_ids), widths.tobytes(), ids.tobytes(), n)
        if key != self._fed:
            if self._copied is not None:
                self._copied.synchronize()
            inputs, tables = self._host_inputs.numpy(), self._host_tables.numpy()
            inputs[:4], tables[:] = 0, self.scratch_block
            inputs[2] = self.scratch_slot
            tables[np.repeat(np.arange(batch), widths), ragged_arange(widths)] = ids
            flat = (np.arange(batch)[:, None] * q + np.arange(n)).reshape(-1)
            inputs[3, :flat.size] = flat
            self.host_rows = flat
            self._device_bytes.copy_(self._host_bytes, non_blocking=True)
            if self._copied is not None:
                self._copied.record()
            self._fed = key

    def load_fed_device(self, tokens: torch.Tensor, starts: torch.Tensor,
                        tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """`load_fed`'s device side, after `load_fed_tables` of the same sequences: positions, slots and
        tokens (no host copy: inlined in a whole chained step's graph, see target_service.chain), and a tree
        bucket's `tree`: its rows' rotary positions and visibility words [B, n] (`shared.tree.tree_words`;
        padding sequences see every row up to their own). One launch on a GPU (`kernels.fed_inputs`)."""
        if tree is not None and (not self.tree or tree[1].shape[1] != self.query_len):
            raise InvalidRequest(f"a fed tree verify fills a tree bucket's {self.query_len} rows, got "
                                 f"{tree[1].shape[1]}")
        write_fed_inputs(tokens, starts, self.block_tables, self.cache.block_size, self.scratch_slot,
                         self.token_ids, self.positions, self.slots,
                         None if tree is None else (*tree, self.rotary, self.words))

    def _place_drafts(self, drafts: DeviceDrafts, inputs: np.ndarray) -> int:
        """Rows 4/5 of the host inputs: token-row slots of each draft and its index in drafts.tokens."""
        q, width = self.query_len, drafts.tokens.shape[1]
        counts = np.asarray(drafts.counts, dtype=np.int64)
        offset = ragged_arange(counts)
        placed = len(offset)
        if placed:
            first = np.asarray(drafts.seqs, dtype=np.int64) * q + drafts.column
            inputs[4, :placed] = np.repeat(first, counts) + offset
            inputs[5, :placed] = np.repeat(np.asarray(drafts.rows, dtype=np.int64) * width, counts) + offset
        return placed

    def run(self) -> ForwardOutput:
        out = self._run_fused() if self.fused is not None else self._run_modules()
        _, out.bucket_argmax = row_max(out.logits, self.workspace)  # the greedy picks, inside the graph
        return out

    def _run_modules(self) -> ForwardOutput:
        """The layers' own forward, attention swapped for paged attention: the unfused step."""
        model = self.model
        stack = model.model
        positions = self.rotary.reshape(-1)
        x = stack.embed_tokens(self.token_ids)  # [B * Q, hidden]
        cos, sin = stack.rotary_emb(positions, x.dtype)
        captured = {}
        for i, layer in enumerate(stack.layers):
            x = layer(x, partial(self._attend, i, cos, sin))
            if i in self.capture.layer_ids:
                captured[i] = x
        normed = stack.norm(x)
        self.output = ForwardOutput(
            logits=head_logits(normed, model.lm_head.weight),
            layer_features=self.capture.features(captured, lambda: normed, len(stack.layers)),
            last_hidden=x if self.capture.last_hidden else None,
        )
        return self.output

    def _run_fused(self) -> ForwardOutput:
        """The fused layers (`shared.fused`: ten launches a layer, or seven), attending causally over the
        KV cache through the block tables."""
        cfg, stack = self.model.config, self.model.model
        positions = self.rotary.reshape(-1)
        residual = embed_rows(stack.embed_tokens.weight, self.token_ids)  # [B * Q, hidden]
        cos, sin = stack.rotary_emb(positions, residual.dtype)

        def attention(i: int, q: torch.Tensor) -> torch.Tensor:  # q rotated, k and v in the cache
            return paged_attention(q.view(self.batch, self.query_len, *q.shape[1:]), self.cache.k_pool[i],
                                   self.cache.v_pool[i], self.block_tables, self.positions,
                                   stack.layers[i].self_attn.scale, cfg.layer_window(i), self.words).flatten(0, 1)

        attend = PagedAttend(cos, sin, self.cache.k_pool, self.cache.v_pool, self.slots, cfg.rms_norm_eps, attention)

        h, last, captured = run_fused_layers(cfg, stack.layers, self.fused, residual, attend, stack.norm.weight,
                                             self.capture.layer_ids)
        self.output = ForwardOutput(
            logits=head_logits(h, self.model.lm_head.weight),  # h is the final norm of the last layer's output
            layer_features=self.capture.features(captured, lambda: h, len(stack.layers)),
            last_hidden=last if self.capture.last_hidden else None,
        )
        return self.output

    def _attend(self, layer: int, cos: torch.Tensor, sin: torch.Tensor, attn: SelfAttention,
                x: torch.Tensor) -> torch.Tensor:
        q = attn.query(x, cos, sin)  # [B * Q, Hq, D]
        k, v = attn.key_value(x, cos, sin)  # [B * Q, Hkv, D]
        self.cache.write_slots(layer, self.slots, k, v)
        out = paged_attention(q.view(self.batch, self.query_len, *q.shape[1:]), self.cache.k_pool[layer],
                              self.cache.v_pool[layer], self.block_tables, self.positions, attn.scale,
                              self.model.config.layer_window(layer), self.words)
        return attn.output(out.reshape(q.shape))


class StepGraphs:
    """Decode/verify forwards for every (batch bucket, query length), CUDA-graph captured on a GPU.

    `use_graphs=False` runs the same static forward eagerly (the CPU path, and the graph's reference);
    `fused=False` keeps the layers' own modules (the unfused step, for comparison).
    """

    def __init__(self, model: TargetModel, cache: PagedKVCache, capture: CaptureSpec, *, max_batch: int,
                 query_lens: tuple[int, ...], max_len: int, use_graphs: bool = True, fused: bool = True,
                 tree_lens: tuple[int, ...] = (), tree_batch: int | None = None,
                 tree_shapes: Iterable[tuple[int, int]] = ()) -> None:
        capture.validate(model.config.num_hidden_layers)
        if _SCRATCH not in cache:  # several StepGraphs over one cache share it
            cache.allocate(_SCRATCH)
            cache.reserve(_SCRATCH, cache.block_size)
        scratch_block = cache.blocks(_SCRATCH)[0]
        self.cache = cache
        self.max_blocks = cache.blocks_for(max_len)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.batches = batch_buckets(max_batch)
        weights = fuse_projections(model, model.model.layers) if fused else None
        self.forwards = {(b, q): StaticForward(model, cache, capture, b, q, self.max_blocks, scratch_block, weights)
                         for b in self.batches for q in self.query_lens}
        # Draft trees' verifies (`forward_tree`), keyed (batch, -rows) beside the chains' buckets: each of
        # `tree_lens` up to the bucket of `tree_batch` sequences (None: every bucket; larger steps verify
        # chains), and each (sequences, rows) of `tree_shapes` in its sequences' bucket
        shapes = set(tree_shapes)
        most = self.batches[-1] if tree_batch is None else min(tree_batch, self.batches[-1])
        shapes |= {(n, q) for n in range(1, most + 1) for q in tree_lens}
        if shapes and any(model.config.layer_window(i) is not None for i in range(model.config.num_hidden_layers)):
            raise InvalidRequest("tree verifies take no sliding window")
        if any(not 1 <= q <= MAX_TREE_QUERIES for _, q in shapes):
            raise InvalidRequest(f"a tree verify holds 1..{MAX_TREE_QUERIES} rows, "
                                 f"got {sorted({q for _, q in shapes})}")
        if any(not 1 <= n <= self.batches[-1] for n, _ in shapes):
            raise InvalidRequest(f"tree verifies of 1..{self.batches[-1]} sequences, "
                                 f"got {sorted({n for n, _ in shapes})}")
        lens_at: dict[int, set[int]] = {}
        for n, q in shapes:
            lens_at.setdefault(bucket_for(n, self.batches), set()).add(q)
        self._tree_lens_at = {b: tuple(sorted(lens)) for b, lens in sorted(lens_at.items())}
        self.tree_batches = tuple(self._tree_lens_at)
        self.tree_lens = tuple(sorted({q for _, q in shapes}))
        for b, lens in self._tree_lens_at.items():
            for q in lens:
                self.forwards[(b, -q)] = StaticForward(model, cache, capture, b, q, self.max_blocks, scratch_block,
                                                       weights, tree=True)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Where launched steps' picks land on the host, two in turn: a launch may be queued while the
        # one before it is still unread, never more (see `launch_decode`).
        pinned = cache.device.type == "cuda"
        self._picks = [torch.zeros(self.batches[-1], dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._picks_ready = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._turn, self._launches, self._owners = 0, 0, [0, 0]
        if use_graphs:
            self._capture_all()

    def bucket(self, num_seqs: int, query_len: int) -> tuple[int, int] | None:
        b, q = bucket_for(num_seqs, self.batches), bucket_for(query_len, list(self.query_lens))
        return None if b is None or q is None else (b, q)

    def forward(self, step: StepBatch, drafts: DeviceDrafts | None = None) -> ForwardOutput:
        """The step's outputs, rows in token order (as `TargetModel.forward` returns them). With `drafts`,
        their tokens replace the step's placeholders on the device, in stream order after the drafter's
        forward (so the host need not wait for it). A step that fills its bucket gets the graph's own
        logits buffer (no copy), valid until the next forward of that bucket."""
        fwd, rows, out = self._run(step, drafts)
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        # Without padding the logits are in token order already: no copy of [B * Q, vocab] floats. Feature
        # rows are always copied: a drafter may hold them past the next forward (a stash not yet sent).
        logits = out.logits if rows.numel() == fwd.batch * fwd.query_len else pick(out.logits)
        return ForwardOutput(logits, pick(out.layer_features), pick(out.last_hidden),
                             bucket_argmax=out.bucket_argmax, bucket_rows=fwd.host_rows)

    def tree_bucket(self, num_seqs: int, rows: int) -> tuple[int, int] | None:
        b = bucket_for(num_seqs, self.batches)
        q = None if b not in self._tree_lens_at else bucket_for(rows, list(self._tree_lens_at[b]))
        return None if q is None else (b, -q)

    def forward_tree(self, step: StepBatch) -> ForwardOutput:
        """A draft trees' verify (`StepBatch.trees`) in a tree bucket: rows in token order, as `forward`'s."""
        if step.trees is None or len(step.trees) != len(step.seq_ids):
            raise InvalidRequest("a tree verify names each sequence's tree (None: a chain)")
        fwd, rows, out = self._run(step, None, tree=True)
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        return ForwardOutput(pick(out.logits), pick(out.layer_features), pick(out.last_hidden),
                             bucket_argmax=out.bucket_argmax, bucket_rows=fwd.host_rows)

    def launch_decode(self, step: StepBatch, fed: DeviceDrafts | None = None,
                      choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> LaunchedStep:
        """A step of one token per sequence, launched without waiting for it: its picks come back through
        `LaunchedStep.picks`. `fed` (column 0) takes a sequence's token from an earlier launch's
        `device_picks` still on the device, so steps can be queued back to back while the host handles
        the picks of the one before. The picks are the greedy ones, or what `choose(logits [n, vocab],
        greedy picks [n])` makes of them on the device (sampled requests); nothing is read back here."""
        if any(len(t) != 1 for t in step.tokens):
            raise InvalidRequest("a decode launch takes exactly one token per sequence")
        fwd, rows, out = self._run(step, fed)
        n = len(step.seq_ids)
        # In a Q = 1 bucket sequence i's token is row i: the picks are a view of the graph's buffer
        whole = fwd.query_len == 1
        picks = out.bucket_argmax[:n] if whole else out.bucket_argmax.index_select(0, rows)
        if choose is not None:
            picks = choose(out.logits[:n] if whole else out.logits.index_select(0, rows), picks)
        turn = self._turn
        host, ready = self._picks[turn], self._picks_ready[turn]
        self._turn ^= 1
        host[:n].copy_(picks, non_blocking=True)
        if ready is not None:
            ready.record()
        self._launches += 1
        self._owners[turn] = self._launches
        return LaunchedStep(list(step.seq_ids), picks, host, ready, self._launches, self._owners, turn)

    def chain(self, seq_ids: list[int], tokens: torch.Tensor, starts: torch.Tensor, firsts: list[int],
              ends: list[int]) -> tuple[StaticForward, ForwardOutput]:
        """A verify of tokens [B, n] at first positions [B] that only the device knows (a chained step:
        `StaticForward.load_fed`), the host knowing each sequence's first position lies in
        [firsts[i], ends[i] - n]: the cache grows to `ends` first. Returns the bucket's forward and its
        outputs, bucket-shaped ([B' * Q] rows, sequence i's tokens at rows i * Q ..): nothing is read back."""
        batch, n = tokens.shape
        if batch != len(seq_ids):
            raise InvalidRequest(f"a fed verify of {batch} sequences' tokens names {len(seq_ids)} sequences")
        fwd = self.chain_tables(seq_ids, n, firsts, ends)
        return fwd, self.chain_run(fwd, tokens, starts)

    def chain_tables(self, seq_ids: list[int], n: int, firsts: list[int], ends: list[int], *,
                     tree: bool = False) -> StaticForward:
        """`chain`'s host side: the cache grown to `ends`, the tables of the bucket's forward loaded (a tree
        bucket's with `tree`, whose rows `chain_run` is given the rotary positions and words of)."""
        key = (self.tree_bucket if tree else self.bucket)(len(seq_ids), n)
        if key is None or not len(seq_ids) == len(firsts) == len(ends):
            raise InvalidRequest(f"no captured bucket holds {len(seq_ids)} sequences of {n} tokens")
        if any(end < first + n for first, end in zip(firsts, ends)):
            raise InvalidRequest("a fed verify's blocks must reach at least its first known position plus its tokens")
        if max(ends) > self.max_blocks * self.cache.block_size:
            raise InvalidRequest(f"position {max(ends) - 1} lies past the {self.max_blocks} blocks a step can address")
        self.cache.reserve_batch(seq_ids, firsts, ends)
        fwd = self.forwards[key]
        fwd.load_fed_tables(seq_ids, n)
        return fwd

    def chain_run(self, fwd: StaticForward, tokens: torch.Tensor, starts: torch.Tensor,
                  tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> ForwardOutput:
        """`chain`'s device side, after `chain_tables`: the verify's outputs, bucket-shaped. Inlined in a
        capture (`shared.cuda_graphs.inlined`), the forward runs into it and returns the capture's own
        outputs; the bucket's graph keeps its own. A tree bucket's step takes `tree`: its rows' rotary
        positions and visibility words [B, n] (`StaticForward.load_fed_device`)."""
        if fwd.tree != (tree is not None):
            raise InvalidRequest("a tree bucket's fed verify takes its rows' rotary positions and words, "
                                 "a chain's none")
        fwd.load_fed_device(tokens, starts, tree)
        graph = self.graphs.get((fwd.batch, -fwd.query_len if fwd.tree else fwd.query_len))
        if graph is not None and not inlining():
            graph.replay()
            return fwd.output
        kept = fwd.output
        try:
            with torch.inference_mode():
                out = fwd.run()
        finally:
            if graph is not None:
                fwd.output = kept  # the graph's outputs, which its replays rewrite (a failed capture's neither)
        return out

    def _run(self, step: StepBatch, drafts: DeviceDrafts | None,
             tree: bool = False) -> tuple[StaticForward, torch.Tensor, ForwardOutput]:
        """Load the step into its bucket and run it: (the bucket's forward, the step's rows of it, its output)."""
        lengths = [len(t) for t in step.tokens]
        key = (self.tree_bucket if tree else self.bucket)(len(lengths), max(lengths))
        if key is None or min(lengths) == 0:
            raise InvalidRequest(f"no captured bucket holds {len(lengths)} sequences of up to {max(lengths)} tokens")
        last = [s + n - 1 for s, n in zip(step.starts, lengths)]
        if max(last) >= self.max_blocks * self.cache.block_size:
            raise InvalidRequest(f"position {max(last)} lies past the {self.max_blocks} blocks a step can address")
        self.cache.reserve_batch(step.seq_ids, step.starts, [x + 1 for x in last])
        fwd = self.forwards[key]
        rows = fwd.load(step, drafts)
        graph = self.graphs.get(key)
        if graph is None:
            with torch.inference_mode():
                out = fwd.run()
        else:
            graph.replay()
            out = fwd.output
        return fwd, rows, out

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for key in sorted(self.forwards, reverse=True):  # largest first: smaller graphs reuse its memory
            self.graphs[key], _ = capture(self.forwards[key].run, pool)
