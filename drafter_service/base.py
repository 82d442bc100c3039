"""What every drafter shares: row buffers, padded batch attention, logits → drafts, and the verbs' checks.

A drafter kind (DFlash, MTP) subclasses `Drafter` and supplies four pieces of model math: a fresh
per-sequence state, how committed rows enter that state, how speculative state is dropped, and the
batched draft forward. Validation and position bookkeeping live here once, so every kind rejects
bad input the same way and a failed call never changes state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from specsplit.drafter_service.heads import TargetHead
from specsplit.drafter_service.store import SequenceStore, check_id
from specsplit.shared.errors import AlreadyExists, CapacityExceeded, InvalidRequest, StateConflict
from specsplit.shared.layers import masked_sdpa
from specsplit.shared.proposer import CarriedKV, DrafterSpec, Proposal, ProposeRequest, bitmask_to_bool
from specsplit.shared.staging import HostStaging, to_host

# Column name -> (shape of one row, dtype).
Schema = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Rows:
    """Named columns sharing one row axis, oldest first.

    Appends are amortised O(1): live rows sit in [start, end) of a buffer about twice the limit and
    are compacted to the front only when the end is reached. Past `limit` rows the oldest fall off.
    """

    def __init__(self, schema: Schema, device: torch.device, limit: int | None = None) -> None:
        self.limit = limit
        self._cols = {name: torch.empty((0, *shape), dtype=dtype, device=device)
                      for name, (shape, dtype) in schema.items()}
        self._start = self._end = 0

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._cols[name][self._start:self._end]

    @property
    def _capacity(self) -> int:
        return next(iter(self._cols.values())).shape[0]

    def append(self, **new: torch.Tensor) -> None:
        Rows.append_many([(self, new)])

    @staticmethod
    def append_many(appends: Sequence[tuple["Rows", dict[str, torch.Tensor]]]) -> None:
        """`append` for several Rows at once: the copies of each column go out as one multi-tensor
        copy instead of one small copy per Rows (a step appends to every sequence of the batch)."""
        copies: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

        def flush() -> None:  # before a buffer moves its rows, the copies into it must have landed
            for dsts, srcs in copies.values():
                torch._foreach_copy_(dsts, srcs)
            copies.clear()

        for rows, new in appends:
            for name, (dst, src) in rows._reserve(new, flush).items():
                pair = copies.setdefault(name, ([], []))
                pair[0].append(dst)
                pair[1].append(src)
        flush()

    def _reserve(self, new: dict[str, torch.Tensor], before_move: Callable[[], None]
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Make room for the new rows (calling `before_move` first if rows must move) and advance the
        end; returns (destination view, source) per column."""
        n = next(iter(new.values())).shape[0]
        if self.limit is not None and n > self.limit:
            new, n = {name: value[n - self.limit:] for name, value in new.items()}, self.limit
        if self.limit is not None:
            self._start += max(0, len(self) + n - self.limit)
        if self._end + n > self._capacity:
            before_move()
            self._make_room(n)
        start, self._end = self._end, self._end + n
        return {name: (self._cols[name][start:start + n], value) for name, value in new.items()}

    def _make_room(self, n: int) -> None:
        live, need = len(self), len(self) + n
        if 2 * need <= self._capacity:
            for col in self._cols.values():
                col[:live] = col[self._start:self._end].clone()
        else:
            size = max(2 * need, 16)
            if self.limit is not None:
                size = max(need, min(size, 2 * self.limit))
            for name, col in self._cols.items():
                grown = col.new_empty((size, *col.shape[1:]))
                grown[:live] = col[self._start:self._end]
                self._cols[name] = grown
        self._start, self._end = 0, live

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows."""
        self._end = self._start + min(length, len(self))

    def drop_front(self, n: int) -> None:
        self._start += min(n, len(self))

    def relimit(self, limit: int) -> None:
        self.limit = limit
        self._start = max(self._start, self._end - limit)


# ---- padded batch attention ---------------------------------------------------------------------


def pad_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Ragged [n_b, ...] tensors → [B, max n_b, ...], zero padded."""
    if len(parts) == 1:
        return parts[0].unsqueeze(0)
    return pad_sequence(list(parts), batch_first=True)


def valid_rows(lengths: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] bool: True on the first lengths[b] rows of each padded sequence."""
    counts = torch.tensor(list(lengths), device=device)
    return torch.arange(width, device=device)[None, :] < counts[:, None]


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, *, causal: bool,
               window: int | None) -> torch.Tensor:
    """[B, Tq, Tk] bool from positions (not row indices), as `shared.layers.visibility_mask` per batch row."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    visible = k_valid[:, None, :].expand_as(diff)
    if causal:
        visible = visible & (diff >= 0)
    if window is not None:
        visible = visible & (diff < window)
        if not causal:
            visible = visible & (-diff < window)
    return visible


def batched_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """GQA over a padded batch. q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], visible [B, Tq, Tk] → [B, Tq, Hq, D]."""
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)  # [B, Hq, Tq, D]
    kh = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    out = masked_sdpa(qh, kh, vh, visible[:, None], scale)
    return out.transpose(1, 2)


# ---- logits → drafts ----------------------------------------------------------------------------


class DraftVocab:
    """Draft ids ↔ target ids. With EAGLE-3's `d2t`, target_id = draft_id + d2t[draft_id]."""

    def __init__(self, d2t: torch.Tensor | None, target_vocab: int) -> None:
        self.target_vocab = target_vocab
        self.table = None if d2t is None else torch.arange(d2t.numel(), device=d2t.device) + d2t

    @property
    def size(self) -> int:
        return self.target_vocab if self.table is None else self.table.numel()

    def allowed(self, bitmask: torch.Tensor) -> torch.Tensor:
        """[draft vocab] bool from a target-vocabulary bitmask; InvalidRequest if nothing is left."""
        allowed = bitmask_to_bool(bitmask, self.target_vocab)
        if self.table is not None:
            allowed = allowed.to(self.table.device)[self.table]
        if not bool(allowed.any()):
            raise InvalidRequest("bitmask allows no token the drafter can propose")
        return allowed

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.table is None else self.table[ids]


def pick(logits: torch.Tensor, allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts and their log-probabilities. logits [..., V], allowed broadcastable bool or None.

    Disallowed tokens get -inf first, so the log-probability is under the constrained distribution.
    """
    scores = logits.float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    best = scores.max(dim=-1)  # the argmax of the scores themselves (log-softmax can round two into a tie)
    return best.indices, best.values - torch.logsumexp(scores, dim=-1)


def batch_allowed(allowed: Sequence[torch.Tensor | None], size: int, device: torch.device) -> torch.Tensor | None:
    """[B, size] bool, all True where a request has no bitmask; None when no request has one."""
    if all(a is None for a in allowed):
        return None
    full = torch.ones(size, dtype=torch.bool, device=device)
    return torch.stack([full if a is None else a.to(device) for a in allowed])


def proposals(tokens: torch.Tensor, logp: torch.Tensor | Callable[[], torch.Tensor],
              batch: Sequence["Draft"]) -> list[Proposal]:
    """tokens/logp [B, n] → one Proposal per request, cut to its num_drafts (one wait for the device;
    the log-probabilities, or the call that computes them, are read only when a request wants them)."""
    if any(d.request.want_confidence for d in batch):
        tokens, logp = to_host(tokens, logp() if callable(logp) else logp)
    else:
        (tokens,) = to_host(tokens)
    return [
        Proposal(tokens=tokens[i][:d.request.num_drafts],
                 confidence=logp[i][:d.request.num_drafts] if d.request.want_confidence else None)
        for i, d in enumerate(batch)
    ]


# ---- the verbs ----------------------------------------------------------------------------------


@dataclass
class SequenceState:
    budget: int  # positions 0..budget-1 may be committed
    next_pos: int = 0  # last committed position + 1
    stash: torch.Tensor | None = None  # [k+1, feature_dim] one verify's rows, until commit

    @property
    def rows_held(self) -> int:
        raise NotImplementedError

    @property
    def is_fresh(self) -> bool:
        return self.next_pos == 0 and self.stash is None


@dataclass(frozen=True)
class Append:
    """Committed rows [n, feature_dim] with their tokens [n] at positions base_pos.. for one sequence."""

    state: SequenceState
    tokens: list[int]  # checked ids, on the host: a kind that needs them on the device moves them
    rows: torch.Tensor
    base_pos: int


@dataclass
class Draft:
    """One validated propose request with its sequence's state."""

    state: SequenceState
    request: ProposeRequest
    allowed: torch.Tensor | None  # [draft vocab] bool from the bitmask, or None


class Drafter(ABC):
    """The `shared.proposer.Proposer` verbs over a `SequenceStore`; subclasses supply the model math."""

    spec: DrafterSpec

    def __init__(self, spec: DrafterSpec, head: TargetHead, vocab: DraftVocab, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec, self.head, self.vocab = spec, head, vocab
        self.dtype, self.device = dtype, device
        self.store: SequenceStore = SequenceStore()
        self.staging = HostStaging(device)  # per-step ints to the device without a host stall
        self._deferred: list[Append] | None = None  # inside `batched_appends`
        self._borrowed: list[tuple[SequenceState, torch.Tensor]] = []  # stashes that still hold callers' rows

    # -- model math, per kind --

    @abstractmethod
    def new_state(self, budget: int) -> SequenceState:
        """Empty state for a sequence that may commit positions 0..budget-1."""

    @abstractmethod
    def append_rows(self, state: SequenceState, tokens: list[int], rows: torch.Tensor, base_pos: int) -> None:
        """Take committed rows [n, feature_dim] with their tokens [n] at positions base_pos.."""

    def append_rows_batch(self, appends: Sequence["Append"]) -> None:
        """Several `append_rows` at once; a kind whose row math is row-independent runs one forward."""
        for a in appends:
            self.append_rows(a.state, a.tokens, a.rows, a.base_pos)

    # Whether committed rows may wait for the end of a `batched_appends` block: for kinds whose other
    # verbs inside a block (trim, take_kv) do not read what commits append (DFlash keeps nothing
    # speculative; MTP's commits only queue pending rows, which the propose after the block builds).
    defers_appends = False

    @contextmanager
    def batched_appends(self) -> Iterator[None]:
        """Inside the block, rows that commit/catchup would append wait, and enter their states in one
        `append_rows_batch` when it ends (per sequence in call order, so the result is the same).

        The caller's contract: row tensors it passes inside the block stay valid until the block ends
        (they are borrowed, not copied, until then)."""
        if not self.defers_appends or self._deferred is not None:
            yield
            return
        self._deferred = []
        try:
            yield
        finally:
            appends, self._deferred = self._deferred, None
            borrowed, self._borrowed = self._borrowed, []
            try:
                if appends:
                    with torch.no_grad():  # borrowed rows may be inference tensors
                        self.append_rows_batch(appends)
            finally:
                for state, rows in borrowed:  # stashed but not committed in the block: now a copy
                    if state.stash is rows:
                        state.stash = rows.clone()

    def _enter_rows(self, state: SequenceState, tokens: list[int], rows: torch.Tensor, base_pos: int) -> None:
        """Now, or at the end of the batched block (the rows stay valid until then, see `batched_appends`)."""
        if self._deferred is None:
            self.append_rows(state, tokens, rows, base_pos)
        else:
            self._deferred.append(Append(state, tokens, rows, base_pos))

    @abstractmethod
    def drop_speculative(self, state: SequenceState) -> None:
        """Forget state built from drafts (trim, take_kv)."""

    def fit_budget(self, state: SequenceState, fresh: SequenceState) -> None:
        """Adapt carried state to the sequence it is installed into, whose fresh state (released after)
        it replaces; it must not fail, since the install is then under way."""

    def release(self, state: SequenceState) -> None:
        """Give back what a state holds outside itself (pool blocks); it is never used again."""

    @abstractmethod
    def draft(self, batch: Sequence[Draft]) -> list[Proposal]:
        """Drafts for validated requests with num_drafts > 0, one forward per step for the batch."""

    # -- verbs --

    def alloc(self, seq_id: int, budget_tokens: int) -> None:
        check_id(seq_id, "seq_id")
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise InvalidRequest(f"budget_tokens must be a positive integer, got {budget_tokens!r}")
        state = self.new_state(budget_tokens)
        try:
            self.store.add(seq_id, state)
        except AlreadyExists:
            self.release(state)
            raise

    def prefill(self, seq_id: int, token_ids: Sequence[int], rows: torch.Tensor, start_pos: int = 0) -> int:
        return self._append(seq_id, token_ids, rows, start_pos, "prefill")

    def catchup(self, seq_id: int, token_ids: Sequence[int], rows: torch.Tensor, base_pos: int) -> int:
        return self._append(seq_id, token_ids, rows, base_pos, "catchup")

    @torch.no_grad()
    def _append(self, seq_id: int, token_ids: Sequence[int], rows: torch.Tensor, base_pos: int, verb: str) -> int:
        state = self.store.get(seq_id)
        rows = self._check_rows(rows)
        tokens = self._check_tokens(token_ids, rows.shape[0])
        self._check_span(state, base_pos, rows.shape[0], verb)
        if rows.shape[0]:
            self._enter_rows(state, tokens, rows, base_pos)
            state.next_pos = base_pos + rows.shape[0]
        return rows.shape[0]

    def stash(self, seq_id: int, rows: torch.Tensor) -> None:
        state = self.store.get(seq_id)
        rows = self._check_rows(rows)
        if not 1 <= rows.shape[0] <= self.spec.max_drafts + 1:
            raise InvalidRequest(f"stash takes 1..{self.spec.max_drafts + 1} rows, got {rows.shape[0]}")
        if self._deferred is not None:
            # Inside a batched block the caller's rows stay valid until it ends (a verify's output, a
            # step message's buffer): borrow them, since most are committed before then; the block's
            # end copies those that were not.
            state.stash = rows
            self._borrowed.append((state, rows))
        else:
            state.stash = rows.clone()  # the caller reuses its verify buffer

    @torch.no_grad()
    def commit(self, seq_id: int, num_rows: int, base_pos: int, token_ids: Sequence[int]) -> None:
        state = self.store.get(seq_id)
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise InvalidRequest(f"num_rows must be a positive integer, got {num_rows!r}")
        if state.stash is None:
            raise StateConflict(f"sequence {seq_id}: commit without a stash")
        if num_rows > state.stash.shape[0]:
            raise StateConflict(f"sequence {seq_id}: commit of {num_rows} rows, {state.stash.shape[0]} stashed")
        tokens = self._check_tokens(token_ids, num_rows)
        self._check_span(state, base_pos, num_rows, "commit")
        self._enter_rows(state, tokens, state.stash[:num_rows], base_pos)
        state.next_pos = base_pos + num_rows
        state.stash = None

    @torch.no_grad()
    def commit_verified(self, seq_id: int, rows: torch.Tensor, num_accepted: int, base_pos: int,
                        token_ids: Sequence[int]) -> None:
        """`stash(rows)`, `commit(num_accepted + 1, base_pos, token_ids)` and `trim(num_accepted)` in one
        call, for an in-process engine after a verify of len(rows) - 1 drafts: the same checks (all made
        before anything changes) and the same result, with one lookup and no stash."""
        state = self.store.get(seq_id)
        rows = self._check_rows(rows)
        if not 1 <= rows.shape[0] <= self.spec.max_drafts + 1:
            raise InvalidRequest(f"stash takes 1..{self.spec.max_drafts + 1} rows, got {rows.shape[0]}")
        if isinstance(num_accepted, bool) or not isinstance(num_accepted, int) \
                or not 0 <= num_accepted < rows.shape[0]:
            raise InvalidRequest(f"num_accepted must be in 0..{rows.shape[0] - 1}, got {num_accepted!r}")
        count = num_accepted + 1
        tokens = self._check_tokens(token_ids, count)
        self._check_span(state, base_pos, count, "commit")
        state.stash = None
        # Inside a batched block the rows are borrowed until it ends (see `batched_appends`), outside it
        # they enter now: either way they need no copy.
        self._enter_rows(state, tokens, rows[:count], base_pos)
        state.next_pos = base_pos + count
        self.drop_speculative(state)

    @torch.no_grad()
    def commit_verified_many(self, seq_ids: Sequence[int], rows: torch.Tensor, row_starts: Sequence[int],
                             row_counts: Sequence[int], num_accepted: Sequence[int], base_pos: Sequence[int],
                             token_ids: Sequence[Sequence[int]]) -> None:
        """`commit_verified` for a step's sequences in one call: sequence i's verify rows are
        rows[row_starts[i]:row_starts[i] + row_counts[i]]. The same checks, all made before anything
        changes (one bad entry refuses the call), and the same result as the calls in order, with the
        per-call overhead (lookups, checks, dispatch) paid once per step instead of once per sequence."""
        rows = self._check_rows(rows)
        n = len(seq_ids)
        if not n == len(row_starts) == len(row_counts) == len(num_accepted) == len(base_pos) == len(token_ids):
            raise InvalidRequest("commit_verified_many takes one entry per sequence in every column")
        columns = (seq_ids, row_starts, row_counts, num_accepted, base_pos)
        if any(type(v) is not int for column in columns for v in column):  # bools too: not positions
            raise InvalidRequest("commit_verified_many's ids, rows, counts and positions must be ints")
        if len(set(seq_ids)) != n:
            raise InvalidRequest("commit_verified_many names a sequence twice")
        states = [self.store.get(seq_id) for seq_id in seq_ids]
        most = self.spec.max_drafts + 1
        for state, start, count, accepted, pos, tokens in zip(states, row_starts, row_counts, num_accepted,
                                                               base_pos, token_ids):
            if not 1 <= count <= most or start < 0 or start + count > rows.shape[0]:
                raise InvalidRequest(f"verify rows [{start}, {start + count}) must be 1..{most} of the "
                                     f"{rows.shape[0]} given")
            if not 0 <= accepted < count:
                raise InvalidRequest(f"num_accepted must be in 0..{count - 1}, got {accepted}")
            if len(tokens) != accepted + 1 or any(type(t) is not int or not 0 <= t < self.spec.vocab_size
                                                  for t in tokens):
                raise InvalidRequest(f"{accepted + 1} token ids in 0..{self.spec.vocab_size - 1} expected, "
                                     f"got {list(tokens)!r}")
            self._check_span(state, pos, accepted + 1, "commit")
        for state, start, accepted, pos, tokens in zip(states, row_starts, num_accepted, base_pos, token_ids):
            state.stash = None
            self._enter_rows(state, list(tokens), rows[start:start + accepted + 1], pos)
            state.next_pos = pos + accepted + 1
            self.drop_speculative(state)

    def trim(self, seq_id: int, num_accepted: int) -> None:
        state = self.store.get(seq_id)
        if isinstance(num_accepted, bool) or not isinstance(num_accepted, int) \
                or not 0 <= num_accepted <= self.spec.max_drafts:
            raise InvalidRequest(f"num_accepted must be in 0..{self.spec.max_drafts}, got {num_accepted!r}")
        state.stash = None
        self.drop_speculative(state)

    @torch.no_grad()
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        batch = self._check_requests(requests)
        out: list[Proposal] = []
        for i in range(0, len(batch), self.spec.max_batch):
            chunk = batch[i:i + self.spec.max_batch]
            drafting = [d for d in chunk if d.request.num_drafts > 0]
            drafted = iter(self.draft(drafting) if drafting else [])
            out += [next(drafted) if d.request.num_drafts > 0 else Proposal(tokens=[]) for d in chunk]
        return out

    @torch.no_grad()
    def propose_on_device(self, requests: Sequence[ProposeRequest]) -> torch.Tensor | None:
        """Drafts left on the device, for an in-process engine that feeds them to its verify forward
        without waiting for them: [len(requests), n] target ids (n at least the widest num_drafts),
        request i's in row i[:num_drafts].

        The tensor is valid until the next propose. None when this batch needs the host path (a bitmask,
        confidences, a request for no drafts, a batch wider than one forward, or a kind or size with no
        device path); the caller then calls `propose`. Checks and errors are `propose`'s."""
        if not 0 < len(requests) <= self.spec.max_batch or any(
                not isinstance(r, ProposeRequest) or r.bitmask is not None or r.want_confidence or r.num_drafts == 0
                for r in requests):
            return None
        return self.draft_on_device(self._check_requests(requests))

    def draft_on_device(self, batch: Sequence[Draft]) -> torch.Tensor | None:
        """`draft`'s token ids [B, n >= the widest num_drafts] left on the device, or None where a kind
        has no such path."""
        return None

    def free(self, seq_id: int) -> None:
        self.release(self.store.pop(seq_id))

    def take_kv(self, seq_id: int) -> CarriedKV:
        state = self.store.get(seq_id)
        fresh = self.new_state(state.budget)  # first: if it cannot be had, nothing has changed
        state.stash = None
        self.drop_speculative(state)
        self.store.replace(seq_id, fresh)
        return CarriedKV(self.store.park(state), state.rows_held, state.next_pos - 1)

    def install_kv(self, seq_id: int, handle: int) -> CarriedKV:
        state = self.store.get(seq_id)
        carried = self.store.carried(handle)
        if not state.is_fresh:
            raise StateConflict(f"sequence {seq_id} already holds drafter state; install needs a fresh one")
        if carried.next_pos > state.budget:
            raise CapacityExceeded(
                f"carried KV reaches position {carried.next_pos - 1}, beyond sequence {seq_id}'s budget "
                f"of {state.budget} tokens"
            )
        self.store.unpark(handle)
        self.fit_budget(carried, state)
        carried.budget = state.budget
        self.store.replace(seq_id, carried)
        self.release(state)
        return CarriedKV(handle, carried.rows_held, carried.next_pos - 1)

    def free_kv(self, handle: int) -> None:
        self.release(self.store.unpark(handle))

    # -- checks --

    def _check_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != self.spec.feature_dim:
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise InvalidRequest(f"rows must be [n, {self.spec.feature_dim}], got {shape}")
        if rows.dtype != self.dtype:
            raise InvalidRequest(f"rows must be {self.dtype}, got {rows.dtype}")
        return rows.detach().to(self.device)

    def _check_tokens(self, token_ids: Sequence[int], count: int) -> list[int]:
        """Checked on the host (ids in a device tensor are read back once); they stay there."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise InvalidRequest("token_ids must be a 1-D integer tensor or a list of ints")
            values = token_ids.tolist()
        else:
            values = list(token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in values):
                raise InvalidRequest("token_ids must be ints")
        if len(values) != count:
            raise InvalidRequest(f"{len(values)} token ids for {count} rows")
        if count and (min(values) < 0 or max(values) >= self.spec.vocab_size):
            raise InvalidRequest(f"token ids must lie in 0..{self.spec.vocab_size - 1}")
        return values

    def _check_span(self, state: SequenceState, base_pos: int, count: int, verb: str) -> None:
        if isinstance(base_pos, bool) or not isinstance(base_pos, int) or base_pos < 0:
            raise InvalidRequest(f"{verb}: position must be a non-negative integer, got {base_pos!r}")
        if base_pos != state.next_pos:
            raise StateConflict(f"{verb} at position {base_pos}, but the next position is {state.next_pos}")
        if base_pos + count > state.budget:
            raise CapacityExceeded(
                f"{verb} reaches position {base_pos + count - 1}, beyond the budget of {state.budget} tokens"
            )

    def _check_requests(self, requests: Sequence[ProposeRequest]) -> list[Draft]:
        seen: set[int] = set()
        batch = []
        for request in requests:
            if not isinstance(request, ProposeRequest):
                raise InvalidRequest(f"propose takes ProposeRequest items, got {type(request).__name__}")
            state = self.store.get(request.seq_id)
            if request.seq_id in seen:
                raise InvalidRequest(f"sequence {request.seq_id} appears twice in one propose")
            seen.add(request.seq_id)
            batch.append(Draft(state, request, self._check_request(state, request)))
        return batch

    def _check_request(self, state: SequenceState, request: ProposeRequest) -> torch.Tensor | None:
        n = request.num_drafts
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.spec.max_drafts:
            raise InvalidRequest(f"num_drafts must be in 0..{self.spec.max_drafts}, got {n!r}")
        self._check_tokens([request.last_token], 1)
        if request.position != state.next_pos:
            raise StateConflict(
                f"sequence {request.seq_id}: propose at position {request.position}, "
                f"but the anchor position is {state.next_pos}"
            )
        if request.position >= state.budget:
            raise CapacityExceeded(f"sequence {request.seq_id}: anchor position {request.position} "
                                   f"is beyond the budget of {state.budget} tokens")
        return None if request.bitmask is None else self.vocab.allowed(request.bitmask)
