"""One connected target's view of the shared drafter: its buffers, its sequence ids, its carried KV.

Every target names sequences from 0, so a session maps the client's seq ids to drafter-wide unique
ids; a client can only reach the sequences and carried-KV handles it created. Rows arrive as
references into buffers the session registered (or inline) and are resolved here, so the drafter
only ever sees tensors. The drafter copies what it keeps (within a step it may read the rows until the
step's batched block ends), and every read is finished before a call returns (the target reuses its
row slots as soon as it has the answer), except in a Step whose drafts go into the target's drafts
buffer: there the buffer's event, recorded after all of the step's work, orders the target's reuse.
Unmapping buffers (a release, the session's end) first waits for any such work still queued. Rows
and head weights in the target's CUDA buffers are read only once the host has seen the target's
writes done (`await_writes`, called by the server outside the drafter lock; inside it each read only
checks): the drafter's stream never waits on a client's event. A
session holds at most what `DrafterLimits` lets one connection hold, and its errors name the client's
sequence ids, never the drafter-wide ones.

Not thread-safe: the server serializes every call into the shared drafter with one lock.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch

from specsplit.drafter_service.heads import TargetHead
from specsplit.shared.cuda_graphs import capture_serving, inlined
from specsplit.shared.device_waits import DeviceWaits
from specsplit.shared.host_flags import Flag, HostPage
from specsplit.drafter_service.limits import DrafterLimits
from specsplit.shared.errors import (
    AlreadyExists,
    CapacityExceeded,
    InvalidRequest,
    SpecsplitError,
    StateConflict,
    UnknownSequence,
    WritesPending,
)
from specsplit.shared.proposer import CarriedKV, Proposal, Proposer, ProposeRequest
from specsplit.shared.stream_ops import stream_ops
from specsplit.shared.tree import TREE_KEEP
from specsplit.shared.transport import (
    FEED_ROWS, BufferDescriptor, BufferImporter, BufferKind, BufferRole, HEAD_ROLES, InlineRows, RowRef, RowSource,
)
from specsplit.shared.wire import ChainStep, RowsOp, SeqError, SeqStep, StepBatch, StepResult, VerifiedColumns

log = logging.getLogger(__name__)
_SEQUENCE = re.compile(r"\bsequence (\d+)\b")
MAX_CHAIN_POSITION = 1 << 30  # a feed's positions are bounded here before any arithmetic (int64 on the device)
CHAIN_CAPTURE_AFTER = 8  # uncaptured runs of a chained step's shape before it is captured (with chain_graphs)
# A connection's chained-step graphs (captured or given up) and the shapes counted towards one, at most: a
# shape holds the addresses of the rows a target references, so a target naming new offsets every step
# would otherwise grow both, and every graph holds memory. Past the graphs, shapes run uncaptured; past
# the shapes, the one run longest ago is forgotten.
MAX_CHAIN_GRAPHS = 16
MAX_CHAIN_SHAPES = 64
# How a chained step's fused device work ran (--chain-graphs): uncaptured (its shape not captured yet, or
# given up), captured (this step, then replayed), replayed, failed (its capture failed: run uncaptured),
# prepared (replayed, its host work done before the target's writes were: Session.prepare_chain), waited
# (prepared and launched at once, our stream waiting on the device for the target's writes: --device-waits)
CHAIN_GRAPH_OUTCOMES = ("uncaptured", "captured", "replayed", "failed", "prepared", "waited")


def _bounded(values: torch.Tensor) -> torch.Tensor:
    """A feed row as int64, in [0, MAX_CHAIN_POSITION] (on the device, nothing read back)."""
    return values.to(torch.int64).clamp(0, MAX_CHAIN_POSITION)


def done_flags(device: torch.device) -> bool:
    """Whether a drafter on `device` writes chained steps' done values (DrafterDescription.done_flags)."""
    return device.type == "cuda" and stream_ops() is not None


def chains(proposer: Proposer) -> bool:
    """Whether `proposer` serves chained steps (StepRequest.chain): DFlash over its static forwards."""
    return getattr(type(proposer), "chain_batch", None) is not None and getattr(proposer, "refine", None) is None \
        and getattr(proposer, "propose_graphs", None) is not None and getattr(proposer, "context_graphs", None) is not None


def served_tree_keep(proposer: Proposer) -> int:
    """How many candidates a row `proposer`'s chained proposes answer a draft tree (DrafterDescription.tree_keep;
    ChainStep.tree_keep must equal it): TREE_KEEP, at most the draft vocabulary; 0 where it offers none (not
    DFlash over its static forwards). One value: the top-k kernel is compiled for it once, and no peer can make
    the drafter compile more or sort whole vocabularies."""
    if not chains(proposer) or getattr(type(proposer), "chain_candidates", None) is None:
        return 0
    return min(TREE_KEEP, getattr(getattr(proposer, "vocab", None), "size", TREE_KEEP))


def candidate_columns(num_drafts: int, tree_keep: int) -> int:
    """The drafts-buffer columns a chained propose's answer takes: its drafts, or (ChainStep.tree_keep) its rows'
    candidate ids and then their log-probabilities' bit patterns."""
    return 2 * num_drafts * tree_keep if tree_keep else num_drafts


def _in_client_ids(verb):
    """Errors out of `verb` name the client's sequence ids: the drafter raised them with its own."""

    @functools.wraps(verb)
    def wrapped(self: "Session", *args, **kwargs):
        try:
            return verb(self, *args, **kwargs)
        except SpecsplitError as err:
            if not getattr(err, "in_client_ids", False):  # verbs nest: rewrite once
                err.args = (self._client_ids(str(err)), *err.args[1:])
                _client_named(err)
            raise

    return wrapped


def _client_named(err: SpecsplitError) -> SpecsplitError:
    """Mark an error whose message already names the client's ids."""
    err.in_client_ids = True
    return err


class Usage(NamedTuple):
    """What one connection holds (for metrics)."""

    sequences: int
    carried_kvs: int
    buffers: int
    buffer_bytes: int


@dataclasses.dataclass(frozen=True)
class PrefillPhases:
    """Host seconds of one prefill's parts: resolving its rows (their checks), the context forward (its
    launch on a GPU), and the wait for the rows to be read (the stream's work queued before, included)."""
    rows: float = 0.0
    context: float = 0.0
    wait: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepPhases:
    """Host seconds of one step's parts: the commits (register, stash, commit, trim, catch-up; less the
    two below), resolving their row references (`rows`: their checks), the
    batched context forward they end with (`context`: its launch, or its work on the CPU), the proposes
    (with their drafts' read-back, or only their launch into the drafts buffer; less the next), the
    launches of chained steps' CUDA graphs (`replay`: the host's side of cudaGraphLaunch), and the last
    wait before the target's buffers are free."""
    commit: float = 0.0
    rows: float = 0.0
    context: float = 0.0
    propose: float = 0.0
    replay: float = 0.0
    wait: float = 0.0


class _Prepared(NamedTuple):
    """A chained step prepared before the target's writes (Session.prepare_chain), to launch after them."""

    step_id: int
    chain: ChainStep
    graph: object  # torch.cuda.CUDAGraph
    done: list[Flag] | None  # the DONE buffer's flags, if the step names one
    event: object  # the drafts buffer's event
    turn: int  # Session.turns when prepared
    seconds: float  # the host time it took
    written: Flag | None  # the DONE buffer's element 1, when our stream waits for the target's writes there


class PreparedLaunch:
    """What `Session.prepare_chain` gives: call it to launch. `device_waited`: our stream waits on the device
    for the target's writes (ChainStep.written_value), so the server's host waits for none before the call."""

    def __init__(self, launch: Callable[[], StepResult], device_waited: bool) -> None:
        self._launch, self.device_waited = launch, device_waited

    def __call__(self) -> StepResult:
        return self._launch()


class Session:
    """A client's sequences and buffers over the shared `proposer` (all ids here are the client's)."""

    def __init__(self, proposer: Proposer, *, client_id: str, new_seq_id: Callable[[], int],
                 head: TargetHead | None, device: torch.device, limits: DrafterLimits = DrafterLimits(),
                 chain_graphs: bool = False, on_chain_graph: Callable[[str], None] | None = None,
                 waits: DeviceWaits | None = None, prefill_copies: bool = False,
                 chain_capture_after: int = CHAIN_CAPTURE_AFTER) -> None:
        # chain_graphs: a chained step's commit, propose and drafts copy replayed as one CUDA graph per
        # shape once it has run `chain_capture_after` times (see _chain_device); on_chain_graph is told
        # how each such step ran (an outcome of CHAIN_GRAPH_OUTCOMES: the server's metrics); waits: our
        # stream's device waits for the target's written values (drafter --device-waits; see prepare_chain)
        # prefill_copies: a prefill's CUDA IPC rows are copied out on a stream of their own and only the copy is
        # waited for (see prefill)
        self.proposer, self.client_id = proposer, client_id
        self.device = torch.device(device)
        self.prefill_copies = prefill_copies and self.device.type == "cuda"
        self._copy_stream: torch.cuda.Stream | None = None  # (made on the first copy)
        self._copy_wait = 0.0  # host seconds the last prefill waited for its copy
        self.limits = limits
        self.importer = BufferImporter()
        self.page: HostPage | None = None  # the DONE page its Step socket hello passed (shared.host_flags)
        self._new_seq_id = new_seq_id  # drafter-wide unique ids, shared by all sessions
        self._default_head = head  # the server's own head, used until this client registers one
        self._head: TargetHead | None = None  # views into the client's TARGET_EMBEDDING / LM_HEAD buffers
        self._head_ids: tuple[int, ...] = ()  # the buffers `_head` views
        # Their writes seen done: a head is written once, so it is not asked again (a target that writes
        # its head again afterwards only garbles its own drafts).
        self._head_written = False
        self._waiting = threading.Lock()  # held by the one call of this connection waiting for its writes
        self._seqs: dict[int, int] = {}  # client seq id → drafter seq id
        self._in_step = False  # inside step(): row reads are waited on once, after the batched block
        self._handles: dict[int, int] = {}  # carried-KV handle this client owns → rows it holds
        self._reserved: dict[int, int] = {}  # client seq id → context rows its budget may come to hold
        self._buffer_bytes: dict[int, int] = {}  # registered buffer id → bytes
        self.streaming = False  # a Step stream is open (one per client at a time)
        self.last_call = time.monotonic()  # of a unary call (the server frees long-idle sessions without a stream)
        self.closed = False
        self.last_phases = StepPhases()  # of the last step()
        self.last_prefill = PrefillPhases()  # of the last prefill()
        self._rows_seconds = 0.0  # spent in _rows since the step began
        self._replay_seconds = 0.0  # spent launching chained steps' graphs since the step began
        self.chain_graphs = chain_graphs and self.device.type == "cuda"
        if isinstance(chain_capture_after, bool) or not isinstance(chain_capture_after, int) or chain_capture_after < 0:
            raise InvalidRequest(f"chain_capture_after is a number of runs >= 0, got {chain_capture_after!r}")
        self.chain_capture_after = chain_capture_after
        self._chain_graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}  # by shape and addresses; None: broken
        self._chain_runs: dict[tuple, int] = {}  # uncaptured runs of each shape
        self._chain_pool = None  # the graphs' memory pool
        self._deferred: tuple | None = None  # a chained commit left to run with its propose (_chain_device)
        self._on_chain_graph = on_chain_graph or (lambda outcome: None)
        self.chain_graph_error: str | None = None  # why the last capture that failed failed
        self.turns = 0  # calls the server has run for this connection (see prepare_chain)
        self.waits = waits

    # ---- ids ------------------------------------------------------------------------------------

    def _internal(self, seq_id: int) -> int:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise _client_named(UnknownSequence(f"sequence {seq_id} is not allocated on this connection")) from None

    def _own_handle(self, handle: int) -> int:
        if handle not in self._handles:
            raise UnknownSequence(f"no carried drafter KV under handle {handle} on this connection")
        return handle

    def _client_ids(self, message: str) -> str:
        clients = {internal: client for client, internal in self._seqs.items()}
        return _SEQUENCE.sub(lambda m: f"sequence {clients.get(int(m[1]), '?')}", message)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def usage(self) -> Usage:
        """Safe without the drafter lock: each count reads one dict once (a scrape must not wait on a step)."""
        buffer_bytes = list(self._buffer_bytes.values())
        return Usage(len(self._seqs), len(self._handles), len(buffer_bytes), sum(buffer_bytes))

    # ---- what one connection may hold (DrafterLimits) -------------------------------------------

    def _check_room(self, extra_rows: int, entries: int = 1) -> None:
        """Room for `entries` more sequences or carried KVs that may hold `extra_rows` more context rows."""
        held = len(self._seqs) + len(self._handles)
        if held + entries > self.limits.max_sequences:
            raise CapacityExceeded(f"this connection holds its limit of {self.limits.max_sequences} sequences "
                                   "and carried KVs (--max-sequences)")
        rows = sum(self._reserved.values()) + sum(self._handles.values())
        if rows + extra_rows > self.limits.max_rows:
            raise CapacityExceeded(f"{extra_rows} more context rows would pass this connection's limit of "
                                   f"{self.limits.max_rows} (--max-rows; {rows} held or reserved)")

    def _check_buffers(self, descriptors: Sequence[BufferDescriptor]) -> None:
        if len(self._buffer_bytes) + len(descriptors) > self.limits.max_buffers:
            raise CapacityExceeded(f"a connection registers at most {self.limits.max_buffers} buffers at once")
        total = sum(self._buffer_bytes.values()) + sum(d.nbytes for d in descriptors)
        if total > self.limits.buffer_bytes:
            raise CapacityExceeded(f"registering {total} buffer bytes would pass this connection's limit of "
                                   f"{self.limits.max_buffer_mib:g} MiB (--max-buffer-mib)")

    # ---- buffers and the target head ------------------------------------------------------------

    def register(self, descriptors: Sequence[BufferDescriptor]) -> None:
        """Open all the buffers or none; head buffers (re)bind the target head. Registering consumes the
        segments' names (shared.transport), so a target whose head is refused here registers fresh ones."""
        descriptors = list(descriptors)
        if not descriptors:  # (every Step message comes through here: most register nothing)
            return
        self.importer.register(descriptors)  # each descriptor is checked first: a bad one is INVALID_ARGUMENT
        if any(d.role in HEAD_ROLES for d in descriptors):
            self._drop_chain_graphs()  # (the head is bound anew: graphs read the old one's weights)
        try:
            self._check_buffers(descriptors)
        except CapacityExceeded:
            self.importer.release(d.buffer_id for d in descriptors)
            raise
        self._buffer_bytes.update((d.buffer_id, d.nbytes) for d in descriptors)
        if any(d.role in HEAD_ROLES for d in descriptors):
            try:
                self._head = self._head_from_buffers()
            except Exception:
                self.release(d.buffer_id for d in descriptors)
                raise

    def release(self, buffer_ids: Iterable[int]) -> None:
        buffer_ids = list(buffer_ids)
        self._finish_reads()  # a step that answered without waiting may still read (or write) them
        roles = {self.importer.descriptor(i).role for i in buffer_ids}
        # graphs over a released buffer's memory must not replay (a head's: the head is bound anew)
        self._drop_chain_graphs(None if roles & HEAD_ROLES else set(buffer_ids))
        self.importer.release(buffer_ids)
        for buffer_id in buffer_ids:
            self._buffer_bytes.pop(buffer_id, None)
        if roles & HEAD_ROLES:
            try:
                self._head = self._head_from_buffers()
            except InvalidRequest as err:  # e.g. the embedding released, its LM head kept
                log.warning("client %s: target head unbound: %s", self.client_id, err)
                self._head = None

    def _head_from_buffers(self) -> TargetHead | None:
        embeds = self.importer.with_role(BufferRole.TARGET_EMBEDDING)
        lm_heads = self.importer.with_role(BufferRole.TARGET_LM_HEAD)
        if not embeds and not lm_heads:
            return None
        if len(embeds) != 1 or len(lm_heads) > 1:
            raise InvalidRequest(
                "a target head is one TARGET_EMBEDDING buffer plus at most one TARGET_LM_HEAD buffer (none when "
                f"tied); got {len(embeds)} and {len(lm_heads)}"
            )
        embed = self._head_view(embeds[0])
        lm_head = self._head_view(lm_heads[0]) if lm_heads else embed
        self._head_ids = tuple(d.buffer_id for d in embeds + lm_heads)
        self._head_written = False
        return TargetHead(embed, lm_head)

    def _head_view(self, descriptor: BufferDescriptor) -> torch.Tensor:
        spec = self.proposer.spec
        if (descriptor.rows, descriptor.cols) != (spec.vocab_size, spec.hidden_size):
            raise InvalidRequest(
                f"buffer {descriptor.buffer_id} ({descriptor.role.value}) is [{descriptor.rows}, {descriptor.cols}], "
                f"the drafter needs [{spec.vocab_size}, {spec.hidden_size}]"
            )
        # A view on the drafter's GPU (CUDA IPC) is used in place, read once the target's writes are seen
        # done (`_bind_head`); shared-memory rows arrive as a copy (the importer never maps a client's
        # file), moved to a GPU drafter once.
        whole = self.importer.whole(descriptor.buffer_id)
        if whole.device.type == "cuda" and whole.device != _indexed(self.device):
            # copied now, under the drafter lock: never waited for here (WritesPending if not done yet)
            self.importer.check_written(descriptor.buffer_id)
        return whole.to(self.device)

    def _bind_head(self) -> None:
        if self._head is not None:
            if not self._head_written:
                for buffer_id in self._head_ids:  # WritesPending unless the target's writes were seen done
                    self.importer.check_written(buffer_id)
                self._head_written = True
        head = self._head or self._default_head
        if head is None:
            raise StateConflict(
                "no target head is bound: register TARGET_EMBEDDING (and TARGET_LM_HEAD) buffers first"
            )
        # Drafter keeps its TargetHead in a plain `head` attribute read at every propose; the drafter is
        # shared, so the calling session's head is bound before each propose (calls are serialized).
        self.proposer.head = head

    # ---- rows ----------------------------------------------------------------------------------

    def await_writes(self, buffer_ids: Iterable[int], *, head: bool = False,
                     stop: Callable[[], bool] | None = None) -> None:
        """Poll until the target's writes into these buffers (and its head's, with `head`) are done, for at
        most `limits.writes_wait_seconds` or until the session closes or `stop()` turns true (WritesPending
        then). The server calls it outside the drafter lock, before a call that reads them: a target whose
        GPU work never ends stalls only itself, and with at most one of its calls waiting at a time (a
        second is refused at once) it holds at most one server thread beside its Step stream's."""
        ids = list(buffer_ids) + (list(self._head_ids) if head and not self._head_written else [])
        if not ids:
            return
        try:
            self.importer.await_written(ids, 0.0)  # done already: the usual case, no wait
            return
        except WritesPending:
            pass
        if not self._waiting.acquire(blocking=False):
            raise WritesPending("another call of this connection is already waiting for its GPU writes")
        try:
            self.importer.await_written(ids, self.limits.writes_wait_seconds,
                                        lambda: self.closed or (stop is not None and stop()))
        finally:
            self._waiting.release()

    def _rows(self, source: RowSource) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self._resolve(source)
        finally:
            self._rows_seconds += time.perf_counter() - started

    def _resolve(self, source: RowSource) -> torch.Tensor:
        """[rows, feature_dim]: a view of a registered buffer, or the decoded inline rows.

        Rows that reach the host anyway (inline, or copied out of shared memory) must be finite: a NaN
        row would poison the sequence's drafts. CUDA IPC rows are not checked, since reading a flag
        back from the GPU would cost every step a device sync.
        """
        on_host = isinstance(source, InlineRows) or self.importer.descriptor(source.buffer_id).kind is BufferKind.SHM
        rows = self.importer.resolve(source, cols=self.proposer.spec.feature_dim,
                                     device=None if on_host else self.device)
        if on_host:
            if not bool(torch.isfinite(rows).all()):
                raise InvalidRequest("feature rows must be finite (a row holds NaN or infinity)")
            rows = rows.to(self.device)
        return rows

    def _copied_out(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of `rows` (a view of the target's CUDA IPC buffer, its writes into them seen done), made on a
        stream of our own at once and waited for: the target may write its buffer again as soon as the call
        answers, while the work that reads the copy runs in our stream's order, after the work queued there
        before it (which `_finish_reads` would wait for too). The copies' memory stays cached for the copy
        stream: about the longest prompt's rows."""
        main = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            copy = rows.clone()
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        main.wait_event(done)
        copy.record_stream(main)  # (allocated on the copy stream, used on ours: not reused before that use)
        waited = time.perf_counter()
        done.synchronize()
        self._copy_wait += time.perf_counter() - waited
        return copy

    def _finish_reads(self) -> None:
        """Wait for queued copies out of the target's buffers before the target may reuse them."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ---- verbs ---------------------------------------------------------------------------------

    @_in_client_ids
    def alloc(self, seq_id: int, budget_tokens: int) -> None:
        if seq_id in self._seqs:
            raise _client_named(AlreadyExists(f"sequence {seq_id} is already allocated on this connection"))
        rows = self.limits.rows_reserved(self.proposer.spec, budget_tokens)
        self._check_room(rows)
        internal = self._new_seq_id()
        self.proposer.alloc(internal, budget_tokens)
        self._seqs[seq_id] = internal
        self._reserved[seq_id] = rows

    @_in_client_ids
    def prefill(self, seq_id: int, op: RowsOp) -> int:
        """The prompt's rows into the sequence's context; `last_prefill` holds the host's seconds on its
        rows (resolving and checks), the context forward, and the wait for the rows to be read."""
        internal = self._internal(seq_id)
        started, rows_before = time.perf_counter(), self._rows_seconds
        copied, self._copy_wait = False, 0.0
        try:
            rows = self._rows(op.rows)
            if self.prefill_copies and isinstance(op.rows, RowRef) \
                    and self.importer.descriptor(op.rows.buffer_id).kind is BufferKind.CUDA_IPC:
                rows, copied = self._copied_out(rows), True
            return self.proposer.prefill(internal, op.token_ids, rows, op.base_pos)
        finally:
            launched = time.perf_counter()
            if not copied:
                self._finish_reads()
            rows = self._rows_seconds - rows_before
            self.last_prefill = PrefillPhases(rows=rows, context=launched - started - rows - self._copy_wait,
                                              wait=time.perf_counter() - launched + self._copy_wait)

    @_in_client_ids
    def apply(self, step: SeqStep) -> int:
        """One sequence's operations, in the wire's order: alloc, catchup, stash, commit, trim, free.
        Returns the rows the catch-up appended (0 without one). With an alloc (an attach on the Step
        stream), an operation refused after it frees the sequence again: nothing of it is held."""
        if step.alloc is None:
            return self._apply(step)
        self.alloc(step.seq_id, step.alloc)
        try:
            return self._apply(step)
        except BaseException:
            if step.seq_id in self._seqs:
                try:
                    self.free(step.seq_id)
                except Exception as exc:  # noqa: BLE001 - the refusal is the error to answer
                    log.warning("client %s: freeing sequence %d after its refused attach failed (%s: %s)",
                                self.client_id, step.seq_id, type(exc).__name__, exc)
            raise

    def _apply(self, step: SeqStep) -> int:
        internal = self._internal(step.seq_id)
        if self._verified(step):
            # stash + commit + trim of one verify: one drafter call (same checks, nothing changed on error)
            try:
                self.proposer.commit_verified(internal, self._rows(step.stash), step.trim, step.commit.base_pos,
                                              step.commit.token_ids)
            finally:
                if not self._in_step:
                    self._finish_reads()
            return 0
        appended = 0
        try:
            if step.catchup is not None:
                c = step.catchup
                appended = self.proposer.catchup(internal, c.token_ids, self._rows(c.rows), c.base_pos)
            if step.stash is not None:
                self.proposer.stash(internal, self._rows(step.stash))
        finally:
            if not self._in_step:  # a step waits once, after its batched block has read every row
                self._finish_reads()
        if step.commit is not None:
            c = step.commit
            self.proposer.commit(internal, c.num_rows, c.base_pos, c.token_ids)
        if step.trim is not None:
            self.proposer.trim(internal, step.trim)
        if step.free:
            self.free(step.seq_id)
        return appended

    def _verified(self, step: SeqStep) -> bool:
        """Whether `step` is exactly one verify's stash, commit and trim, and the drafter takes that in
        one call (looked up on its class, as the engine does)."""
        return (step.catchup is None and not step.free and step.alloc is None and step.stash is not None
                and step.commit is not None
                and step.trim is not None and step.commit.num_rows == step.trim + 1
                and getattr(type(self.proposer), "commit_verified", None) is not None)

    @_in_client_ids
    def free(self, seq_id: int) -> None:
        self.proposer.free(self._internal(seq_id))
        del self._seqs[seq_id]
        del self._reserved[seq_id]

    @_in_client_ids
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Batched drafts, at most spec.max_batch sequences per drafter call."""
        internal = [dataclasses.replace(r, seq_id=self._internal(r.seq_id)) for r in requests]
        self._bind_head()
        width = self.proposer.spec.max_batch
        out: list[Proposal] = []
        for i in range(0, len(internal), width):
            out += self.proposer.propose(internal[i:i + width])
        return out

    @_in_client_ids
    def propose_into(self, requests: Sequence[ProposeRequest], buffer_id: int) -> tuple[tuple[int, int], ...] | None:
        """The drafts of `requests` written into the client's drafts buffer `buffer_id` (row i for
        request i), its event recorded after the writes: returns (seq_id, count) per row, without
        waiting for the device. None when they take the host path instead (a bitmask, a confidence, a
        batch wider than one forward or than the buffer, a drafter with no device path): nothing was
        written then. A buffer that is not a registered drafts buffer is the client's error."""
        view, event = self.importer.drafts_target(buffer_id)
        on_device = getattr(self.proposer, "propose_on_device", None)
        most = max((r.num_drafts for r in requests), default=0)
        here = _indexed(self.device)
        if on_device is None or not 0 < len(requests) <= min(view.shape[0], self.proposer.spec.max_batch) \
                or most > view.shape[1] or view.device != here:  # (a buffer on another GPU: the host path)
            return None
        internal = [dataclasses.replace(r, seq_id=self._internal(r.seq_id)) for r in requests]
        self._bind_head()
        tokens = on_device(internal)
        if tokens is None:
            return None
        view[:len(requests), :most].copy_(tokens[:, :most])
        event.record()
        return tuple((r.seq_id, r.num_drafts) for r in requests)

    @_in_client_ids
    def take_kv(self, seq_id: int) -> CarriedKV:
        internal = self._internal(seq_id)
        self._check_room(0)
        carried = self.proposer.take_kv(internal)
        self._handles[carried.handle] = carried.rows
        try:
            self._check_room(0, entries=0)  # the rows moved out; the sequence may now fill its budget again
        except CapacityExceeded:
            self.install_kv(seq_id, carried.handle)  # the sequence is fresh: put them back
            raise
        return carried

    @_in_client_ids
    def install_kv(self, seq_id: int, handle: int) -> CarriedKV:
        internal = self._internal(seq_id)
        carried = self.proposer.install_kv(internal, self._own_handle(handle))
        del self._handles[handle]
        return carried

    @_in_client_ids
    def free_kv(self, handle: int) -> None:
        self.proposer.free_kv(self._own_handle(handle))
        del self._handles[handle]

    # ---- one engine step -----------------------------------------------------------------------

    def step(self, batch: StepBatch, errors: Sequence[SeqError] = ()) -> StepResult:
        """Apply every SeqStep, then the proposes; a failing sequence is reported and skipped, the
        others go on. `errors` are the sequences the wire already refused (left out of `batch`)."""
        started = time.perf_counter()
        self.register(batch.register)
        errors = list(errors)
        in_buffer: tuple[tuple[int, int], ...] = ()
        self._rows_seconds = self._replay_seconds = 0.0
        self._in_step = True
        # Every sequence's committed rows in one forward. Inside the block the drafter borrows the rows
        # (views of the target's buffers) until the block ends, so the wait for its reads comes after
        # it: before anything is released and before the answer lets the target write its buffers
        # again, whatever failed. It comes after the proposes too, which are queued behind the reads
        # and read their drafts back (a wait for everything queued before them): the GPU goes from
        # the context forward straight to the propose, and this wait finds the work done.
        chain = batch.chain
        try:
            self._deferred = None
            if chain is not None:  # before the message's other operations, as the target's device ran them
                self._chain_commit(chain, defer=self._chain_fusable(chain, batch.drafts_buffer))
            with _batched_appends(self.proposer):
                alone = self._apply_columns(batch.verified) if batch.verified is not None else []
                for seq_step in alone + list(self._apply_verified_together(batch.seqs)):
                    error = self._apply_isolated(seq_step)
                    if error is not None:
                        errors.append(error)
                applied = time.perf_counter()  # the block's end runs the batched context forward
            self._in_step = False
            committed = time.perf_counter()
            failed = {e.seq_id for e in errors}
            requests = [r for r in batch.proposes if r.seq_id not in failed]
            if chain is not None and chain.seq_ids:
                in_buffer, proposals, propose_errors = *self._chain_propose(chain, batch.drafts_buffer), []
            else:
                in_buffer = self._propose_into_buffer(batch, requests)
                proposals, propose_errors = self._propose_isolated(requests) if not in_buffer else ({}, [])
            proposed = time.perf_counter()
        finally:
            self._in_step = False
            # Drafts in the client's buffer: the buffer's event, recorded after everything this step
            # queued, is what the client waits on before it writes its buffers again (it must, see
            # StepRequest.drafts_buffer), so the host need not wait here. Buffers released now are
            # unmapped below: their reads must be done first.
            if not (in_buffer and not batch.release):
                self._finish_reads()
        waited = time.perf_counter()
        # host seconds of each part (the GPU's work shows where the host waits for it: the proposes
        # read their drafts back, so "propose" holds the context forward's GPU time too)
        rows, replay = self._rows_seconds, self._replay_seconds
        self.last_phases = StepPhases(commit=applied - started - rows, rows=rows, context=committed - applied,
                                      propose=proposed - committed - replay, replay=replay, wait=waited - proposed)
        if batch.release:
            self.release(batch.release)
        return StepResult(batch.step_id, proposals, tuple(errors + propose_errors), in_buffer)

    # ---- chained steps (StepRequest.chain) -------------------------------------------------------
    # A failure here fails the whole Step (the stream ends, the session with it): the target's device
    # state and ours no longer agree, and the target re-attaches from what its host knows.

    def _chain_fusable(self, chain: ChainStep, drafts_buffer: int) -> bool:
        """Whether the chain's commit can run with its propose (the same sequences, drafts into a buffer on
        our GPU, chain_graphs on): then both go into one graph."""
        return self.chain_graphs and bool(drafts_buffer) and bool(chain.seq_ids) \
            and chain.commit_seq_ids == chain.seq_ids

    @_in_client_ids
    def _chain_commit(self, chain: ChainStep, defer: bool = False) -> None:
        """The chain's settles, then the context K/V of the last chained step's rows at the positions the
        target's GPU left in feed row 0 (`defer`: checked now, run with the propose; the sequences are
        the propose's, so no operation of the message in between can free one)."""
        if chain.empty:
            return
        if not chains(self.proposer):
            raise StateConflict("this drafter does not serve chained steps (DrafterDescription.chains)")
        if chain.settle_seq_ids:
            self.proposer.chain_settle([self._internal(i) for i in chain.settle_seq_ids], list(chain.settle_counts))
        if not chain.commit_seq_ids:
            return
        self._bind_head()
        n, count = len(chain.commit_seq_ids), chain.commit_rows
        if count > self.proposer.spec.max_drafts + 1:
            raise InvalidRequest(f"a chained step commits 1..{self.proposer.spec.max_drafts + 1} rows a sequence")
        batch = self._chain_batch(chain.commit_seq_ids, [0] * n)
        rows = self._rows(chain.rows)
        if rows.shape[0] != n * count:
            raise InvalidRequest(f"a chained commit of {n} sequences x {count} rows references {rows.shape[0]} rows")
        feed = self._feed_view(chain.feed, n)
        if defer:
            self._deferred = (rows, count)
            return
        self.proposer.chain_commit(batch, rows, _bounded(feed[0]), count)

    @_in_client_ids
    def _chain_propose(self, chain: ChainStep, drafts_buffer: int) -> tuple[tuple[tuple[int, int], ...], dict]:
        """Drafts of the chain's sequences from the anchors and positions in feed rows 1 and 2, or (tree_keep) each
        block row's candidates for a draft tree (`candidate_columns`): into the drafts buffer when the step names
        one that holds them (then (seq_id, count) per row), else in the answer."""
        spec = self.proposer.spec
        n, k = len(chain.seq_ids), chain.num_drafts
        if not chains(self.proposer):
            raise StateConflict("this drafter does not serve chained steps (DrafterDescription.chains)")
        if n > spec.max_batch or k > spec.max_drafts:
            raise InvalidRequest(f"a chained propose takes up to {spec.max_batch} sequences and {spec.max_drafts} drafts")
        keep, served = chain.tree_keep, served_tree_keep(self.proposer) if chain.tree_keep else 0
        if keep and not served:
            raise StateConflict("this drafter offers no draft-tree candidates (DrafterDescription.tree_keep is 0)")
        if keep != served:
            raise InvalidRequest(f"a chained propose's tree_keep is the drafter's {served} (DrafterDescription), "
                                 f"not {keep}")
        width = candidate_columns(k, keep)
        done = self._done_target(chain)
        self._bind_head()
        batch = self._chain_batch(chain.seq_ids, chain.ahead)
        feed = self._feed_view(chain.feed, n)
        deferred, self._deferred = self._deferred, None
        view = event = None
        if drafts_buffer:
            view, event = self.importer.drafts_target(drafts_buffer)
            if not (n <= view.shape[0] and width <= view.shape[1] and view.device == _indexed(self.device)):
                view = event = None
        vocab = self.proposer.spec.vocab_size

        def drafts() -> torch.Tensor:  # (after the deferred commit, if any: the propose reads its context)
            bounded = _bounded(feed)  # the peer's numbers, all three rows at once
            if deferred is not None:
                self.proposer.chain_commit(batch, deferred[0], bounded[0], deferred[1])
            # an anchor out of the vocabulary would be a device assert in the embedding
            anchors, positions = bounded[1].clamp(max=vocab - 1), bounded[2]
            if not keep:
                return self.proposer.chain_propose(batch, anchors, positions, k)
            # a tree's candidates: the ids, then the log-probabilities' bits, as int32 columns of one row each
            logp, ids = self.proposer.chain_candidates(batch, anchors, positions, keep)
            return torch.cat([ids[:, :k].reshape(n, -1).to(torch.int32),
                              logp[:, :k].reshape(n, -1).float().view(torch.int32)], dim=1)

        if view is None:
            rows = drafts().cpu()
            self._write_done(done, chain.done_value)
            if keep:
                cut = k * keep
                return (), {seq_id: Proposal(tokens=row[:cut].tolist(),
                                             confidence=row[cut:].view(torch.float32).tolist())
                            for seq_id, row in zip(chain.seq_ids, rows)}
            return (), {seq_id: Proposal(tokens=row) for seq_id, row in zip(chain.seq_ids, rows.tolist())}

        def device_work() -> None:
            view[:n, :width].copy_(drafts())

        if deferred is not None:
            self._chain_device(_chain_key(n, k, deferred[1], deferred[0], feed, view, chain, drafts_buffer),
                               batch, device_work)
        else:
            device_work()
        self._write_done(done, chain.done_value)  # (before the event: the event done means the value written)
        event.record()
        return tuple((seq_id, k) for seq_id in chain.seq_ids), {}

    # ---- a chained step prepared before the target's writes are done -------------------------------
    # A Step waits for the target's writes outside the drafter lock, then does its host work under it. A
    # chained propose sent ahead arrives while the target's GPU still verifies, so its host work (checks,
    # settles, tables, views: ~0.2 ms a step on the H200) sat between the target's GPU and ours. A message
    # that only chains, into the target's drafts buffer through a graph captured already, is prepared
    # before the wait instead, and launched after it; nothing reaches the GPU before the wait.

    @_in_client_ids
    def prepare_chain(self, batch: StepBatch) -> PreparedLaunch | None:
        """The launch of a Step that only chains (its commit fused with its propose into the drafts buffer,
        the graph of its shape and addresses captured), with its host work done now, before the target's
        writes are seen done: call it under the drafter lock once they are (`await_writes`). It binds the
        shared drafter's head and tables again (another connection may have used them since), checks the
        buffers it reads, and refuses (StateConflict) if another call of this connection came between
        (`turns` moved: the server counts each call it runs for a connection). None: not such a step,
        nothing done (`step` runs it).

        With `waits` and a written value in the step (ChainStep.written_value), the launch is
        `device_waited`: it may be called at once, before the target's writes are done, since our stream
        waits for that value on the device before the graph reads them (the target's stream writes it
        after them), released by our watchdog at the writes' deadline (the session then fails)."""
        started = time.perf_counter()
        self.check_waits()
        chain, spec = batch.chain, self.proposer.spec
        if chain is None or batch.register or batch.release or batch.seqs or batch.verified is not None \
                or batch.proposes or not self._chain_fusable(chain, batch.drafts_buffer) or not chains(self.proposer) \
                or not isinstance(chain.rows, RowRef) or not isinstance(chain.feed, RowRef) \
                or (self._head is not None and not self._head_written):
            return None
        n, k, count = len(chain.seq_ids), chain.num_drafts, chain.commit_rows
        if n > spec.max_batch or k > spec.max_drafts or count > spec.max_drafts + 1 \
                or (chain.tree_keep and chain.tree_keep != served_tree_keep(self.proposer)) \
                or any(self.importer.descriptor(ref.buffer_id).kind is not BufferKind.CUDA_IPC
                       for ref in (chain.rows, chain.feed)):
            return None
        # views of the target's buffers on our GPU, nothing copied (a copy would be queued before the writes)
        rows = self.importer.resolve(chain.rows, cols=spec.feature_dim, before_written=True)
        feed = self.importer.resolve(chain.feed, dtype=torch.int32, role=BufferRole.FEED, before_written=True)
        view, event = self.importer.drafts_target(batch.drafts_buffer)
        here = _indexed(self.device)
        if rows.shape[0] != n * count or chain.feed.row_offset != 0 or chain.feed.rows != FEED_ROWS \
                or n > feed.shape[1] or n > view.shape[0] or candidate_columns(k, chain.tree_keep) > view.shape[1] \
                or not view.device == rows.device == feed.device == here:
            return None
        feed = feed[:, :n]
        graph = self._chain_graphs.get(_chain_key(n, k, count, rows, feed, view, chain, batch.drafts_buffer))
        if graph is None:
            return None
        # as `step` would, from here on: what is checked before any work, the settles, the batch's checks
        done = self._done_target(chain)
        written = None
        if self.waits is not None and chain.written_value:
            written = self._written_target(chain, done)
        if chain.settle_seq_ids:
            self.proposer.chain_settle([self._internal(i) for i in chain.settle_seq_ids], list(chain.settle_counts))
        self._bind_head()
        self._chain_batch(chain.seq_ids, chain.ahead)
        prepared = _Prepared(batch.step_id, chain, graph, done, event, self.turns, time.perf_counter() - started,
                             written)
        return PreparedLaunch(functools.partial(self._launch_prepared, prepared), written is not None)

    @_in_client_ids
    def _launch_prepared(self, prepared: "_Prepared") -> StepResult:
        started = time.perf_counter()
        chain = prepared.chain
        if self.closed:
            raise StateConflict("the connection closed before its chained step's launch")
        if self.turns != prepared.turn:
            raise StateConflict("another call of this connection ran between a chained step's arrival and its launch")
        self.check_waits()
        waited = prepared.written is not None  # (else the server saw the target's writes done before this call)
        self.importer.check_current(chain.rows, written=not waited)
        self.importer.check_current(chain.feed, written=not waited)
        self._bind_head()
        batch = self._chain_batch(chain.seq_ids, chain.ahead)  # (its tables in place, unless another connection's)
        self._on_chain_graph("waited" if waited else "prepared")
        self.proposer.chain_bind(batch)
        if waited:  # our stream, not our host, waits for the target's writes
            self.waits.wait(prepared.written, chain.written_value,
                            time.perf_counter() + self.limits.writes_wait_seconds)
        replaying = time.perf_counter()
        prepared.graph.replay()
        replayed = time.perf_counter()
        self._write_done(prepared.done, chain.done_value)
        prepared.event.record()
        replay = replayed - replaying
        self.last_phases = StepPhases(commit=prepared.seconds, propose=time.perf_counter() - started - replay,
                                      replay=replay)
        return StepResult(prepared.step_id, {}, (), tuple((seq_id, chain.num_drafts) for seq_id in chain.seq_ids))

    def check_waits(self) -> None:
        """WritesPending once our watchdog has released a device wait the target never satisfied (the
        stream then ends: what the step after it read may have been half written)."""
        if self.waits is not None and self.waits.failure is not None:
            raise WritesPending(self.waits.failure)

    def _done_target(self, chain: ChainStep) -> list[Flag] | None:
        """The DONE buffer's flags (a chained propose writes its done value into the first; None: it names
        none), checked before any of the step's work."""
        if not chain.done_buffer:
            return None
        if not done_flags(self.device):
            raise StateConflict("this drafter writes no done flags (DrafterDescription.done_flags)")
        flags = self.importer.done_target(chain.done_buffer)
        if flags[0].device != _indexed(self.device):
            raise InvalidRequest(f"buffer {chain.done_buffer}: a done buffer lies on the drafter's GPU "
                                 "(or in the host page mapped there)")
        return flags

    def _written_target(self, chain: ChainStep, done: list[Flag] | None) -> Flag:
        """The flag our stream waits on for the chained step's written value: element 0 of its written buffer,
        else element 1 of its DONE buffer. Device memory only: a page its target could punch a hole in would
        part what our GPU reads from what our watchdog's store writes."""
        if chain.written_buffer:
            flags = self.importer.done_target(chain.written_buffer)
            where = f"buffer {chain.written_buffer}"
        else:
            if done is None or len(done) < 2:
                raise InvalidRequest(f"buffer {chain.done_buffer}: a written value goes into a done buffer's "
                                     f"element 1, and it has {0 if done is None else len(done)} columns")
            flags, where = done[1:], f"buffer {chain.done_buffer}"
        if flags[0].host is not None or flags[0].device != _indexed(self.device):
            raise InvalidRequest(f"{where}: a written value goes into CUDA IPC memory on the drafter's GPU")
        return flags[0]

    @staticmethod
    def _write_done(flags: list[Flag] | None, value: int) -> None:
        """Queue the done value's write behind the step's work on our stream (the target's stream waits for it)."""
        if flags is not None:
            stream_ops().write(torch.cuda.current_stream(flags[0].device), flags[0].address, value)

    def _drop_chain_graphs(self, buffers: set[int] | None = None) -> None:
        """Forget the chained steps' graphs that read or write any of `buffers` (None: every graph), and the
        runs counted towards them: a shape is captured again only after its kernels have run uncaptured
        over the new buffers. A replay still queued finishes first: its graph is not destroyed under it."""
        def dropped(key: tuple) -> bool:
            return buffers is None or not buffers.isdisjoint(key[-1])

        if any(graph is not None and dropped(key) for key, graph in self._chain_graphs.items()):
            self._finish_reads()
        self._chain_graphs = {key: graph for key, graph in self._chain_graphs.items() if not dropped(key)}
        self._chain_runs = {key: runs for key, runs in self._chain_runs.items() if not dropped(key)}
        if not any(graph is not None for graph in self._chain_graphs.values()):
            # (a pool no graph holds any more cannot take a new capture: the next one starts another)
            self._chain_pool = None

    def _chain_device(self, key: tuple, batch, device_work: Callable[[], None]) -> None:
        """A chained step's commit, propose and drafts copy: replayed as one graph once its shape has run
        `chain_capture_after` times uncaptured (its tables bound first, as the in-process engine binds
        them before a whole step's capture or replay); uncaptured before, and for good if the capture
        fails or the connection holds its most graphs (MAX_CHAIN_GRAPHS). The graph holds this
        connection's buffers' addresses, and the buffers' ids last (key): releasing a buffer drops the
        graphs over it, registering or releasing a head drops them all."""
        graph = self._chain_graphs.get(key)
        outcome = "replayed"
        if graph is None:
            outcome = "uncaptured"
            if key not in self._chain_graphs and len(self._chain_graphs) < MAX_CHAIN_GRAPHS \
                    and self._counted_run(key) > self.chain_capture_after:
                del self._chain_runs[key]
                graph = self._chain_graphs[key] = self._chain_capture(key, batch, device_work)
                outcome = "captured" if graph is not None else "failed"
        self._on_chain_graph(outcome)
        if graph is None:
            device_work()
            return
        self.proposer.chain_bind(batch)
        replaying = time.perf_counter()
        graph.replay()
        self._replay_seconds += time.perf_counter() - replaying

    def _counted_run(self, key: tuple) -> int:
        """One more uncaptured run of `key`'s shape: how many so far. The counts kept are the
        MAX_CHAIN_SHAPES shapes run last (a shape run once and never again goes first)."""
        runs = self._chain_runs.pop(key, 0) + 1
        if len(self._chain_runs) >= MAX_CHAIN_SHAPES:
            del self._chain_runs[next(iter(self._chain_runs))]
        self._chain_runs[key] = runs
        return runs

    def _chain_capture(self, key: tuple, batch, device_work: Callable[[], None]):
        """The graph of a chained step's device work (not run: the caller replays it), or None."""
        self.proposer.chain_bind(batch)
        try:
            if self._chain_pool is None:
                self._chain_pool = torch.cuda.graph_pool_handle()
            with inlined():  # the drafter's forwards record into this graph
                return capture_serving(device_work, self._chain_pool)
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured runs uncaptured
            self.chain_graph_error = f"{type(exc).__name__}: {exc}"
            log.warning("a chained step of %d sequences and %d drafts could not be captured (%s); it runs "
                        "uncaptured", key[0], key[1], self.chain_graph_error)
            return None

    def _chain_batch(self, seq_ids: Sequence[int], ahead: Sequence[int]):
        batch = self.proposer.chain_batch([self._internal(i) for i in seq_ids], list(ahead))
        if batch is None:
            raise StateConflict("these sequences cannot take a chained step (an anchor at or past a budget, "
                                "more than a batch, or the drafter's head elsewhere)")
        return batch

    def _feed_view(self, ref: RowSource | None, n: int) -> torch.Tensor:
        """A chained step's feed [3, n] int32 (see BufferRole.FEED): a view of the target's buffer, or a
        copy of shared memory, on our device. The target's numbers: `_bounded` before any use."""
        if not isinstance(ref, RowRef) or ref.row_offset != 0 or ref.rows != FEED_ROWS:
            raise InvalidRequest(f"a chained step's feed is rows 0..{FEED_ROWS} of a feed buffer")
        feed = self.importer.resolve(ref, dtype=torch.int32, role=BufferRole.FEED)
        if n > feed.shape[1]:
            raise InvalidRequest(f"a feed buffer of {feed.shape[1]} columns holds no {n} sequences")
        return feed[:, :n].to(self.device)

    def _propose_into_buffer(self, batch: StepBatch, requests: Sequence[ProposeRequest]) -> tuple[tuple[int, int], ...]:
        """The step's drafts in its drafts buffer when it names one and they can go there (see
        `propose_into`); () when they take the host path. A failing propose there is retried on the
        host path, which reports each sequence's error alone (nothing was written or recorded)."""
        if not batch.drafts_buffer:
            return ()
        self.importer.drafts_target(batch.drafts_buffer)  # not a drafts buffer of this client's: its error
        if not requests:
            return ()
        try:
            return self.propose_into(requests, batch.drafts_buffer) or ()
        except Exception as err:  # noqa: BLE001 - the host path reports each sequence's own error
            log.debug("drafts into the buffer failed (%s); proposing on the host path", err)
            return ()

    def _apply_columns(self, columns: VerifiedColumns) -> list[SeqStep]:
        """The verified columns in one drafter call; returns what is left to apply one by one: nothing,
        or (that call changed nothing: an entry is bad) every entry, each then reported alone."""
        if len(columns.seq_ids) >= 2 and self._commit_together(columns):
            return []
        return columns.seq_steps()

    def _apply_verified_together(self, seqs: Sequence[SeqStep]) -> Sequence[SeqStep]:
        """The step's verified sequences whose rows lie in one buffer (a packed step's columns, sent as
        SeqSteps) in one drafter call; returns the sequences left to apply one by one."""
        refs = [s for s in seqs if self._verified(s) and isinstance(s.stash, RowRef)]
        if len(refs) < 2:
            return seqs
        first = refs[0].stash
        together = [s for s in refs if (s.stash.buffer_id, s.stash.generation) == (first.buffer_id, first.generation)]
        if len(together) < 2:
            return seqs
        columns = VerifiedColumns(first.buffer_id, first.generation, [s.seq_id for s in together],
                                  [s.stash.row_offset for s in together], [s.stash.rows for s in together],
                                  [s.commit.base_pos for s in together], [s.trim for s in together],
                                  [list(s.commit.token_ids) for s in together])
        if not self._commit_together(columns):
            return seqs
        done = {id(s) for s in together}
        return [s for s in seqs if id(s) not in done]

    def _commit_together(self, columns: VerifiedColumns) -> bool:
        """`columns` in one drafter call (`commit_verified_many`: one resolve of their rows, one round of
        checks). That call changes nothing unless every entry is good: False then (or when the drafter
        has no such call), and the caller applies them one by one, which reports each bad one alone."""
        if getattr(type(self.proposer), "commit_verified_many", None) is None:
            return False
        low = min(columns.row_offsets)
        high = max(o + n for o, n in zip(columns.row_offsets, columns.stash_rows))
        try:
            internal = [self._seqs[seq_id] for seq_id in columns.seq_ids]  # KeyError: unknown, reported alone
            rows = self._rows(RowRef(columns.buffer_id, low, high - low, columns.generation))
            self.proposer.commit_verified_many(
                internal, rows, [o - low for o in columns.row_offsets], columns.stash_rows, columns.num_accepted,
                columns.base_pos, columns.token_ids)
        except Exception as err:  # noqa: BLE001 - nothing changed: each sequence is applied alone
            log.debug("the step's verified sequences failed together (%s); applying them one by one", err)
            return False
        return True

    def _apply_isolated(self, seq_step: SeqStep) -> SeqError | None:
        try:
            self.apply(seq_step)
            return None
        except Exception as err:  # noqa: BLE001 - becomes this sequence's SeqError
            error = _seq_error(seq_step.seq_id, err)
        if seq_step.free and seq_step.seq_id in self._seqs:
            # The target is done with the sequence whatever failed before: release it, or it leaks.
            self.free(seq_step.seq_id)
        return error

    def _propose_isolated(self, requests: Sequence[ProposeRequest]) -> tuple[dict[int, Proposal], list[SeqError]]:
        """One batched call per chunk of spec.max_batch; see `_propose_chunk`."""
        proposals: dict[int, Proposal] = {}
        errors: list[SeqError] = []
        width = self.proposer.spec.max_batch
        for i in range(0, len(requests), width):
            self._propose_chunk(requests[i:i + width], proposals, errors)
        return proposals, errors

    def _propose_chunk(self, chunk: Sequence[ProposeRequest], proposals: dict[int, Proposal],
                       errors: list[SeqError]) -> None:
        """If the batched call fails, retry its sequences one by one so the failure stays with the
        sequence that caused it (the drafter validates a whole batch before changing any state)."""
        try:
            proposals.update(zip((r.seq_id for r in chunk), self.propose(chunk), strict=True))
            return
        except Exception as err:  # noqa: BLE001 - one sequence's failure or the batch's, told apart below
            if len(chunk) == 1:
                errors.append(_seq_error(chunk[0].seq_id, err))
                return
            log.debug("batched propose failed (%s); proposing one sequence at a time", err)
        for request in chunk:
            self._propose_chunk([request], proposals, errors)

    # ---- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free every sequence and carried KV of this client and unmap its buffers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.waits is not None:  # our stream waits for nothing the target may no longer write
            self.waits.close()
        for seq_id, internal in list(self._seqs.items()):
            _quietly(f"free sequence {seq_id}", self.proposer.free, internal)
        for handle in list(self._handles):
            _quietly(f"free carried KV {handle}", self.proposer.free_kv, handle)
        self._seqs.clear()
        self._handles.clear()
        self._reserved.clear()
        self._buffer_bytes.clear()
        if self._head is not None:
            if getattr(self.proposer, "head", None) is self._head:
                self.proposer.head = self._default_head  # drop our views so the mappings can close
            forget = getattr(self.proposer, "forget_head", None)  # graphs captured over our head too
            if forget is not None:
                forget(self._head)
        self._head = None
        self._drop_chain_graphs()
        self._finish_reads()  # no queued read or write of a mapping outlives it
        if self.waits is not None:  # ... nor a release the watchdog was still writing into the target's DONE buffer
            self.waits.join()
        self.importer.close()
        if self.page is not None:  # (after every stream write of ours into it is done: _finish_reads above)
            self.page.close()
            self.page = None

    def attach_page(self, page: HostPage) -> None:
        """The DONE page this session's Step socket hello passed (closed with the session)."""
        if self.closed or self.page is not None:
            page.close()
            raise StateConflict("this connection has its DONE page already" if not self.closed
                                else "the connection closed before its DONE page was attached")
        self.page = self.importer.page = page


def _chain_key(n: int, k: int, count: int, rows: torch.Tensor, feed: torch.Tensor, drafts: torch.Tensor,
               chain: ChainStep, drafts_buffer: int) -> tuple:
    """A fused chained step's graph: its shape, every address it reads or writes, their buffers (last)."""
    rows_buffer = chain.rows.buffer_id if isinstance(chain.rows, RowRef) else 0
    return (n, k, count, chain.tree_keep, rows.data_ptr(), feed.data_ptr(), drafts.data_ptr(),
            frozenset((rows_buffer, chain.feed.buffer_id, drafts_buffer)))


def _indexed(device: torch.device) -> torch.device:
    """cuda → cuda:<current>: comparable with a tensor's device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def buffers_read(seqs: Iterable[SeqStep], verified: VerifiedColumns | None = None,
                 chain: ChainStep | None = None) -> set[int]:
    """The registered buffers whose rows these operations read (inline rows read none)."""
    ids = {verified.buffer_id} if verified is not None else set()
    if chain is not None:
        ids |= {ref.buffer_id for ref in (chain.rows, chain.feed) if isinstance(ref, RowRef)}
    for step in seqs:
        for source in (step.stash, step.catchup.rows if step.catchup is not None else None):
            if isinstance(source, RowRef):
                ids.add(source.buffer_id)
    return ids


def _batched_appends(proposer: Proposer) -> AbstractContextManager:
    batched = getattr(proposer, "batched_appends", None)
    return batched() if batched is not None else nullcontext()


def _seq_error(seq_id: int, err: Exception) -> SeqError:
    if not isinstance(err, SpecsplitError):  # a bug, not a bad request: keep the traceback
        log.exception("sequence %d failed unexpectedly", seq_id, exc_info=err, extra={"seq_id": seq_id})
    return SeqError.from_exception(seq_id, err)


def _quietly(what: str, call: Callable, *args) -> None:
    try:
        call(*args)
    except Exception:  # teardown goes on: one failure must not leak the rest
        log.exception("while closing a session: %s failed", what)
