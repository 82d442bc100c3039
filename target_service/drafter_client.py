"""A `Proposer` that lives in another process: the drafter service, reached over gRPC.

Per engine step the target's verbs (stash, commit, trim, catch-up) are queued and leave together with
the step's batched propose as ONE message on a persistent bidirectional `Step` stream (on one host,
over the drafter's step socket: `shared.frames`); a step's commits leave with the next step's
proposes (`prefetch`), whose drafts the next step takes. Feature rows
never travel as bytes on one host: they are copied into a buffer registered once per connection
(CUDA IPC on one GPU, POSIX shared memory on a CPU host) and referenced by (buffer, offset, rows,
generation); between hosts they travel inline. Any transport failure raises DrafterUnavailable, and
`available()` reconnects with backoff, so the engine can re-attach.

A drafter that is down when the target starts is no reason not to serve: `spec` stays None until one
first answers, and `available()` attaches it then. Nothing the engine thread waits on can stall for
long: whether a drafter is up is watched by a channel that connects in the background, a dead or
frozen drafter is found by HTTP/2 pings within about 2 s, and each Step answer has a deadline drawn
from the round trips measured so far (`step_deadline`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

import grpc
import torch
from google.protobuf.message import DecodeError

from specsplit.protos.v1 import drafter_pb2, drafter_pb2_grpc
from specsplit.shared import frames, wire
from specsplit.shared.security import ClientSecurity, ClientTLS, open_channel
from specsplit.shared.serving import CLIENT_HEADER, INSTANCE_HEADER, PEER_CHANNEL_OPTIONS, grpc_target
from specsplit.shared.errors import (CapacityExceeded, DrafterUnavailable, InvalidRequest, SpecsplitError,
                                     StateConflict)
from specsplit.shared.proposer import CarriedKV, DrafterSpec, Proposal, ProposeRequest
from specsplit.shared.staging import to_host
from specsplit.shared.stream_ops import next_value, stream_ops
from specsplit.shared.transport import (
    FEED_ROWS, BufferDescriptor, BufferExporter, BufferKind, BufferRole, RowBuffer, choose_mode, device_uuid,
    encode_inline, host_id, identity_digest,
)
from specsplit.shared.tree import MAX_TREE_KEEP
from specsplit.shared.verify import device_longs
from specsplit.shared.device_waits import DeviceWaits
from specsplit.shared.host_flags import Flag, HostPage

log = logging.getLogger(__name__)

ATTACH_WAIT = 2.0  # seconds each call of a re-attach may take: the engine loop waits on it
RETIRED_DRAFTS_BUFFERS = 4  # a few MiB of GPU memory, against a drafter writing into a freed allocation
# A Step answer's deadline: STEP_DEADLINE_FACTOR x the p99 of the last STEP_DEADLINE_SAMPLES round trips,
# at least STEP_DEADLINE_FLOOR (a GPU drafter's first step at a new batch size captures a graph), at most
# the --drafter-timeout; until STEP_DEADLINE_MIN_SAMPLES steps were measured, the --drafter-timeout.
STEP_DEADLINE_FACTOR = 20
STEP_DEADLINE_FLOOR = 1.0
STEP_DEADLINE_SAMPLES = 200
STEP_DEADLINE_MIN_SAMPLES = 20
WATCH_PERIOD = 0.05  # seconds between the watchdog's looks at an awaited Step answer's deadline
ANSWER_FRAME_BYTES = 256 << 20  # the largest step answer read from the step socket (gRPC's own cap)
INLINE_PREFILL_BYTES = 8 << 20  # inline prompt rows per PrefillDrafter call: the drafter caps message sizes


def _error_from_rpc(exc: grpc.RpcError) -> SpecsplitError:
    code = exc.code().name if exc.code() is not None else "UNAVAILABLE"
    return wire.error_from_status(code, f"drafter {code}: {exc.details()}")


def _reason(exc: BaseException, wait: float) -> str:
    if isinstance(exc, grpc.FutureTimeoutError):
        return f"nothing answered within {wait:g} s"
    if isinstance(exc, grpc.RpcError):
        return str(_error_from_rpc(exc))
    return str(exc) or type(exc).__name__


# A drafter's refusal of one sequence (the engine goes on without speculation for it), not its failure
_REFUSALS = (InvalidRequest, CapacityExceeded, StateConflict)


@dataclass
class LinkStats:
    """What crossed the connection: hidden-row bytes sent inline, and each Step's round trip."""

    inline_row_bytes: int = 0
    step_seconds: deque = field(default_factory=lambda: deque(maxlen=100_000))  # the latest Steps waited for
    # Every answer's time from its send (Steps sent ahead too, whose answers are read later): what the next
    # answer's deadline is drawn from. With proposes sent ahead nearly every answer is one of those.
    answer_seconds: deque = field(default_factory=lambda: deque(maxlen=1_000))
    sent_ahead: int = 0  # Steps sent by send_pending or prefetch, answered later (not in step_seconds)
    drafts_ahead: int = 0  # proposals taken from a prefetch's answer (no round trip of their own)
    drafts_on_device: int = 0  # proposals the verify took from our drafts buffer (never read by the host)
    chain_sent_ahead: int = 0  # chained proposes sent ahead (chain_prefetch; also in sent_ahead) ...
    chain_taken_ahead: int = 0  # ... and those the next chained step took (the rest were dropped) ...
    chain_taken_regrouped: int = 0  # ... of them for a batch other than the one sent (sequences ended or joined)
    device_waits: int = 0  # drafts our stream waited for on the device (device_waits) instead of our host
    host_waits: int = 0  # ... and those our host waited for instead, as the engine asked (wait_on_host_next)
    taken_unanswered: int = 0  # chained proposes sent ahead whose drafts the verify took before their answer
    unary_calls: Counter = field(default_factory=Counter)  # unary calls made, by method


class RowStager:
    """Copies rows into one registered buffer and hands out references (or inline rows)."""

    def __init__(self, exporter: BufferExporter | None, rows: int, cols: int, dtype, device,
                 stats: LinkStats) -> None:
        self.exporter, self.cols, self.dtype, self.device = exporter, cols, dtype, device
        self.stats = stats
        self.buffer: RowBuffer | None = exporter.create(rows, cols, dtype, device) if exporter else None
        self.cursor = 0
        self.fresh = True  # the next put starts a new generation
        self._copies: list[tuple[int, torch.Tensor]] = []  # (offset, rows) to write when sealed

    def put(self, rows: torch.Tensor, *, now: bool = False) -> int | torch.Tensor:
        """Stage rows; returns their offset (shared buffer) or the rows themselves (inline). `now`: copied at
        once (queued on the current stream) rather than at `seal`, for rows whose source is rewritten
        before the next send (a chained step's verify output)."""
        if rows.dim() != 2 or rows.shape[1] != self.cols:
            raise InvalidRequest(f"feature rows must be [n, {self.cols}], got {tuple(rows.shape)}")
        if self.buffer is None:
            return rows.detach().to(self.dtype).cpu()
        if self.fresh:
            self.buffer.bump()
            self.cursor, self.fresh = 0, False
        if self.cursor + rows.shape[0] > self.buffer.tensor.shape[0]:
            raise DrafterUnavailable("staging buffer overflow")  # sized from the spec; a bug if hit
        offset = self.cursor
        if now:
            self.buffer.tensor[offset:offset + rows.shape[0]].copy_(rows)
        else:
            self._copies.append((offset, rows))  # written at seal(): the caller's rows stay valid until then
        self.cursor += rows.shape[0]
        return offset

    def seal(self) -> None:
        """Write the staged rows (CUDA: then record the interprocess event); the next put reuses the buffer.

        Rows staged back to back from one tensor (each sequence's slice of one verify's output) go out as
        one copy."""
        if self.buffer is not None and not self.fresh:
            for offset, rows in _coalesce(self._copies):
                self.buffer.tensor[offset:offset + rows.shape[0]].copy_(rows)
            self.buffer.record()
        self._copies = []
        self.fresh = True

    def source(self, staged: int | torch.Tensor, rows: int):
        if isinstance(staged, torch.Tensor):
            inline = encode_inline(staged)
            self.stats.inline_row_bytes += len(inline.data)
            return inline
        return self.buffer.ref(staged, rows)


def _coalesce(copies: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """Merge copies whose destinations and sources both continue the previous one's (same storage,
    same row stride), so a step's slices of one tensor become one copy."""
    runs: list[list] = []  # [offset, first source, rows in the run, last source]
    for offset, rows in copies:
        if runs:
            run = runs[-1]
            start, first, count, prev = run
            if (offset == start + count and rows.dtype == prev.dtype and rows.stride() == prev.stride()
                    and rows.shape[1:] == prev.shape[1:] and _same_storage(rows, prev)
                    and rows.storage_offset() == prev.storage_offset() + prev.shape[0] * prev.stride(0)):
                run[2], run[3] = count + rows.shape[0], rows
                continue
        runs.append([offset, rows, rows.shape[0], rows])
    return [(start, first if count == first.shape[0] else
             first.as_strided((count, *first.shape[1:]), first.stride(), first.storage_offset()))
            for start, first, count, _ in runs]


def _rows_of_one(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """[2, n]: `first` and `second` ([n] each) as the two rows of one view, where they are two rows of one tensor
    (same storage, dtype and strides, `second` wherever after `first`); None otherwise."""
    if first.dim() != 1 or second.shape != first.shape or second.dtype != first.dtype or first.stride() != (1,) \
            or second.stride() != (1,) or not _same_storage(first, second):
        return None
    step = second.storage_offset() - first.storage_offset()
    if step < first.shape[0]:  # (overlapping, or before it)
        return None
    return first.as_strided((2, first.shape[0]), (step, 1), first.storage_offset())


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Slices of one tensor share its `_base` (cheap to compare); otherwise compare the storages."""
    if a._base is not None and a._base is b._base:
        return True
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_QUEUED, _SENT, _MISSING = object(), object(), object()  # an attach on the Step stream: queued, in a Step out
_OP_ORDER = {name: i for i, name in enumerate(("catchup", "stash", "commit", "trim", "free"))}  # a SeqStep's order


@dataclass
class _Pending:
    """One sequence's queued operations for the next Step message, applied in _OP_ORDER."""

    catchup: tuple | None = None  # (token_ids, staged, rows, base_pos)
    stash: tuple | None = None  # (staged, rows)
    commit: wire.CommitOp | None = None
    trim: int | None = None
    free: bool = False
    # an attach on the Step stream (`attach_on_stream`): (budget, token_ids, the prompt's rows), its rows
    # staged into the bulk buffer as the Step goes (a Step still out may read that buffer until answered)
    attach: tuple | None = None
    last: int = -1  # _OP_ORDER of the latest operation queued: one at or before it needs a send first

    def verified_only(self) -> bool:
        """Exactly one verify's stash (in the step buffer), commit and trim: what VerifiedColumns carry."""
        return (self.catchup is None and self.attach is None and not self.free and self.stash is not None
                and self.commit is not None
                and self.trim is not None and isinstance(self.stash[0], int)
                and self.commit.num_rows == self.trim + 1)


def _feed_key(t: torch.Tensor) -> tuple:
    """What tells two feed tensors apart for a chained propose sent ahead: the same memory, shape and strides
    (the engine's program feed, rewritten on the device by each step, never reallocated)."""
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride())


def _same_request(a: ProposeRequest, b: ProposeRequest) -> bool:
    return (a.seq_id, a.last_token, a.position, a.num_drafts) == (b.seq_id, b.last_token, b.position, b.num_drafts) \
        and b.bitmask is None and not b.want_confidence


def _add_verified_columns(pb: drafter_pb2.StepRequest, buffer, verified: dict[int, _Pending]) -> None:
    """Append `verified` (stash offsets in `buffer`'s current generation) to pb.verified, in the order the
    columns expect (each sequence's commit tokens in turn)."""
    columns = pb.verified
    if not columns.seq_ids:  # step_to_proto put none there (or an empty one): this step buffer's
        columns.buffer_id, columns.generation = buffer.buffer_id, buffer.generation
    tokens = []
    for p in verified.values():
        tokens += p.commit.token_ids
    columns.seq_ids.extend(verified)
    columns.row_offsets.extend(p.stash[0] for p in verified.values())
    columns.stash_rows.extend(p.stash[1] for p in verified.values())
    columns.commit_rows.extend(p.commit.num_rows for p in verified.values())
    columns.base_pos.extend(p.commit.base_pos for p in verified.values())
    columns.num_accepted.extend(p.trim for p in verified.values())
    columns.token_ids.extend(tokens)


@dataclass
class _Connection:
    channel: grpc.Channel
    stub: drafter_pb2_grpc.DrafterServiceStub
    metadata: tuple
    outbox: "queue.Queue[drafter_pb2.StepRequest | None]" = field(default_factory=queue.Queue)
    responses: grpc.Call | None = None  # the Step stream's answers, read by the thread that sent the step
    sock: socket.socket | None = None  # the drafter's step socket, when the Step stream goes there
    due: float = 0.0  # monotonic time by which the awaited Step answer is overdue (0: none awaited)
    sent_at: float = 0.0  # perf_counter when the last Step was sent
    overdue: bool = False  # the watchdog cancelled the stream: an answer missed its deadline
    columns: bool = False  # the drafter reads a StepRequest's columns (DrafterDescription.step_columns)
    prefill_allocs: bool = False  # its PrefillDrafter allocates too (DrafterDescription.prefill_allocs) ...
    step_attach: bool = False  # a SeqStep may allocate its sequence (DrafterDescription.step_attach)
    attaching: tuple[int, ...] = ()  # the sequences the Step sent last attaches (`attach_on_stream`)
    alloc_next: tuple[int, int] | None = None  # ... so `alloc` leaves (seq id, budget) for the prefill after it
    # allocations sent alone on another call's behalf and refused: raised by the sequence's own prefill
    alloc_refused: dict[int, SpecsplitError] = field(default_factory=dict)
    exporter: BufferExporter | None = None
    step: RowStager | None = None
    bulk: RowStager | None = None  # prefill / re-attach rows, grown on demand
    head_buffers: list = field(default_factory=list)
    drafts: RowBuffer | None = None  # the DRAFTS buffer the drafter may write a step's drafts into (CUDA IPC)
    drafts_read: "torch.cuda.Event | None" = None  # recorded after our last read of `drafts`
    feed: RowBuffer | None = None  # a chained step's anchors and positions (StepRequest.chain), when it chains
    feed_fresh: bool = True  # the next write into `feed` starts a new generation
    # the DONE buffer our stream waits on (RemoteProposer(device_waits=True)): device memory, or the host page
    # passed with the step socket's hello (`page`; DrafterDescription.host_flags)
    done: "RowBuffer | HostPage | None" = None
    done_id: int = 0  # its buffer id at the drafter
    done_flags: list[Flag] = field(default_factory=list)  # [the done values' flag, the written values' if any]
    written: RowBuffer | None = None  # beside the host page: the DONE buffer whose element 0 takes written values
    page: HostPage | None = None  # the host page made for this connection (its DONE buffer once registered)
    done_value: int = 0  # the last done value a Step asked for ...
    done_sent: int = 0  # ... and the one the last Step sent asked for (0: none)
    written_value: int = 0  # the last value our stream wrote into `done`'s element 1 (a drafter with written_flags)
    offered: bool = False  # the last Step sent named `drafts`
    tree_candidates: bool = False  # the drafter answers our tree_keep candidates a row (DrafterDescription.tree_keep)
    allocated: set[int] = field(default_factory=set)  # seq ids this connection's drafter session holds
    dead: bool = False  # the Step stream ended: the drafter has dropped (or never had) this session
    error: SpecsplitError | None = None  # why the Step stream ended, when the drafter said

    def socket_closed(self) -> bool:
        """Whether the step socket has ended (the drafter exited, restarted or evicted us), seen without
        waiting: gRPC's stream says so by its callback, a socket only when read. Call it only while no
        answer is awaited: any bytes now are the drafter's last words."""
        if self.sock is None:
            return False
        try:
            self.sock.settimeout(0)  # a peek that never waits (with a timeout, Python polls for up to it first)
            return len(self.sock.recv(1, socket.MSG_PEEK)) >= 0
        except BlockingIOError:
            return False  # open, and quiet
        except OSError:
            return True

    def last_words(self) -> SpecsplitError | None:
        """The status an ended step socket's drafter sent before closing it, if it sent one."""
        try:
            payload = frames.recv_frame(self.sock, ANSWER_FRAME_BYTES, time.monotonic() + 0.5)
        except (OSError, EOFError, SpecsplitError):
            return None
        if payload[:1] != bytes([frames.ENDED]):
            return None
        code, message = frames.parse_ended(payload)
        return wire.error_from_status(code, f"drafter {code}: {message}")

    def close(self) -> None:
        self.outbox.put(None)
        self.dead = True  # also stops the watchdog
        if self.sock is not None:
            self.sock.close()
        _close_channel(self.channel)
        if self.exporter is not None:
            self.exporter.close()


def _importer_done(drafts: RowBuffer, wait: float = 0.0) -> bool:
    """Whether the drafter's last recorded work on a drafts buffer is done (polled up to `wait` s); an
    event that cannot be queried counts as never done."""
    try:
        return drafts.await_importer(wait)
    except SpecsplitError:
        return False


def _write_on_stream(flag: Flag, value: int) -> None:
    """Queue on our current stream the write of `value` into `flag` (after the stream's earlier work)."""
    stream_ops().write(torch.cuda.current_stream(flag.device), flag.address, value)


def _close_channel(channel: grpc.Channel) -> None:
    """Close a channel once grpc's connectivity poller (channel_ready_future, _Probe) has let go of it:
    it checks every 0.2 s, and closing under it raises in its thread."""
    timer = threading.Timer(0.5, channel.close)
    timer.daemon = True
    timer.start()


class _Probe:
    """A channel to the drafter that keeps (re)connecting in the background: asking whether a drafter
    is up never blocks, so a target whose drafter is absent or stopped keeps decoding at full speed."""

    def __init__(self, address: str, tls: ClientTLS | None) -> None:
        self.channel = open_channel(address, PEER_CHANNEL_OPTIONS, tls)
        self._state: grpc.ChannelConnectivity | None = None
        self.channel.subscribe(self._seen, try_to_connect=True)

    def _seen(self, state: grpc.ChannelConnectivity) -> None:
        self._state = state

    @property
    def up(self) -> bool:
        if self._state is grpc.ChannelConnectivity.IDLE:
            # Connected once, and that drafter went away before an attach took the channel: a channel
            # whose connection drops goes IDLE and never reconnects by itself. Ask it to, again.
            self.channel.unsubscribe(self._seen)
            self._state = None
            self.channel.subscribe(self._seen, try_to_connect=True)
        return self._state is grpc.ChannelConnectivity.READY

    def take(self) -> grpc.Channel:
        """The connected channel, now the caller's."""
        self.channel.unsubscribe(self._seen)
        return self.channel

    def close(self) -> None:
        _close_channel(self.take())


@dataclass(frozen=True)
class RemoteChainBatch:
    """The drafting sequences of a chained step through the drafter service (`RemoteProposer.chain_batch`)."""

    seq_ids: tuple[int, ...]
    ahead: tuple[int, ...]  # how far each anchor may lie past the drafter's next position (ChainStep.ahead)
    conn: "_Connection"  # the connection it was made on: a later one's drafter never saw these steps


def _refuses_page(exc: BaseException) -> bool:
    """Whether an attach's failure is the drafter refusing the DONE buffer on our host page (none is passed
    again: device waits go into device memory, or by default our host polls), not a passing one (the drafter
    gone or slow: the next attach passes a page again)."""
    if isinstance(exc, grpc.RpcError):
        code = getattr(exc, "code", None)
        return callable(code) and code() == grpc.StatusCode.INVALID_ARGUMENT
    return isinstance(exc, InvalidRequest)


class RemoteProposer:
    """The drafter service as a `shared.proposer.Proposer`; `spec` is None until a drafter first answers."""

    drafts_from_peer = True  # device drafts are a peer's bytes: the engine bounds them (see propose_on_device)
    # Chained steps run piece by piece, never captured whole: a propose here is a Step round trip, whose
    # host waits a graph cannot hold.
    chain_captured_whole = False

    def __init__(self, address: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 timeout: float = 30.0, head: tuple[torch.Tensor, torch.Tensor] | None = None,
                 max_batch: int = 64, security: ClientSecurity = ClientSecurity(), step_socket: bool = True,
                 chain_ahead: bool = True, device_waits: bool | None = False, host_flags: bool = True,
                 tree_keep: int = 0, trees_ahead: bool = False) -> None:
        # max_batch: the engine's widest step; security: the drafter's token and TLS (shared.security);
        # step_socket: send the Step stream to the drafter's step socket when it offers one on this host;
        # chain_ahead: send each chained step's propose as the step before it launches (chain_prefetch);
        # device_waits: our stream waits on the device for a chained propose's drafts (shared.device_waits)
        # instead of our host polling the drafter's event, where the drafter writes done values; None: only
        # where they go into the host page (its waits' release gets through a kernel module's load), else
        # our host polls;
        # host_flags: with device waits, the DONE buffer in a host page passed over the step socket when the
        # drafter takes one (our watchdog then releases a wait with a store of our CPU; shared.host_flags);
        # tree_keep: each block row's candidates a chained draft tree asks for (EngineConfig.draft_tree_keep;
        # 0: no trees), which the drafts buffer is made wide enough for;
        # trees_ahead: a chained tree step's candidates asked for as the step before launches, as chain_ahead does
        # for chains (chain_prefetch with tree_keep), taken when the next step is a tree step of the same batch
        if isinstance(tree_keep, bool) or not isinstance(tree_keep, int) or not 0 <= tree_keep <= MAX_TREE_KEEP:
            raise InvalidRequest(f"tree_keep is a number of tokens in 0..{MAX_TREE_KEEP}, got {tree_keep!r}")
        self.tree_keep = tree_keep
        self.address = grpc_target(address)
        self.security = security
        self.device, self.dtype, self.timeout = torch.device(device), dtype, timeout
        self.head = head  # (embedding, lm_head) shared with a drafter on the same GPU
        self.max_batch = max_batch
        self.use_step_socket = step_socket
        self.chain_ahead = chain_ahead
        self.trees_ahead = trees_ahead
        self.device_waits = device_waits
        self.host_flags = host_flags
        self._page_refused: str | None = None  # why no host page is made or passed any more (None: it is)
        self._waits: DeviceWaits | None = None  # made with the first connection that waits on the device
        self._host_waits_next = False  # the next drafts in the buffer are waited for by our host (wait_on_host_next)
        self.mode = "inline"
        self.step_transport = "grpc"  # or "socket": how the Step stream travels on the attached connection
        self.link = LinkStats()
        self.last_error = ""  # why no drafter is attached now ("" while one is)
        self._conn: _Connection | None = None
        self._pending: dict[int, _Pending] = {}
        # attaches on the Step stream (`attach_on_stream`) not taken yet: _QUEUED, _SENT, None (attached), or
        # the refusal (or the connection's end) to raise
        self._attaches: dict[int, object] = {}
        self._step_id = 0
        self._unanswered = False  # a Step sent by send_pending or prefetch whose answer is not read yet
        self._ahead: dict[int, ProposeRequest] | None = None  # the proposes of the last prefetch, by seq id
        self._ahead_result: wire.StepResult | None = None  # its answer, once read
        self._retry_at = 0.0
        self._backoff = 0.5
        self._probe: _Probe | None = None
        # (drafts, done) of closed connections (_retire); done: a DONE buffer, or the host page
        self._retired: list[tuple[RowBuffer, tuple]] = []
        self._ahead_prefetched = False  # _ahead came from prefetch (not a Step propose_on_device sent)
        self._chain_commit: tuple[tuple[int, ...], int, int] | None = None  # (seq ids, rows each, offset) to send
        self._settles: tuple[list[int], list[int]] = ([], [])  # chained steps read: (seq ids, rows each) to send
        self._chain_ahead: tuple | None = None  # the chained propose chain_prefetch sent: what chain_propose matches
        self._unanswered_chain = False  # the Step not answered yet is that one
        # ... and its drafts, taken before its answer was read (_take_unanswered): (seq id, drafts) each
        self._taken_unanswered: tuple[tuple[int, int], ...] | None = None
        self._chain_ahead_result: wire.StepResult | None = None  # its answer, once read
        self.spec: DrafterSpec | None = None
        try:
            self.spec = self._connect(open_channel(self.address, PEER_CHANNEL_OPTIONS, security.tls),
                                      ready_wait=ATTACH_WAIT, call_wait=timeout)
        except DrafterUnavailable as exc:
            self._disconnect()
            self._note_unavailable(exc)

    @property
    def waits_released(self) -> int:
        """Device waits on chained drafts we released ourselves (past a deadline, or dropping the drafter)."""
        return self._waits.released if self._waits is not None else 0

    # ---- connection ------------------------------------------------------------------------------

    def _connect(self, channel: grpc.Channel, *, ready_wait: float, call_wait: float) -> DrafterSpec:
        """Attach over `channel`: describe, register buffers, open the Step stream and see it answer."""
        client = uuid.uuid4().hex
        conn = _Connection(channel, drafter_pb2_grpc.DrafterServiceStub(channel),
                           ((CLIENT_HEADER, client), *self.security.metadata))
        try:
            grpc.channel_ready_future(channel).result(timeout=ready_wait)
            desc = wire.description_from_proto(
                conn.stub.Describe(drafter_pb2.DescribeDrafterRequest(), timeout=call_wait, metadata=conn.metadata))
            if desc.instance:  # every later call names this drafter process: a restarted one refuses them
                conn.metadata = (*conn.metadata, (INSTANCE_HEADER, desc.instance))
            self._setup_transport(conn, desc, client, call_wait)
            conn.columns, conn.prefill_allocs = desc.step_columns, desc.prefill_allocs
            conn.step_attach = desc.step_attach
        except (grpc.RpcError, grpc.FutureTimeoutError, SpecsplitError, OSError) as exc:  # OSError: shared memory
            conn.close()  # the channel and any buffers already exported
            raise DrafterUnavailable(f"cannot attach the drafter at {self.address}: "
                                     f"{_reason(exc, ready_wait)}") from None
        # On one host (rows by shared memory or CUDA IPC) the drafter's step socket, when it has one, carries
        # the Step stream: a third of gRPC's round trip (shared.frames).
        self.step_transport = "grpc"
        if desc.step_socket and self.use_step_socket and self.mode != "inline":
            conn.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.sock.settimeout(call_wait)
                conn.sock.connect(desc.step_socket)
                conn.page = self._page_for(conn, desc)
                frames.send_hello(conn.sock, client, self.security.token, conn.page.fd if conn.page else None)
                self.step_transport = "socket"
            except OSError as exc:  # not ours to open after all (another mount namespace...): gRPC it is
                log.info("the drafter's step socket %s cannot be used (%s); the Step stream goes over gRPC",
                         desc.step_socket, exc)
                conn.sock.close()
                conn.sock = None
                if conn.page is not None:
                    conn.page.close()
                    conn.page = None
        if conn.sock is None:
            conn.responses = conn.stub.Step(iter(conn.outbox.get, None), metadata=conn.metadata)
            conn.responses.add_done_callback(lambda call: self._ended(call, conn))
            threading.Thread(target=self._watch, args=(conn,), daemon=True).start()
        self._conn, self._pending, self._attaches = conn, {}, {}  # (attaches out on a dropped one: not asked for again)
        try:
            self._flush([], timeout=call_wait)  # the stream opens lazily: did the drafter take it (--max-targets)?
        except SpecsplitError as exc:  # _flush has disconnected; exc is the drafter's reason when it gave one
            if conn.page is not None and isinstance(exc, InvalidRequest):  # the page refused: none next
                self._page_refused = str(exc)
                log.warning("the drafter refused our host page (%s); %s", exc, self._without_page)
            raise DrafterUnavailable(f"cannot attach the drafter at {self.address}: {exc}") from None
        if self._wants_done(conn, desc):  # (after the stream's first answer: the drafter holds the hello's page)
            try:
                self._setup_done(conn, desc, call_wait)
            except (grpc.RpcError, SpecsplitError, OSError) as exc:
                if conn.page is not None and _refuses_page(exc):  # (the page's registration refused: none from now on)
                    self._page_refused = f"{type(exc).__name__}: {exc}"
                    log.warning("the drafter's DONE buffer on our host page failed (%s); %s", self._page_refused,
                                self._without_page)
                self._disconnect()
                raise DrafterUnavailable(f"cannot attach the drafter at {self.address}: "
                                         f"{_reason(exc, ready_wait)}") from None
        waits = "our host polls its events" if conn.done is None else \
            f"our stream waits on {'the host page' if conn.done is conn.page else 'device memory'}"
        log.info("drafter at %s attached (%s rows, Step stream over %s, %s; chained drafts: %s)", self.address,
                 self.mode, self.step_transport, desc.spec.kind.value, waits)
        return desc.spec

    def _note_unavailable(self, exc: Exception) -> None:
        """Log why the drafter is not attached, at WARNING when the reason is new."""
        reason = str(exc)
        level = logging.WARNING if reason != self.last_error else logging.INFO
        log.log(level, "%s; decoding without speculation until it attaches", reason)
        self.last_error = reason

    def _setup_transport(self, conn: _Connection, desc: wire.DrafterDescription, client: str, wait: float) -> None:
        spec = desc.spec
        # The drafter answers identities salted with our client id (drafter_service.server.Describe).
        self.mode = choose_mode(identity_digest(client, host_id()), desc.host_id,
                                identity_digest(client, device_uuid(self.device)), desc.device_uuid)
        if desc.needs_target_head and (self.mode != "cuda_ipc" or self.head is None):
            raise DrafterUnavailable(f"the drafter wants the target's embedding and LM head, which can only be "
                                     f"shared on one GPU (rows travel by {self.mode} here); start it with --head checkpoint")
        conn.exporter = BufferExporter() if self.mode != "inline" else None
        # Shared memory between two GPUs of one host stages rows in host memory.
        stage_on = self.device if self.mode == "cuda_ipc" else torch.device("cpu")
        step_rows = self.max_batch * (spec.max_drafts + 1)  # every sequence of the widest engine step
        conn.step = RowStager(conn.exporter, step_rows, spec.feature_dim, self.dtype, stage_on, self.link)
        conn.bulk = RowStager(conn.exporter, 1024, spec.feature_dim, self.dtype, stage_on, self.link)
        buffers = [b.buffer for b in (conn.step, conn.bulk) if b.buffer is not None]
        conn.tree_candidates = self.tree_keep > 0 and desc.tree_keep == self.tree_keep
        if self.tree_keep and desc.tree_keep != self.tree_keep:
            log.info("drafter at %s answers %s candidates a row, not the %d draft trees ask for: chains only",
                     self.address, desc.tree_keep or "no", self.tree_keep)
        if self.mode == "cuda_ipc" and desc.drafts_buffer:  # drafts may stay on the GPU, written into our buffer
            # (with draft trees: wide enough for each row's candidates, ids then log-probabilities)
            width = 2 * spec.max_drafts * self.tree_keep if conn.tree_candidates else spec.max_drafts
            conn.drafts = conn.exporter.create(self.max_batch, width, torch.int32, self.device, BufferRole.DRAFTS)
            buffers.append(conn.drafts)
        if desc.chains and conn.exporter is not None and stage_on == self.device:
            # (rows staged in host memory for a GPU target would make each chained step wait for its verify)
            conn.feed = conn.exporter.create(FEED_ROWS, self.max_batch, torch.int32, stage_on, BufferRole.FEED)
            buffers.append(conn.feed)
        if desc.needs_target_head:
            embed, lm_head = self.head
            conn.head_buffers = [conn.exporter.export_existing(embed, BufferRole.TARGET_EMBEDDING)]
            if lm_head.data_ptr() != embed.data_ptr():  # tied weights are shared once
                conn.head_buffers.append(conn.exporter.export_existing(lm_head, BufferRole.TARGET_LM_HEAD))
            buffers += conn.head_buffers
        if buffers:
            request = drafter_pb2.RegisterBuffersRequest(buffers=[wire.descriptor_to_proto(b.describe()) for b in buffers])
            conn.stub.RegisterBuffers(request, timeout=wait, metadata=conn.metadata)

    def _wants_done(self, conn: _Connection, desc: wire.DrafterDescription) -> bool:
        """Whether our stream will wait on the device for this drafter's done values (a DONE buffer): asked
        for, or left to us (device_waits None) and the host page passed."""
        return (self.device_waits is True or (self.device_waits is None and conn.page is not None)) \
            and self._could_wait(conn, desc)

    @property
    def _without_page(self) -> str:
        """What becomes of device waits once no host page is passed any more."""
        return "done values go into device memory" if self.device_waits else "our host polls the drafter's events"

    def _could_wait(self, conn: _Connection, desc: wire.DrafterDescription) -> bool:
        """Whether this connection lets our stream wait on the device for the drafter's done values."""
        return bool(desc.done_flags) and conn.feed is not None and conn.drafts is not None and stream_ops() is not None

    def _page_for(self, conn: _Connection, desc: wire.DrafterDescription) -> HostPage | None:
        """The host page to pass with the step socket's hello: where our stream will wait for done values, the
        drafter takes one, and none was refused before (else None: the DONE buffer in device memory)."""
        if not (desc.host_flags and self.host_flags and self._page_refused is None and self.device_waits is not False
                and self._could_wait(conn, desc)):
            return None
        try:
            return HostPage.create(self.device)
        except Exception as exc:  # noqa: BLE001 - the DONE buffer goes into device memory instead
            self._page_refused = f"{type(exc).__name__}: {exc}"
            log.warning("no host page for the drafter's done values (%s); %s", self._page_refused,
                        self._without_page)
            return None

    def _setup_done(self, conn: _Connection, desc: wire.DrafterDescription, wait: float) -> None:
        """The DONE buffer, registered once the Step stream is open: the host page passed with the step
        socket's hello when there is one (its flags released by our CPU's stores), else device memory.
        Element 1: the written values our stream writes for a drafter that waits on them on its device."""
        cols = 2 if desc.written_flags else 1
        if conn.page is not None:  # (written values, which the drafter's stream waits on, into device memory)
            conn.done = conn.page
            conn.done_id = conn.exporter.new_id()
            descriptors = [BufferDescriptor(conn.done_id, BufferKind.HOST_PAGE, "", torch.int32, 1, 1, host_id(),
                                            role=BufferRole.DONE)]
            conn.done_flags = [conn.page.flag(0)]
            if desc.written_flags:
                written = conn.written = conn.exporter.create(1, 1, torch.int32, self.device, BufferRole.DONE)
                written.tensor.zero_()
                torch.cuda.current_stream(self.device).synchronize()  # (zero before the drafter can wait on it)
                descriptors.append(written.describe())
                conn.done_flags.append(Flag.of(written.tensor[0, 0:1]))
        else:
            buffer = conn.done = conn.exporter.create(1, cols, torch.int32, self.device, BufferRole.DONE)
            buffer.tensor.zero_()
            torch.cuda.current_stream(self.device).synchronize()  # (zero before the drafter can write it)
            conn.done_id, descriptors = buffer.buffer_id, [buffer.describe()]
            conn.done_flags = [Flag.of(buffer.tensor[0, i:i + 1]) for i in range(cols)]
        request = drafter_pb2.RegisterBuffersRequest(buffers=[wire.descriptor_to_proto(d) for d in descriptors])
        conn.stub.RegisterBuffers(request, timeout=wait, metadata=conn.metadata)
        if self._waits is None:
            self._waits = DeviceWaits(stream_ops(), self.device)

    @staticmethod
    def _ended(call: grpc.Call, conn: _Connection) -> None:
        """The Step stream is over (grpc's callback). Unary calls on this channel could now reach a
        restarted drafter under this session's id, which it does not know (or would open afresh): the
        connection is over."""
        if call.code() not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            conn.error = wire.error_from_status(call.code().name, f"drafter {call.code().name}: {call.details()}")
        conn.dead = True

    @staticmethod
    def _watch(conn: _Connection) -> None:
        """Cancel the Step stream once an awaited answer is overdue. The engine thread reads answers
        itself (no reader thread to hand each one over), so this is what keeps a frozen drafter from
        holding it past the deadline."""
        while not conn.dead:
            time.sleep(WATCH_PERIOD)
            if conn.due and time.monotonic() > conn.due:
                conn.overdue = True
                conn.responses.cancel()
                return

    def _retire(self, drafts: RowBuffer, *kept: RowBuffer | HostPage | None) -> None:
        """Keep a closed connection's drafts buffer (and its event, and its DONE buffer) alive: a Step that
        offered it may still be in the drafter's hands, or its work queued on the drafter's GPU, and would
        write into memory freed and perhaps reused. The last RETIRED_DRAFTS_BUFFERS are kept, and any older
        one until the drafter's last recorded work on it is seen done (a drafter given up for never finishing
        it; it writes a done value before it records that work)."""
        self._retired.append((drafts, kept))
        recent = self._retired[-RETIRED_DRAFTS_BUFFERS:]
        older = self._retired[:-RETIRED_DRAFTS_BUFFERS]
        self._retired = [b for b in older if not _importer_done(b[0])] + recent
        still = {id(b) for _, others in self._retired for b in others}
        for page in (b for _, others in older for b in others):  # (unmapped once our stream's work on it is done)
            if isinstance(page, HostPage) and id(page) not in still:
                self._close_page(page)

    def _close_page(self, page: HostPage) -> None:
        """Unregister a retired page, unless our watchdog may still write to it (then it stays, for good)."""
        if self._waits is not None and self._waits.holds(page):
            log.warning("a retired host page is still watched by our device waits: it stays mapped")
            page.keep_for_good()
            return
        page.close()

    def _disconnect(self) -> None:
        if self._waits is not None:
            self._waits.release()  # no stream of ours waits on a drafter we drop
            self._waits.failure = None  # (a failure of the connection dropped now: the next one starts clean)
        if self._conn is not None:
            if self._conn.drafts is not None:
                self._retire(self._conn.drafts, self._conn.done if self._conn.done is not None else self._conn.page,
                             self._conn.written)
            elif self._conn.page is not None:
                self._conn.page.close()
            self._conn.close()
        self._conn = None
        self._pending = {}
        # attaches not answered (or not taken) go with the connection
        gone = DrafterUnavailable("the drafter connection dropped before the sequence's attach was taken")
        self._attaches = {seq_id: gone for seq_id in self._attaches}
        self._chain_commit = None
        self._settles = ([], [])
        self._unanswered = self._unanswered_chain = False
        self._taken_unanswered = None
        self._ahead = self._ahead_result = None
        self._chain_ahead = self._chain_ahead_result = None
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 5.0)

    def available(self) -> bool:
        """Whether the drafter can be used; re-attaches (with backoff) once a drafter is up again. Never
        waits for one: only a drafter whose connection is up gets an attach (each call <= ATTACH_WAIT)."""
        if self._conn is not None and not self._conn.dead and (self._unanswered or not self._conn.socket_closed()):
            return True
        if self._conn is not None:
            self._disconnect()
        if time.monotonic() < self._retry_at:
            return False
        if self._probe is None:
            self._probe = _Probe(self.address, self.security.tls)
        if not self._probe.up:
            return False
        channel, self._probe = self._probe.take(), None
        try:
            spec = self._connect(channel, ready_wait=ATTACH_WAIT, call_wait=ATTACH_WAIT)
        except DrafterUnavailable as exc:
            self._disconnect()
            self._note_unavailable(exc)
            return False
        if self.spec is not None and spec != self.spec:
            self._disconnect()
            self._note_unavailable(DrafterUnavailable(f"the drafter at {self.address} came back with a different "
                                                      "spec; not re-attaching"))
            return False
        self.spec, self.last_error, self._backoff = spec, "", 0.5
        return True

    def close(self) -> None:
        self._disconnect()
        if self._waits is not None:
            self._waits.close()
        for page in (b for _, kept in self._retired for b in kept):  # (no stream of ours waits on them now;
            if isinstance(page, HostPage):                           # the drafter's mapping is its own)
                self._close_page(page)
        self._waits = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def reset(self) -> None:
        """Drop the connection: the drafter frees everything this target held there; `available()`
        reconnects after the backoff. The engine calls this whenever it stops trusting the drafter's state."""
        if self._conn is not None:
            self._disconnect()

    def _live(self) -> _Connection:
        if self._conn is not None and not self._unanswered and self._conn.socket_closed():
            self._conn.dead = True  # as gRPC's callback marks a Step stream that ended
            self._conn.error = self._conn.last_words()
        if self._conn is not None and self._conn.dead:
            cause = self._conn.error
            self._disconnect()
            # The drafter's reason when it gave one (e.g. RESOURCE_EXHAUSTED: it serves --max-targets targets).
            raise type(cause)(str(cause)) if cause is not None else DrafterUnavailable(
                "the drafter closed the step stream")
        if self._conn is None:
            raise DrafterUnavailable(self.last_error or "the drafter is disconnected")
        if self._waits is not None and self._waits.failure is not None:
            failure, self._waits.failure = self._waits.failure, None
            self._disconnect()
            raise DrafterUnavailable(failure)
        if self._unanswered:  # whatever comes next waits for it: the rows it referenced, the verbs' order
            self._unanswered = False
            self._unanswered_chain, chain = False, self._unanswered_chain
            taken, self._taken_unanswered = self._taken_unanswered, None
            try:
                # (an answer read ahead of its use waits on our host if asked, and leaves the ask standing:
                # its drafts may be dropped, and those of the Step sent instead are what the ask is for)
                result = self._answer(self._conn, self.step_deadline(), timed=False, waited=taken is not None,
                                      keep_host_wait=True)
            except DrafterUnavailable:
                raise
            except SpecsplitError as err:  # the earlier step's fault, not the call now being made
                raise DrafterUnavailable(f"the drafter refused a Step sent ahead: {err}") from err
            if taken is not None:  # its drafts went to a verify already: they must be what it asked for
                if result.in_buffer != taken:
                    self._disconnect()
                    raise DrafterUnavailable("the drafter answered a chained propose whose drafts were taken "
                                             "for other sequences or lengths")
            elif chain:  # (each answer filed as what its Step was)
                self._chain_ahead_result = result
            else:
                self._ahead_result = result
        return self._conn

    def _unary(self, method: str, request):
        conn = self._live()
        self._send_alloc(conn)
        self.link.unary_calls[method] += 1
        try:
            return getattr(conn.stub, method)(request, timeout=self.timeout, metadata=conn.metadata)
        except grpc.RpcError as exc:
            error = _error_from_rpc(exc)
            if isinstance(error, DrafterUnavailable):
                self._disconnect()
            raise error from None

    # ---- Proposer verbs -----------------------------------------------------------------------------

    def alloc(self, seq_id: int, budget_tokens: int) -> None:
        """To a drafter whose PrefillDrafter allocates, left for the sequence's prefill, called next: one
        round trip attaches a sequence (any other call first sends it as an AllocState of its own)."""
        self._send_queued(seq_id)
        conn = self._live()
        self._send_alloc(conn)
        conn.alloc_refused.pop(seq_id, None)
        if conn.prefill_allocs:
            conn.alloc_next = (seq_id, budget_tokens)
            return
        self._allocating("AllocState", wire.alloc_to_proto(seq_id, budget_tokens))
        conn.allocated.add(seq_id)

    def _send_alloc(self, conn: _Connection) -> None:
        """The allocation `alloc` left for a prefill, sent alone before any call that is not that prefill.
        Refused, the refusal is the sequence's: its prefill raises it, not the call it was sent for."""
        if conn.alloc_next is not None:
            seq_id, budget = conn.alloc_next
            conn.alloc_next = None
            try:
                self._allocating("AllocState", wire.alloc_to_proto(seq_id, budget))
            except _REFUSALS as err:
                conn.alloc_refused[seq_id] = err
                return
            conn.allocated.add(seq_id)

    def _allocating(self, method: str, request):
        """A unary call that allocates a sequence. Refused for room while frees are queued (they ride on the
        next Step, which this call overtakes), it goes again once they are sent."""
        try:
            return self._unary(method, request)
        except CapacityExceeded:
            if not any(p.free for p in self._pending.values()):
                raise
        self._flush([])
        return self._unary(method, request)

    @staticmethod
    def _raise_refused(conn: _Connection, seq_id: int) -> None:
        refused = conn.alloc_refused.pop(seq_id, None)
        if refused is not None:
            raise refused

    def prefill(self, seq_id: int, token_ids: Sequence[int], rows: torch.Tensor, start_pos: int = 0, *,
                stream: "torch.cuda.Stream | None" = None) -> int:
        """stream: the rows' copy into our buffer for the drafter goes on it (the engine's attach stream,
        EngineConfig.overlap_attach), not on the current one. Attaches queued on the stream (`attach_on_stream`)
        go first, in a Step of their own: their rows go into the bulk buffer as that Step is sent, and a flush
        inside this call (a refusal for room retried after the queued frees) would otherwise write them over
        this prefill's, or into a buffer the drafter has not been told of yet (`_grow_bulk`)."""
        self._send_queued(seq_id)
        if any(p.attach is not None for p in self._pending.values()):
            self._flush([])
        conn = self._live()
        if conn.alloc_next is not None and conn.alloc_next[0] != seq_id:
            self._send_alloc(conn)
        self._raise_refused(conn, seq_id)
        if conn.bulk.buffer is None:  # inline: in pieces the drafter's message cap lets through
            step = max(1, INLINE_PREFILL_BYTES // (rows.shape[1] * self.dtype.itemsize))
            return sum(self._prefill_part(conn, seq_id, token_ids[i:i + step], rows[i:i + step], start_pos + i, stream)
                       for i in range(0, rows.shape[0], step))
        if rows.shape[0] > conn.bulk.buffer.tensor.shape[0]:
            # (its calls send this sequence's allocation alone first; the new buffer is zeroed on `stream`,
            # before the rows' copy on it)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._grow_bulk(conn, rows.shape[0])
            self._raise_refused(conn, seq_id)
        return self._prefill_part(conn, seq_id, token_ids, rows, start_pos, stream)

    def _prefill_part(self, conn: _Connection, seq_id: int, token_ids, rows: torch.Tensor, start_pos: int,
                      stream: "torch.cuda.Stream | None" = None) -> int:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            staged = conn.bulk.put(rows)
            conn.bulk.seal()
        op = wire.RowsOp(tuple(token_ids), conn.bulk.source(staged, rows.shape[0]), start_pos)
        # (the first part of a sequence `alloc` left allocates it: refused, the drafter holds nothing of it)
        budget = None
        if conn.alloc_next is not None and conn.alloc_next[0] == seq_id:
            budget, conn.alloc_next = conn.alloc_next[1], None
        request = wire.prefill_to_proto(seq_id, op, budget)
        appended = (self._unary if budget is None else self._allocating)("PrefillDrafter", request).rows_appended
        if budget is not None:
            conn.allocated.add(seq_id)
        return appended

    def _grow_bulk(self, conn: _Connection, rows: int) -> None:
        old = conn.bulk.buffer
        conn.bulk = RowStager(conn.exporter, max(rows, 2 * old.tensor.shape[0]), old.tensor.shape[1],
                              self.dtype, old.tensor.device, self.link)
        self._unary("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(
            buffers=[wire.descriptor_to_proto(conn.bulk.buffer.describe())]))
        self._unary("ReleaseBuffers", drafter_pb2.ReleaseBuffersRequest(buffer_ids=[old.buffer_id]))
        conn.exporter.release(old.buffer_id)

    def attach_on_stream(self, seq_id: int, budget_tokens: int, token_ids: Sequence[int], rows: torch.Tensor) -> bool:
        """A sequence's attach (its allocation, then its prompt's rows as a catch-up from position 0) queued for
        the next Step, where `alloc` + `prefill` would make a round trip of their own now, after waiting for any
        Step still out: False (nothing queued) when this drafter or connection cannot take it that way (no
        DrafterDescription.step_attach, rows not through a registered buffer, more rows than the bulk buffer
        has left for this Step). `attach_outcome` tells how it went, once the Step is answered; a refusal is the
        sequence's alone, as `prefill`'s. The rows stay ours, unread, until that Step is sent."""
        conn = self._conn
        if conn is None or conn.dead or not conn.step_attach or conn.bulk is None or conn.bulk.buffer is None \
                or rows is None or rows.dim() != 2 or rows.shape[0] == 0:
            return False
        if seq_id in conn.allocated or seq_id in self._pending or seq_id in self._attaches \
                or (conn.alloc_next is not None and conn.alloc_next[0] == seq_id):
            raise StateConflict(f"sequence {seq_id} is attached already, or has verbs queued")
        queued = sum(p.attach[2].shape[0] for p in self._pending.values() if p.attach is not None)
        if queued + rows.shape[0] > conn.bulk.buffer.tensor.shape[0]:
            return False  # (`prefill` grows the buffer; this Step's rows must fit the one the drafter maps)
        if rows.shape[1] != conn.bulk.cols:
            raise InvalidRequest(f"feature rows must be [n, {conn.bulk.cols}], got {tuple(rows.shape)}")
        budget = wire.SeqStep(seq_id, alloc=budget_tokens).alloc  # (checked as the drafter will)
        # (`last` as a free's: any verb queued for it later sends the attach first, not merged into its SeqStep)
        self._pending[seq_id] = _Pending(attach=(budget, tuple(token_ids), rows), last=_OP_ORDER["free"])
        self._attaches[seq_id] = _QUEUED
        return True

    def attach_outcome(self, seq_id: int, *, read: bool = True, wait: bool = False) -> bool | None:
        """How the attach `attach_on_stream` queued went: True (attached), or its refusal raised
        (InvalidRequest, CapacityExceeded, StateConflict: the sequence's alone), or DrafterUnavailable (the
        connection dropped). None while it is not known: queued for a Step, or (`read` false) in a Step still
        out. `read`: the answer to a Step still out that carries it is read now (waiting for it); `wait`: one
        still queued goes now, in a Step of its own, its answer waited for."""
        state = self._attaches.get(seq_id, _MISSING)
        if state is _MISSING:
            raise StateConflict(f"no attach of sequence {seq_id} is out")
        if (state is _QUEUED and not wait) or (state is _SENT and not (read or wait)):
            return None
        if state is _QUEUED or state is _SENT:
            try:  # (a Step sent ahead is answered when read: every Step sent is answered or left unanswered)
                if state is _QUEUED:
                    self._flush([])
                else:
                    self._live()
            except SpecsplitError as err:  # the Step's own failure, or the stream's end: the connection dropped
                if isinstance(err, DrafterUnavailable):
                    raise
                self.reset()  # (gone already, unless the stream's end was not read yet)
                raise DrafterUnavailable(f"the Step carrying sequence {seq_id}'s attach failed: {err}") from err
        state = self._attaches.pop(seq_id)
        if isinstance(state, BaseException):
            raise state
        if state is not None:  # (a bug: each send's answer settles the attaches it carried)
            raise DrafterUnavailable(f"the attach of sequence {seq_id} was left unanswered")
        return True

    def _stage_attaches(self, conn: _Connection) -> dict[int, wire.RowsOp]:
        """The queued attaches' rows into the bulk buffer (one generation, sealed), as the Step carrying them is
        sent: any Step before it that read the buffer has been answered by then."""
        staged = {seq_id: (p.attach[1], conn.bulk.put(p.attach[2]), p.attach[2].shape[0])
                  for seq_id, p in self._pending.items() if p.attach is not None}
        if not staged:
            return {}
        conn.bulk.seal()  # (written, and on a GPU its event recorded, before any reference to the rows is made)
        return {seq_id: wire.RowsOp(tokens, conn.bulk.source(offset, n), 0) for seq_id, (tokens, offset, n) in staged.items()}

    def _settle_attaches(self, conn: _Connection, sent: tuple[int, ...],
                         errors: Sequence[wire.SeqError]) -> list[wire.SeqError]:
        """The attaches a Step carried, from its answer: each attached, or refused (the sequence's own error, the
        drafter holding nothing of it); returns the errors left, which drop the connection."""
        refused = {}
        for error in errors:
            if error.seq_id in sent:
                exc = error.exception()
                if isinstance(exc, _REFUSALS):
                    refused[error.seq_id] = exc
        for seq_id in sent:
            if seq_id in refused:
                self._attaches[seq_id] = refused[seq_id]
            else:
                conn.allocated.add(seq_id)
                self._attaches[seq_id] = None
        return [e for e in errors if e.seq_id not in refused]

    def _pending_for(self, seq_id: int, op: str) -> _Pending:
        """The sequence's queue; if it already holds `op` or an op applied after it, those are sent first.

        Called before staging rows, since a send starts a new generation of the step buffer.
        """
        pending = self._pending.get(seq_id)
        order = _OP_ORDER[op]
        if pending is not None and pending.last >= order:
            self._flush([])
            pending = None
        if pending is None:
            pending = self._pending[seq_id] = _Pending()
        pending.last = order
        return pending

    def stash(self, seq_id: int, rows: torch.Tensor) -> None:
        pending = self._pending_for(seq_id, "stash")
        pending.stash = (self._live().step.put(rows), rows.shape[0])

    def commit(self, seq_id: int, num_rows: int, base_pos: int, token_ids: Sequence[int]) -> None:
        self._pending_for(seq_id, "commit").commit = wire.CommitOp(num_rows, base_pos, tuple(token_ids))

    def trim(self, seq_id: int, num_accepted: int) -> None:
        self._pending_for(seq_id, "trim").trim = num_accepted

    def commit_verified_many(self, seq_ids: Sequence[int], rows: torch.Tensor, row_starts: Sequence[int],
                             row_counts: Sequence[int], num_accepted: Sequence[int], base_pos: Sequence[int],
                             token_ids: Sequence[Sequence[int]]) -> None:
        """The in-process drafters' one call after a verify (see `Drafter.commit_verified_many`), queued
        for the next Step as each sequence's stash + commit + trim: the verify's rows are staged once (one
        copy, each sequence referencing its slice) instead of once per sequence. The drafter checks
        them, as it checks the plain verbs."""
        if any(seq_id in self._pending for seq_id in seq_ids):  # ops queued before these go first
            self._flush([])
        if not seq_ids:
            return
        low = min(row_starts)
        staged = self._live().step.put(rows[low:max(a + n for a, n in zip(row_starts, row_counts))])
        order = _OP_ORDER["trim"]
        for seq_id, start, count, accepted, pos, tokens in zip(seq_ids, row_starts, row_counts, num_accepted,
                                                               base_pos, token_ids):
            start -= low
            part = staged + start if isinstance(staged, int) else staged[start:start + count]
            self._pending[seq_id] = _Pending(stash=(part, count), commit=wire.CommitOp(accepted + 1, pos, tuple(tokens)),
                                             trim=accepted, last=order)

    def catchup(self, seq_id: int, token_ids: Sequence[int], rows: torch.Tensor, base_pos: int) -> int:
        pending = self._pending_for(seq_id, "catchup")
        pending.catchup = (tuple(token_ids), self._live().step.put(rows), rows.shape[0], base_pos)
        return rows.shape[0]

    def free(self, seq_id: int) -> None:
        """Queued: it rides on the next step's message (the engine calls `flush` when none is coming).
        A sequence this connection never allocated (the drafter restarted since) has nothing to free.
        A Step sent ahead is not waited for: its answer is read by the next call that needs it."""
        attach = self._attaches.get(seq_id)
        if attach is _QUEUED:  # (never sent: nothing of it on the drafter)
            del self._attaches[seq_id]
            self._pending.pop(seq_id, None)
            return
        conn = self._conn
        if conn is None or conn.dead or not self._unanswered or attach is _SENT:
            conn = self._live()  # (an attach in the Step still out: its answer tells whether there is a sequence)
        self._attaches.pop(seq_id, None)
        if conn.alloc_next is not None and conn.alloc_next[0] == seq_id:  # (its prefill never went)
            conn.alloc_next = None
        conn.alloc_refused.pop(seq_id, None)
        if seq_id not in conn.allocated:
            self._pending.pop(seq_id, None)
            return
        conn.allocated.discard(seq_id)
        self._pending_for(seq_id, "free").free = True

    def _send_queued(self, seq_id: int) -> None:
        """A unary verb must not overtake the sequence's queued stream verbs (e.g. a free before a re-alloc)."""
        if seq_id in self._pending:
            self._flush([])

    def flush(self) -> None:
        """Send every queued verb now, in one Step message (nothing to send: no round trip)."""
        if self._pending or self._chain_commit is not None or self._settles[0]:
            self._flush([])

    def ping(self) -> float:
        """One empty Step round trip, in seconds (the transport's floor; benchmarks use it)."""
        started = time.perf_counter()
        self._flush([])
        return time.perf_counter() - started

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Drafts for `requests`; those asked unchanged by the last `prefetch` come from its answer, the
        rest (if any) from a Step sent now."""
        conn = self._live()  # reads a prefetch's answer, if one is out
        ahead, answer, self._ahead, self._ahead_result = self._ahead, self._ahead_result, None, None
        taken: dict[int, Proposal] = {}
        if ahead is not None and answer is not None:
            wanted = {r.seq_id for r in requests if r.seq_id in ahead and _same_request(ahead[r.seq_id], r)}
            in_buffer = any(seq_id in wanted for seq_id, _ in answer.in_buffer)  # else no read-back at all
            proposals = {**answer.proposals, **(self._read_buffer(conn, answer) if in_buffer else {})}
            for r in requests:
                sent = ahead.get(r.seq_id)
                if sent is not None and _same_request(sent, r) and r.seq_id in proposals:
                    taken[r.seq_id] = proposals[r.seq_id]
            if self._ahead_prefetched:
                self.link.drafts_ahead += len(taken)
        rest = [r for r in requests if r.seq_id not in taken]
        if rest:  # on the connection just checked (no second look at it)
            self._send(conn, rest)
            taken.update(self._answer(conn, self.step_deadline()).proposals)
        return [taken[r.seq_id] for r in requests]

    def propose_on_device(self, requests: Sequence[ProposeRequest]) -> torch.Tensor | None:
        """Drafts left on the GPU, as the in-process drafter's `propose_on_device`: [len(requests), n] ids,
        request i's in row i[:num_drafts], in a tensor of our own (a copy out of the drafts buffer, which
        the drafter may write again at the next Step). They come from the prefetched answer when it holds
        every request unchanged, or from a Step sent now. None when the drafter answered (or would answer)
        in the message instead: `propose` then takes that answer. The ids are the peer's bytes: the caller
        bounds them before they index anything."""
        conn = self._live()  # reads a prefetch's answer, if one is out
        if conn.drafts is None or not requests:
            return None
        ahead, answer = self._ahead, self._ahead_result
        covered = ahead is not None and answer is not None and all(
            r.seq_id in ahead and _same_request(ahead[r.seq_id], r) for r in requests)
        if not covered:
            if ahead is not None or any(r.bitmask is not None or r.want_confidence for r in requests):
                return None  # propose() takes what it can from the prefetched answer, or asks on the host path
            self._send(conn, list(requests), into_buffer=True)
            answer = self._answer(conn, self.step_deadline())
            self._ahead, self._ahead_result = {r.seq_id: r for r in requests}, answer  # for propose(), if need be
            self._ahead_prefetched = False
        rows = {seq_id: (row, count) for row, (seq_id, count) in enumerate(answer.in_buffer)}
        most = max(r.num_drafts for r in requests)
        view = conn.drafts.tensor
        if most > view.shape[1] or any(rows.get(r.seq_id, (0, -1))[1] != r.num_drafts for r in requests):
            return None
        self._check_rows(conn, answer)
        self._ahead = self._ahead_result = None
        if covered:
            self.link.drafts_ahead += len(requests)
        index = [rows[r.seq_id][0] for r in requests]
        if index == list(range(len(index))):
            tokens = view[:len(index), :most].clone()
        else:
            tokens = torch.stack([view[i, :most] for i in index])
        self._note_read(conn)
        self.link.drafts_on_device += len(requests)
        return tokens

    def _check_rows(self, conn: _Connection, answer: wire.StepResult) -> None:
        if len(answer.in_buffer) > conn.drafts.tensor.shape[0] or \
                any(n > conn.drafts.tensor.shape[1] for _, n in answer.in_buffer):
            self._disconnect()
            raise DrafterUnavailable(f"the drafter answered {len(answer.in_buffer)} rows of drafts (up to "
                                     f"{max(n for _, n in answer.in_buffer)} each) in a "
                                     f"{tuple(conn.drafts.tensor.shape)} buffer")

    def _read_buffer(self, conn: _Connection, answer: wire.StepResult) -> dict[int, Proposal]:
        """The answer's drafts in the drafts buffer, read back to the host (the path without device drafts)."""
        if not answer.in_buffer:
            return {}
        self._check_rows(conn, answer)
        most = max(n for _, n in answer.in_buffer)  # (a buffer wide enough for trees' candidates: their drafts only)
        (rows,) = to_host(conn.drafts.tensor[:len(answer.in_buffer), :most])  # _answer saw the drafter's work done
        self._note_read(conn)
        return {seq_id: Proposal(tokens=rows[i][:n]) for i, (seq_id, n) in enumerate(answer.in_buffer)}

    @staticmethod
    def _note_read(conn: _Connection) -> None:
        """Our reads of the drafts buffer are queued: the next Step that offers it waits for them first."""
        if conn.drafts_read is None:
            conn.drafts_read = torch.cuda.Event()
        conn.drafts_read.record(torch.cuda.current_stream(conn.drafts.tensor.device))

    def prefetch(self, requests: Sequence[ProposeRequest]) -> None:
        """Send the queued verbs (the step's commits) and the next step's `requests` now, and read the
        answer later: the drafter drafts while the target emits the step's tokens and admits requests
        (the in-process engine's prefetch, done by the drafter service). `propose` takes the drafts of
        the requests it is asked again unchanged; a drafter's propose changes nothing a later propose
        or commit depends on (DFlash reads its context; MTP redoes its speculative rows), so drafts
        nobody takes are dropped."""
        plain = [r for r in requests if r.bitmask is None and not r.want_confidence]
        if self._unanswered or not plain:
            return
        conn = self._live()
        self._send(conn, plain, into_buffer=True)
        self._unanswered = True
        self._ahead, self._ahead_prefetched = {r.seq_id: r for r in plain}, True
        self.link.sent_ahead += 1

    # ---- chained steps ------------------------------------------------------------------------------
    # The in-process drafter's chain verbs (see target_service.chain) through the Step stream. The engine's
    # device work writes each chained step's verified rows into the step buffer and the positions they
    # lie at into the feed buffer (`chain_commit`); the next step's propose writes its anchors and
    # positions there too, and sends one Step with the commit, the propose and the settles read since
    # (`chain_propose`): no host of either side learns a position or an anchor to chain a step. The
    # drafter's GPU reads the feed after its host has seen our writes done, and we see its drafts done
    # before the verify reads them (host polls, as on the step-by-step path: neither stream ever waits
    # on the other process).

    @property
    def chains(self) -> bool:
        """Whether the attached drafter takes chained steps (the engine does not try them otherwise)."""
        return self._conn is not None and self._conn.feed is not None

    def chain_batch(self, seq_ids: Sequence[int], anchors_ahead: Sequence[int]) -> RemoteChainBatch | None:
        """The batch of a chained step, or None when the attached drafter does not chain them (it does not
        chain, or one of them is not allocated there): the engine then steps as usual."""
        conn = self._conn
        if conn is None or conn.dead or conn.feed is None or self.spec is None \
                or not 0 < len(seq_ids) <= min(self.max_batch, self.spec.max_batch) \
                or any(seq_id not in conn.allocated for seq_id in seq_ids):
            return None
        return RemoteChainBatch(tuple(seq_ids), tuple(int(a) for a in anchors_ahead), conn)

    def chain_commit(self, batch: RemoteChainBatch, rows: torch.Tensor, positions: torch.Tensor, count: int) -> None:
        """Queue the commit of a chained step's rows [B * count, F] at `positions` [B] (both on the device,
        copied now: the next forward rewrites them); it goes out with the next Step."""
        conn = self._chain_conn(batch)
        if self._chain_commit is not None:  # (a commit not sent yet: one step's at a time)
            self._flush([])
        offset = conn.step.put(rows, now=True)
        self._write_feed(conn, 0, positions)
        self._chain_commit = (batch.seq_ids, count, offset)

    def chain_prefetch(self, seq_ids: Sequence[int], anchors_ahead: Sequence[int], anchors: torch.Tensor,
                       positions: torch.Tensor, num_drafts: int, tree_keep: int = 0) -> tuple[int, ...] | None:
        """Send the next chained step's propose now, with the commit just queued and the settles: anchors [B]
        and positions [B] are device tensors the step just launched writes (read by the drafter's GPU once
        its host has seen them written, as every feed); `anchors_ahead` counts the rows of the steps
        launched and not read yet (their settles go with a later Step). The sequences may be more than
        the step's (Engine._chain_send_ahead: those the next step may add); those past the drafter's batch
        are left out. The answer is read by the next use of the connection; `chain_propose` takes its
        drafts when asked for the same sequences, k and feed tensors, or for some of these sequences
        (`ahead_rows`), and they are dropped otherwise (a propose changes no state). Returns the
        sequences proposed for, in order (None: nothing was sent). tree_keep: the next step's draft-tree
        candidates instead (`trees_ahead`; num_drafts its rows), which `chain_candidates` takes for the same
        sequences, rows and feed tensors."""
        if not (self.trees_ahead if tree_keep else self.chain_ahead):
            return None
        if tree_keep and tree_keep != self.tree_keep:
            raise ValueError(f"this drafter connection asks for {self.tree_keep} candidates a row, not {tree_keep}")
        conn = self._live()  # reads any answer still out: our buffers are ours to write again
        if conn.feed is None or self.spec is None or (tree_keep and not conn.tree_candidates):
            return None
        most = min(self.max_batch, self.spec.max_batch)
        if len(seq_ids) > most:
            seq_ids, anchors_ahead, anchors, positions = seq_ids[:most], anchors_ahead[:most], anchors[:most], positions[:most]
        if not seq_ids or any(s not in conn.allocated for s in seq_ids):
            return None
        batch = RemoteChainBatch(tuple(seq_ids), tuple(int(a) for a in anchors_ahead), conn)
        self._chain_ahead = self._chain_ahead_result = None
        self._write_anchors(conn, anchors, positions)
        self._send(conn, [], into_buffer=True, chain=(batch, num_drafts, tree_keep))
        self._unanswered = self._unanswered_chain = True
        self._chain_ahead = (batch.seq_ids, num_drafts, _feed_key(anchors), _feed_key(positions), conn, tree_keep)
        self.link.sent_ahead += 1
        self.link.chain_sent_ahead += 1
        return batch.seq_ids

    def chain_propose(self, batch: RemoteChainBatch, anchors: torch.Tensor, positions: torch.Tensor,
                      num_drafts: int, ahead_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Drafts [B, num_drafts] on our device for anchors [B] at positions [B] (on the device): those
        `chain_prefetch` asked for the same, or one Step now with the queued commit and settles.
        ahead_rows: the engine's word that these anchors and positions are, for each sequence, those of
        row ahead_rows[i] of the propose sent ahead (a batch that lost sequences, or gained some it was
        sent for besides the step's): its drafts are taken, those rows, with no round trip. The ids
        are the peer's bytes: the engine bounds them."""
        if self._take_unanswered(batch, anchors, positions, num_drafts):
            return self._drafts_in_buffer(batch.conn, len(batch.seq_ids), num_drafts)
        conn = self._chain_conn(batch)  # (reads a prefetched answer, if one is out)
        sent, answer = self._chain_ahead, self._chain_ahead_result
        self._chain_ahead = self._chain_ahead_result = None
        self._ahead = self._ahead_result = None  # a prefetch's drafts were for the step-by-step path
        rows = self._rows_ahead(sent, answer, batch, anchors, positions, num_drafts, ahead_rows)
        if rows is not None:
            # (its drafts were waited for as the answer was read: on our host if asked then, else by our
            # stream, its waits drained since if the engine asked after; either way the ask is met)
            self._host_waits_next = False
            self.link.drafts_ahead += len(batch.seq_ids)
            self.link.chain_taken_ahead += 1
            self.link.chain_taken_regrouped += sent[0] != batch.seq_ids
            want = tuple((seq_id, num_drafts) for seq_id in sent[0])
        else:
            answer = self._chain_ask(conn, batch, anchors, positions, num_drafts)
            want = tuple((seq_id, num_drafts) for seq_id in batch.seq_ids)
        n = len(batch.seq_ids)
        if answer.in_buffer:
            self._check_rows(conn, answer)
            if answer.in_buffer != want:
                self._disconnect()
                raise DrafterUnavailable("the drafter answered a chained propose for other sequences")
            return self._drafts_in_buffer(conn, n, num_drafts, rows)
        drafts = [answer.proposals.get(seq_id) for seq_id in batch.seq_ids]
        if any(p is None or len(p.tokens) != num_drafts for p in drafts):
            self._disconnect()
            raise DrafterUnavailable("the drafter answered a chained propose without its drafts")
        return torch.tensor([list(p.tokens) for p in drafts], dtype=torch.int64, device=self.device)

    def _chain_ask(self, conn: _Connection, batch: RemoteChainBatch, anchors: torch.Tensor, positions: torch.Tensor,
                   num_drafts: int, tree_keep: int = 0) -> wire.StepResult:
        """A chained propose's Step now, from anchors and positions [B] on the device (with the queued commit and
        settles), and its answer: drafts, or (tree_keep) each row's candidates."""
        self._write_anchors(conn, anchors, positions)
        self._send(conn, [], into_buffer=True, chain=(batch, num_drafts, tree_keep))
        return self._answer(conn, self.step_deadline())

    @property
    def tree_candidates(self) -> bool:
        """Whether the attached drafter answers chained draft-tree candidates, `tree_keep` a row (the engine grows
        trees through it only then)."""
        conn = self._conn
        return conn is not None and not conn.dead and conn.feed is not None and conn.tree_candidates

    def chain_candidates(self, batch: RemoteChainBatch, anchors: torch.Tensor, positions: torch.Tensor,
                         keep: int, into: tuple[torch.Tensor, torch.Tensor] | None = None,
                         ahead_rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A chained step's draft-tree candidates for anchors [B] at positions [B] (on the device): each of the
        drafter's max_drafts block rows' `keep` best log-probabilities and target ids, [B, rows, keep] each on
        our device: those `chain_prefetch` asked for the same (`trees_ahead`), or from one Step now with the
        queued commit and settles. The values are the peer's bytes: the engine clamps the ids, and a NaN score
        ranks last. `into`: float32 and int64 tensors of that shape the candidates are copied into (and
        returned), straight from the drafts buffer where the drafter wrote them there. ahead_rows: as
        `chain_propose`'s (a batch that lost or gained sequences takes those rows of the candidates sent ahead)."""
        if keep != self.tree_keep:
            raise ValueError(f"this drafter connection asks for {self.tree_keep} candidates a row, not {keep}")
        rows = self.spec.max_drafts if self.spec is not None else 0
        n, cut = len(batch.seq_ids), rows * keep
        if into is not None and (len(into) != 2 or into[0].shape != (n, rows, keep) or into[0].dtype != torch.float32
                                 or into[1].shape != (n, rows, keep) or into[1].dtype != torch.int64):
            raise ValueError(f"chained candidates go into float32 and int64 tensors of shape {(n, rows, keep)}")
        if rows and self._take_unanswered(batch, anchors, positions, rows, keep):
            return self._candidates_in_buffer(batch.conn, n, rows, keep, into)
        conn = self._chain_conn(batch)  # (reads an answer still out)
        if not conn.tree_candidates or self.spec is None:
            raise DrafterUnavailable("the attached drafter offers no draft-tree candidates")
        sent, answer = self._chain_ahead, self._chain_ahead_result
        self._chain_ahead = self._chain_ahead_result = None  # (a propose sent ahead for others drafted for nothing)
        self._ahead = self._ahead_result = None
        taken = self._rows_ahead(sent, answer, batch, anchors, positions, rows, ahead_rows, keep)
        if taken is not None:
            self._host_waits_next = False  # (as chain_propose's: the answer was read, its work seen done)
            self.link.drafts_ahead += n
            self.link.chain_taken_ahead += 1
            self.link.chain_taken_regrouped += sent[0] != batch.seq_ids
            want = tuple((seq_id, rows) for seq_id in sent[0])
        else:
            answer = self._chain_ask(conn, batch, anchors, positions, rows, keep)
            want = tuple((seq_id, rows) for seq_id in batch.seq_ids)
        if answer.in_buffer:
            self._check_rows(conn, answer)
            if answer.in_buffer != want or 2 * cut > conn.drafts.tensor.shape[1]:
                self._disconnect()
                raise DrafterUnavailable("the drafter answered a chained tree's candidates for other sequences")
            return self._candidates_in_buffer(conn, n, rows, keep, into, taken)
        else:
            got = [answer.proposals.get(seq_id) for seq_id in batch.seq_ids]
            if any(p is None or len(p.tokens) != cut or p.confidence is None or len(p.confidence) != cut
                   for p in got):
                self._disconnect()
                raise DrafterUnavailable("the drafter answered a chained tree without its candidates")
            ids = torch.tensor([p.tokens for p in got], dtype=torch.int64).to(self.device, non_blocking=True)
            logp = torch.tensor([p.confidence for p in got], dtype=torch.float32).to(self.device, non_blocking=True)
        got = logp.view(n, rows, keep), ids.view(n, rows, keep)
        if into is None:
            return got
        for values, out in zip(got, into):
            out.copy_(values)
        return into

    def _candidates_in_buffer(self, conn: _Connection, n: int, rows: int, keep: int,
                              into: tuple[torch.Tensor, torch.Tensor] | None = None,
                              taken: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n sequences' tree candidates in our drafts buffer (or those of rows `taken`, in that order),
        [n, rows, keep] log-probabilities and ids (the ids, then the log-probabilities' float32 bits), copied on
        our stream (into `into`'s, or new tensors; ordered after the drafter's writes by whoever called), the
        read noted for the next Step that offers the buffer."""
        cut = rows * keep
        view = conn.drafts.tensor
        if taken is None or taken == list(range(n)):
            view = view[:n, :2 * cut]
        else:  # (a gather: the rows' copy, on our stream)
            view = view[device_longs(taken, view.device), :2 * cut]
        ids, logp = view[:, :cut].view(n, rows, keep), view[:, cut:].view(torch.float32).view(n, rows, keep)
        if into is None:
            into = (torch.empty((n, rows, keep), dtype=torch.float32, device=view.device),
                    torch.empty((n, rows, keep), dtype=torch.int64, device=view.device))
        into[0].copy_(logp)
        into[1].copy_(ids)  # (widened as it is copied)
        self._note_read(conn)
        self.link.drafts_on_device += n
        return into

    def _rows_ahead(self, sent, answer: wire.StepResult | None, batch: RemoteChainBatch, anchors: torch.Tensor,
                    positions: torch.Tensor, num_drafts: int, ahead_rows: Sequence[int] | None,
                    tree_keep: int = 0) -> list[int] | None:
        """The rows of the chained propose sent ahead (`sent`, answered by `answer`) that are this one's drafts,
        or None: it was for another connection or k, a verb for one of these sequences was queued since
        (verbs for others ride on the next Step: a sequence's drafts depend on its own state alone), or
        it is neither the same batch on the same feed nor rows of it the engine vouches for (`ahead_rows`; a
        tree's candidates too, `tree_keep`)."""
        if sent is None or answer is None or self._chain_commit is not None \
                or any(seq_id in self._pending for seq_id in batch.seq_ids):
            return None
        ids, k, anchors_key, positions_key, conn, keep = sent
        if conn is not batch.conn or k != num_drafts or keep != tree_keep:
            return None
        n = len(batch.seq_ids)
        if ids == batch.seq_ids and (anchors_key, positions_key) == (_feed_key(anchors), _feed_key(positions)):
            return list(range(n))
        if ahead_rows is None or len(ahead_rows) != n or any(not 0 <= r < len(ids) for r in ahead_rows) \
                or tuple(ids[r] for r in ahead_rows) != batch.seq_ids:
            return None
        return list(ahead_rows)

    def _take_unanswered(self, batch: RemoteChainBatch, anchors: torch.Tensor, positions: torch.Tensor,
                         num_drafts: int, tree_keep: int = 0) -> bool:
        """With device waits: the drafts (or a tree's candidates, `tree_keep`) of the chained propose sent ahead,
        when it is this one, taken before its answer is read: True, and our stream waits for them; the caller
        reads the buffer. Our stream waits for the propose's done value (the drafter's stream writes it
        after the drafts), so the verify is launched now and the answer read after it, by the connection's
        next use (`_live`, from `chain_commit` on): our host no longer waits for the drafter's between two
        steps. The answer is checked then, and one that is not these drafts drops the drafter; the verify
        that read the buffer cost speed, never a token (it is exact, and the engine clamps the ids). False
        where the answer must be read first (no device waits, the engine asked our host to wait, another
        step or buffer, verbs queued since: not a sequence's attach, which changes nothing the propose drafted
        from, its rows staged only as the next Step goes)."""
        conn, n = self._conn, len(batch.seq_ids)
        if self._waits is None or self._host_waits_next or conn is None or conn is not batch.conn or conn.dead \
                or not (self._unanswered and self._unanswered_chain) or self._taken_unanswered is not None \
                or self._chain_commit is not None or any(p.attach is None for p in self._pending.values()) \
                or not conn.offered or not conn.done_sent \
                or self._waits.failure is not None or conn.drafts is None \
                or n > conn.drafts.tensor.shape[0] \
                or num_drafts * (2 * tree_keep if tree_keep else 1) > conn.drafts.tensor.shape[1] \
                or self._chain_ahead != (batch.seq_ids, num_drafts, _feed_key(anchors), _feed_key(positions), conn,
                                         tree_keep):
            return False
        left = max(STEP_DEADLINE_FLOOR, conn.sent_at + self.step_deadline() - time.perf_counter())
        self._waits.wait(conn.done_flags[0], conn.done_sent, time.perf_counter() + left)  # before the caller's read
        self._chain_ahead = None
        self._ahead = self._ahead_result = None  # (as chain_propose drops a step-by-step prefetch's)
        self._taken_unanswered = tuple((seq_id, num_drafts) for seq_id in batch.seq_ids)
        self.link.device_waits += 1
        self.link.drafts_ahead += n
        self.link.chain_taken_ahead += 1
        self.link.taken_unanswered += 1
        return True

    def _drafts_in_buffer(self, conn: _Connection, n: int, num_drafts: int, rows: list[int] | None = None) -> torch.Tensor:
        """A copy of the first n rows' drafts in our drafts buffer (or of `rows`, in that order), queued on our
        stream (ordered after the drafter's writes by whoever called), the read noted for the next Step
        that offers the buffer."""
        view = conn.drafts.tensor
        if rows is None or rows == list(range(n)):
            tokens = view[:n, :num_drafts].clone()
        else:
            tokens = view[device_longs(rows, view.device), :num_drafts]
        self._note_read(conn)
        self.link.drafts_on_device += n
        return tokens

    def chain_settle(self, seq_ids: Sequence[int], counts: Sequence[int]) -> None:
        """A chained step read: the drafter's positions of `seq_ids` advance by `counts` (sent with the next Step)."""
        ids, rows = self._settles
        if any(seq_id in ids for seq_id in seq_ids):  # two steps' settles of one sequence: the first goes first,
            self._live()  # (after any answer still out)
            self.send_pending()  # answered later: the host goes on reading the step
            ids, rows = self._settles
        ids.extend(seq_ids)
        rows.extend(int(c) for c in counts)

    def _chain_conn(self, batch: RemoteChainBatch) -> _Connection:
        conn = self._live()  # reads an answer still out: our buffers are ours to write again
        if conn is not batch.conn:
            raise DrafterUnavailable("the drafter re-attached since this chained step's batch was made")
        return conn

    @staticmethod
    def _write_feed(conn: _Connection, row: int | slice, values: torch.Tensor) -> None:
        """values [n] into the feed's row `row`, or [rows, n] into its rows `row` (a slice)."""
        if conn.feed_fresh:
            conn.feed.bump()
            conn.feed_fresh = False
        conn.feed.tensor[row, :values.shape[-1]].copy_(values)

    @classmethod
    def _write_anchors(cls, conn: _Connection, anchors: torch.Tensor, positions: torch.Tensor) -> None:
        """Anchors and positions [B] into the feed's rows 1 and 2: one copy where they are rows of one tensor (the
        engine's [2, B] feed, as a chained step leaves it), two otherwise."""
        pair = _rows_of_one(anchors, positions)
        if pair is None:
            cls._write_feed(conn, 1, anchors)
            cls._write_feed(conn, 2, positions)
            return
        cls._write_feed(conn, slice(1, 3), pair)

    def _chain_part(self, conn: _Connection,
                    propose: tuple[RemoteChainBatch, int, int] | None) -> wire.ChainStep | None:
        """What the next Step carries of chained steps: the settles and commit queued, and `propose`."""
        settle_ids, settle_counts = self._settles
        commit = self._chain_commit
        if not settle_ids and commit is None and propose is None:
            conn.done_sent = 0
            return None
        self._settles, self._chain_commit = ([], []), None
        feed = None
        if commit is not None or propose is not None:
            if not conn.feed_fresh:
                conn.feed.record()
                conn.feed_fresh = True
            feed = conn.feed.ref(0, FEED_ROWS)
        commit_ids, count, offset = commit if commit is not None else ((), 0, 0)
        rows = conn.step.buffer.ref(offset, len(commit_ids) * count) if commit is not None else None
        batch, num_drafts, tree_keep = propose if propose is not None else (None, 0, 0)
        done_buffer = done_value = written_value = written_buffer = 0
        if batch is not None and conn.done is not None:  # (our stream will wait for this value, not our host)
            conn.done_value = done_value = next_value(conn.done_value)
            done_buffer = conn.done_id
            if len(conn.done_flags) > 1:
                # The drafter's stream may wait for this one instead of its host for our events: written
                # by our stream after every write this step reads (the rows sealed, the feed recorded above)
                conn.written_value = written_value = next_value(conn.written_value)
                _write_on_stream(conn.done_flags[1], written_value)
                written_buffer = conn.written.buffer_id if conn.written is not None else 0
        conn.done_sent = done_value
        return wire.ChainStep(tuple(settle_ids), tuple(settle_counts), commit_ids, count, rows, feed,
                              batch.seq_ids if batch is not None else (), batch.ahead if batch is not None else (),
                              num_drafts, done_buffer, done_value, written_value, written_buffer, tree_keep)

    def take_kv(self, seq_id: int) -> CarriedKV:
        self._flush([])
        pb = self._unary("TakeDrafterKV", drafter_pb2.TakeDrafterKVRequest(seq_id=seq_id))
        return wire.carried_kv_from_proto(pb)

    def install_kv(self, seq_id: int, handle: int) -> CarriedKV:
        self._send_queued(seq_id)
        pb = self._unary("InstallDrafterKV", drafter_pb2.InstallDrafterKVRequest(seq_id=seq_id, handle=handle))
        return wire.carried_kv_from_proto(pb)

    def free_kv(self, handle: int) -> None:
        self._unary("FreeDrafterKV", drafter_pb2.FreeDrafterKVRequest(handle=handle))

    # ---- the Step message ---------------------------------------------------------------------------

    def send_pending(self) -> None:
        """Send the queued verbs now and read their answer later, before anything else uses the
        connection (a step that proposes nothing: the drafter applies its commits while the target
        verifies, and the round trip leaves the step). The staged rows the message references are not
        written again before the answer is read: staging goes through the connection too."""
        if not (self._pending or self._chain_commit is not None or self._settles[0]) or self._unanswered:
            return
        conn = self._live()
        self._send(conn, [])
        self._unanswered = True
        self.link.sent_ahead += 1

    def _flush(self, proposes: list[ProposeRequest], timeout: float | None = None) -> wire.StepResult:
        conn = self._live()
        self._send(conn, proposes)
        return self._answer(conn, timeout or self.step_deadline())

    def _send(self, conn: _Connection, proposes: list[ProposeRequest], *, into_buffer: bool = False,
              chain: tuple[RemoteChainBatch, int, int] | None = None) -> None:
        """into_buffer: the drafts may come in the connection's drafts buffer (StepRequest.drafts_buffer);
        chain: a chained propose (batch, drafts, tree_keep: 0, or its rows' candidates a draft tree wants)
        instead of `proposes`. The queued chained settles and commit go with any Step."""
        self._send_alloc(conn)  # (an allocation left for a prefill goes before anything naming the sequence)
        conn.step.seal()
        attaches = self._stage_attaches(conn)
        self._step_id += 1
        # A verify's stash + commit + trim of rows in the step buffer (the usual entry) goes straight into
        # the message's columns; anything else travels as a SeqStep.
        fast = conn.columns and conn.step.buffer is not None
        verified = {seq_id: p for seq_id, p in self._pending.items() if fast and p.verified_only()}
        # (attaches last: a free in this Step may make the room one needs)
        others = [self._seq_step(conn, seq_id, p) for seq_id, p in self._pending.items()
                  if seq_id not in verified and seq_id not in attaches]
        others += [wire.SeqStep(seq_id, catchup=op, alloc=self._pending[seq_id].attach[0])
                   for seq_id, op in attaches.items()]
        conn.offered = into_buffer and conn.drafts is not None and (bool(proposes) or chain is not None)
        # A chained propose sent ahead is taken only as the next Step's: any other Step sent after it may
        # change what it drafted from or overwrite its drafts (chain_prefetch sets it again after its own)
        self._chain_ahead = self._chain_ahead_result = None
        # A chained propose whose feed is recorded with this Step (after our last read of the drafts, on the
        # same stream) needs no wait here: the drafter writes drafts only once it has seen the feed's event
        # done. With device waits the read is behind the drafter's own work, so this wait would hold our
        # host for the drafter's GPU.
        ordered_by_feed = chain is not None and conn.done is not None and not conn.feed_fresh
        if conn.offered and conn.drafts_read is not None and not ordered_by_feed:
            conn.drafts_read.synchronize()  # the drafter may now overwrite what we read last (done by now, mostly)
        batch = wire.StepBatch(self._step_id, tuple(others), tuple(proposes), draft_columns=conn.columns,
                               drafts_buffer=conn.drafts.buffer_id if conn.offered else 0,
                               chain=self._chain_part(conn, chain) if conn.feed is not None else None)
        self._pending = {}
        conn.attaching = tuple(attaches)
        for seq_id in attaches:
            self._attaches[seq_id] = _SENT
        pb = wire.step_to_proto(batch, columns=conn.columns)
        if verified:
            _add_verified_columns(pb, conn.step.buffer, verified)
        conn.sent_at = time.perf_counter()
        if conn.sock is None:
            conn.outbox.put(pb)
            return
        try:
            conn.sock.settimeout(self.timeout)
            frames.send_frame(conn.sock, pb.SerializeToString())
        except OSError as exc:  # the drafter went away (or stopped reading for --drafter-timeout)
            self._disconnect()
            raise DrafterUnavailable(f"the drafter's step socket: {exc}") from None

    def _answer(self, conn: _Connection, timeout: float, *, timed: bool = True, waited: bool = False,
                keep_host_wait: bool = False) -> wire.StepResult:
        """The answer to the Step sent last; its errors drop the connection and raise. waited: its drafts
        were taken already, behind our stream's wait for its done value (`_take_unanswered`);
        keep_host_wait: its drafts wait on our host if the engine asked (wait_on_host_next), and the ask
        stands for the drafts used next."""
        result = self._receive(conn, timeout)
        if result.in_buffer and not waited:
            if not conn.offered:
                self._disconnect()
                raise DrafterUnavailable("the drafter answered drafts in a buffer the step did not offer")
            # Everything we queue from now on (the verify reading the drafts, the next rows written into
            # the buffers the drafter read this step) comes after the drafter's work for this step: the
            # host sees it done first. No stream of ours waits on the drafter's event (a drafter whose
            # queued work never ends would stall it); one that is not done within the step's deadline
            # is given up on.
            # The wait counts from the Step's sending, like the answer's (an answer read late, after a
            # prefetch, still gets STEP_DEADLINE_FLOOR).
            left = max(STEP_DEADLINE_FLOOR, conn.sent_at + timeout - time.perf_counter())
            on_host = self._host_waits_next
            self._host_waits_next = self._host_waits_next and keep_host_wait
            self.link.host_waits += bool(on_host and conn.done_sent and self._waits is not None)
            if conn.done_sent and self._waits is not None and not on_host:
                # Our stream waits for the drafter's done value instead (written after its drafts, before
                # its event), released by us at the deadline if it never comes (shared.device_waits)
                self._waits.wait(conn.done_flags[0], conn.done_sent, time.perf_counter() + left)
                self.link.device_waits += 1
            elif not _importer_done(conn.drafts, left):
                self._disconnect()
                raise DrafterUnavailable(f"the drafter's writes into the drafts buffer were not done "
                                         f"{time.perf_counter() - conn.sent_at:.1f} s after the step was sent")
        seconds = time.perf_counter() - conn.sent_at
        self.link.answer_seconds.append(seconds)
        if timed:  # round trips the step waited for (send_pending's and prefetch's overlap other work)
            self.link.step_seconds.append(seconds)
        errors = result.errors
        if conn.attaching:  # (a refused attach is the sequence's alone)
            sent, conn.attaching = conn.attaching, ()
            errors = self._settle_attaches(conn, sent, errors)
        if errors:
            # The drafter's state for this client no longer matches the target's: drop the connection
            # (the drafter frees the session) and let the engine re-attach from scratch after backoff.
            self._disconnect()
            raise errors[0].exception()
        return result

    @staticmethod
    def _seq_step(conn: _Connection, seq_id: int, p: _Pending) -> wire.SeqStep:
        catchup = None
        if p.catchup is not None:
            tokens, staged, rows, base_pos = p.catchup
            catchup = wire.RowsOp(tokens, conn.step.source(staged, rows), base_pos)
        stash = conn.step.source(*p.stash) if p.stash is not None else None
        return wire.SeqStep(seq_id, catchup=catchup, stash=stash, commit=p.commit, trim=p.trim, free=p.free)

    def wait_on_host_next(self) -> None:
        """The next drafts answered in our buffer are waited for by our host, not our stream (device waits):
        the engine runs work after them that may launch a kernel for the first time (Engine._quiesce)."""
        self._host_waits_next = True

    @property
    def waits_on_device(self) -> bool:
        """Whether our stream waits on the device for this connection's chained drafts (device waits)."""
        conn = self._conn
        return conn is not None and conn.done is not None

    @property
    def waits_outlive_loads(self) -> bool:
        """Whether our stream's device waits are on the host page (released by our CPU's stores, which get
        through a kernel module's load, where a stream write into device memory does not)."""
        conn = self._conn
        return self._waits is not None and conn is not None and conn.page is not None and conn.done is conn.page

    def drain_waits(self) -> None:
        """Return once our stream waits on the device for no drafts (device waits), before the engine
        launches work that may load a kernel module (Engine._quiesce): a module's load waits for the whole
        context, and the watchdog's release of a drafter that never writes could not get through then. A
        wait still pending past the timeout (the watchdog releases each at its deadline before that) drops
        the drafter (DrafterUnavailable)."""
        waits = self._waits
        if waits is None or not waits.pending:
            return
        if not waits.drain(self.timeout + STEP_DEADLINE_FLOOR):
            self._disconnect()
            raise DrafterUnavailable("our stream's waits for the drafter's drafts were not done past their deadline")

    def step_deadline(self) -> float:
        """Seconds the next Step answer may take (see STEP_DEADLINE_FACTOR): a drafter that stopped
        answering is given up on after a few of its usual step times, not after --drafter-timeout."""
        recent = list(itertools.islice(reversed(self.link.answer_seconds), STEP_DEADLINE_SAMPLES))
        if len(recent) < STEP_DEADLINE_MIN_SAMPLES:
            return self.timeout
        if STEP_DEADLINE_FACTOR * max(recent) <= STEP_DEADLINE_FLOOR:  # (the usual case, asked every step: no sort)
            return min(self.timeout, STEP_DEADLINE_FLOOR)
        recent.sort()
        p99 = recent[min(len(recent) - 1, int(0.99 * len(recent)))]
        return min(self.timeout, max(STEP_DEADLINE_FLOOR, STEP_DEADLINE_FACTOR * p99))

    def _receive(self, conn: _Connection, timeout: float) -> wire.StepResult:
        if conn.sock is not None:
            pb = self._receive_frame(conn, timeout)
        else:
            pb = self._receive_message(conn, timeout)
        result = wire.step_result_from_proto(pb)
        if result.step_id != self._step_id:
            self._disconnect()
            raise DrafterUnavailable(f"step answers out of order ({result.step_id} != {self._step_id})")
        return result

    def _receive_frame(self, conn: _Connection, timeout: float) -> drafter_pb2.StepResponse:
        """The next answer on the step socket; its end, its silence past `timeout`, or bytes that are
        not an answer drop the connection and raise."""
        try:
            conn.sock.settimeout(timeout)
            payload = frames.recv_frame(conn.sock, ANSWER_FRAME_BYTES)
            if payload[:1] == bytes([frames.ANSWER]):
                return drafter_pb2.StepResponse.FromString(payload[1:])
        except socket.timeout:
            self._disconnect()
            self.link.answer_seconds.append(timeout)  # as _receive_message counts an overdue answer
            raise DrafterUnavailable(f"no step answer within {timeout:.1f} s") from None
        except (OSError, EOFError, SpecsplitError, DecodeError) as exc:
            self._disconnect()
            raise DrafterUnavailable(f"the drafter's step socket: {exc}") from None
        self._disconnect()
        if payload[:1] == bytes([frames.ENDED]):
            code, message = frames.parse_ended(payload)
            raise wire.error_from_status(code, f"drafter {code}: {message}")
        raise DrafterUnavailable("the drafter's step socket sent a frame of no known kind")

    def _receive_message(self, conn: _Connection, timeout: float) -> drafter_pb2.StepResponse:
        conn.due = time.monotonic() + timeout
        try:
            pb = next(conn.responses)
        except (grpc.RpcError, StopIteration) as exc:
            self._disconnect()
            if conn.overdue:
                # Counted as a round trip: a drafter that has become slower for good raises its own deadline
                # after a few misses instead of being detached and re-attached at every step.
                self.link.answer_seconds.append(timeout)
                raise DrafterUnavailable(f"no step answer within {timeout:.1f} s") from None
            if isinstance(exc, grpc.RpcError):
                raise _error_from_rpc(exc) from None
            raise DrafterUnavailable("the drafter closed the step stream") from None
        finally:
            conn.due = 0.0
        return pb
