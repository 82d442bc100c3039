"""The drafter gRPC service: DrafterService over one shared drafter, a Session per connected target.

Each handler only converts (protobuf → domain object → Session call → protobuf); exceptions become
status codes in one place (`shared.status.rpc_errors`). A target identifies itself with the
`x-specsplit-client` metadata on every call; its Session lives until its Step stream ends (or
`DrafterServer.close`), and then everything it held is freed. Nothing proves a caller is a target, so
what connections may hold is capped (`DrafterLimits`), a connection without a Step stream is freed
once idle, by a reaper thread, whether or not anyone else calls, and a Step stream that does no work
gives its slot to a newcomer once the drafter is full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Protocol

import grpc
import torch

from specsplit.drafter_service.heads import TargetHead
from specsplit.drafter_service.limits import DrafterLimits
from specsplit.drafter_service.metrics import DrafterMetrics
from specsplit.drafter_service.session import (CHAIN_CAPTURE_AFTER, Session, buffers_read, chains, done_flags,
                                               served_tree_keep)
from specsplit.drafter_service.step_socket import StepSocketServer
from specsplit.protos.v1 import drafter_pb2, drafter_pb2_grpc
from specsplit.shared import logs, wire
from specsplit.shared.errors import AlreadyExists, CapacityExceeded, DrafterUnavailable, InvalidRequest, WritesPending
from specsplit.shared.metrics import MetricsAddress
from specsplit.shared.profiling import StepWindow
from specsplit.shared.proposer import Proposer
from specsplit.shared.device_waits import DeviceWaits
from specsplit.shared.host_flags import HostPage
from specsplit.shared.security import ServerSecurity, grpc_target, is_unix
from specsplit.shared.serving import CLIENT_HEADER, INSTANCE_HEADER, SPARE_THREADS, Served, start_server
from specsplit.shared.status import Throttle, rpc_errors
from specsplit.shared.stream_ops import stream_ops
from specsplit.shared.transport import device_uuid, host_id, identity_digest

__all__ = ["CLIENT_HEADER", "SERVICE_NAME", "DrafterLimits", "DrafterServer", "serve"]
log = logging.getLogger(__name__)
SERVICE_NAME = "specsplit.v1.DrafterService"
_evictions = Throttle(per_minute=6)  # a caller inventing client ids at will must not flood the log


def client_id(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_HEADER and value:
            client = value if isinstance(value, str) else value.decode()
            logs.set_fields(client_id=client)  # on this call's log lines (shared.logs)
            return client
    raise InvalidRequest(f"every call needs the {CLIENT_HEADER!r} metadata naming the connecting target")


def _until_cancelled(requests: Iterator, context: grpc.ServicerContext) -> Iterator:
    """The request stream; a client that goes away ends it like a clean close (no error to report)."""
    try:
        yield from requests
    except grpc.RpcError:
        if context.is_active():
            raise


class Cancellable(Protocol):
    def cancel(self) -> object: ...


@dataclasses.dataclass
class _Stream:
    """An open Step stream: its call (gRPC's, or the step socket's connection: `cancel()` ends it if
    evicted) and when it last carried work."""

    call: grpc.ServicerContext | Cancellable
    last_work: float = dataclasses.field(default_factory=time.monotonic)


class DrafterServer(drafter_pb2_grpc.DrafterServiceServicer):
    """DrafterService over `proposer`, shared by every connected target.

    `head` is the target head to use for clients that register none (loaded from the target checkpoint);
    `device` is where the drafter runs (inline rows are decoded there). `limits`, with any field
    overridden by keyword (`max_targets=1`), caps what callers may hold.
    """

    def __init__(self, proposer: Proposer, *, head: TargetHead | None, device: torch.device | str,
                 limits: DrafterLimits = DrafterLimits(), **overrides) -> None:
        self.limits = dataclasses.replace(limits, **overrides)
        self.proposer = proposer
        self.max_targets = self.limits.max_targets  # open Step streams; each holds a server thread
        self.head = head
        self.device = torch.device(device)
        self._lock = threading.RLock()  # one drafter, one GPU stream: every call is serialized
        self._sessions: dict[str, Session] = {}
        self._streams: dict[str, _Stream] = {}  # client id → its open Step stream
        self._seq_ids = itertools.count()
        self._closed = threading.Event()
        self.step_socket = ""  # where the Step stream is also served without gRPC (serve sets it)
        self.chain_graphs = True  # chained steps' commit and propose as one CUDA graph each (--no-chain-graphs: off)
        self.chain_capture_after = CHAIN_CAPTURE_AFTER  # ... once a shape has run this many times (--chain-capture-after)
        self.prepare_chains = True  # chained steps' host work before the target's writes (Session.prepare_chain)
        self.prefill_copies = False  # a prefill's CUDA IPC rows copied out at once (--prefill-copies, Session.prefill)
        # --device-waits: a prepared chained step's graph launched at once, our stream waiting on the device for
        # the target's written value (ChainStep.written_value) instead of our host for its events. Only for a
        # drafter serving one target: a target whose value never comes blocks the stream (every session's
        # GPU work) until --writes-wait-seconds, when the watchdog releases it and that target's stream ends.
        self.device_waits = False
        self.take_pages = True  # a target's DONE page in host memory, passed with its Step socket hello (host_flags)
        self.instance = secrets.token_hex(16)  # this process, for targets to send back (Describe.instance)
        self.profile: StepWindow | None = None  # a window of Step messages to profile (--profile-steps)
        self.metrics = DrafterMetrics(functools.partial(_sessions_now, weakref.ref(self)))
        threading.Thread(target=_reap_idle, args=(weakref.ref(self), self._closed, self.limits.idle_seconds),
                         name="drafter-idle-reaper", daemon=True).start()

    @property
    def written_flags(self) -> bool:
        """Whether Step streams' sessions wait on the device for the target's written values (see
        `device_waits`; DrafterDescription.written_flags)."""
        return self.device_waits and self.prepare_chains and self.chain_graphs and self.max_targets == 1 \
            and chains(self.proposer) and done_flags(self.device)

    @property
    def host_flags(self) -> bool:
        """Whether a target may pass its DONE page with the Step socket's hello (DrafterDescription.host_flags;
        `take_pages`: --no-host-flags turns it off)."""
        return self.take_pages and bool(self.step_socket) and chains(self.proposer) and done_flags(self.device)

    def adopt_page(self, fd: int) -> HostPage:
        """The DONE page a Step socket hello passed, checked, mapped and registered (InvalidRequest, the
        descriptor closed, when it is not one or this drafter takes none)."""
        if not self.host_flags:
            os.close(fd)
            raise InvalidRequest("this drafter takes no DONE page with the step socket hello "
                                 "(DrafterDescription.host_flags)")
        return HostPage.adopt(fd, self.device)

    def _quiesce(self, but: Session | None = None) -> None:
        """Under the lock, before any work but a prepared launch: wait until no session's stream waits on the
        device (--device-waits). Such work may load a kernel module, which waits for the whole context: a
        stream waiting for a target's value would hold it, and the watchdog's release could not get through,
        so a target that never writes would hang the process (README, "Device waits"). A target that writes
        holds this up for the rest of its verify; one that does not, until its deadline (the release).
        `but`: a session about to release its own waits (closing). WritesPending if they are not done even
        then (the release refused)."""
        for session in list(self._sessions.values()):
            if session is not but and session.waits is not None and session.waits.pending \
                    and not session.waits.drain(self.limits.writes_wait_seconds + 5.0):
                log.warning("client %s's device waits were not done past their deadline", session.client_id,
                            extra=logs.fields(client_id=session.client_id))
                raise WritesPending("a target's device waits on this drafter were not done past their deadline")

    # ---- sessions -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self, context: grpc.ServicerContext) -> Iterator[Session]:
        """The caller's session (created on first use), held under the drafter lock."""
        client = client_id(context)
        self._check_instance(context)
        with self._lock:
            self._quiesce()
            self._sweep_idle()
            session = self._get_or_create(client)
            session.check_waits()  # (fails this call; the stream ends at its next Step)
            session.turns += 1
            session.last_call = time.monotonic()
            if client in self._streams:
                self._streams[client].last_work = session.last_call
            yield session

    def _await_writes(self, context: grpc.ServicerContext, steps=(), *, head: bool = False) -> None:
        """Before a unary call that reads the caller's CUDA buffers (the rows of `steps`, its head with
        `head`), poll for the target's writes into them, outside the drafter lock (Session.await_writes)."""
        session = self._sessions.get(client_id(context))  # one dict read: the call itself runs under the lock
        if session is not None and not session.closed:
            session.await_writes(buffers_read(steps), head=head, stop=lambda: not context.is_active())

    def _check_instance(self, context: grpc.ServicerContext) -> None:
        """A call that names a drafter process (INSTANCE_HEADER) must name this one: a target's connection
        to a drafter that has since restarted at this address is over, not a new session here."""
        for key, value in context.invocation_metadata() or ():
            if key == INSTANCE_HEADER:
                if (value if isinstance(value, str) else value.decode()) != self.instance:
                    raise DrafterUnavailable("the drafter this connection attached to has restarted; attach again")
                return

    def _sweep_idle(self) -> None:
        """Free connections without a Step stream and no call for idle_seconds (a target that died
        between registering buffers and opening its stream, or a one-off caller)."""
        now = time.monotonic()
        for session in list(self._sessions.values()):
            if not session.streaming and now - session.last_call > self.limits.idle_seconds:
                log.info("client %s made no call for %.0f s and has no Step stream: freeing it",
                         session.client_id, now - session.last_call, extra=logs.fields(client_id=session.client_id))
                self._end(session)

    def _get_or_create(self, client: str, *, streaming: bool = False) -> Session:
        session = self._sessions.get(client)
        if session is None:
            if not streaming:
                self._make_room_for_a_session()
            session = Session(self.proposer, client_id=client, new_seq_id=lambda: next(self._seq_ids),
                              head=self.head, device=self.device, limits=self.limits, chain_graphs=self.chain_graphs,
                              on_chain_graph=self.metrics.chain_graph_step, prefill_copies=self.prefill_copies,
                              chain_capture_after=self.chain_capture_after)
            self._sessions[client] = session
        return session

    def _make_room_for_a_session(self) -> None:
        """At --max-sessions connections without a Step stream, the least recently used one is freed:
        refusing instead would let a stranger who keeps calling lock every new target out."""
        idle = [s for s in self._sessions.values() if not s.streaming]
        if len(idle) >= self.limits.max_sessions:
            oldest = min(idle, key=lambda s: s.last_call)
            skipped = _evictions.admit()
            if skipped is not None:
                log.info("client %s, without a Step stream, is the least recently used of %d (--max-sessions): "
                         "freeing it%s", oldest.client_id, len(idle), f" ({skipped} more not logged)" if skipped else "",
                         extra=logs.fields(client_id=oldest.client_id))
            self._end(oldest, quiet=True)

    def _end(self, session: Session, *, quiet: bool = False) -> None:
        """Free everything the session holds (idempotent; called when its Step stream ends)."""
        with self._lock:
            try:
                if not session.closed:
                    self._quiesce(but=session)
            except Exception as exc:  # noqa: BLE001 - a session is freed whatever another's waits do
                log.warning("freeing client %s while another's device waits are not done (%s)", session.client_id,
                            exc, extra=logs.fields(client_id=session.client_id))
            if self._sessions.get(session.client_id) is session:
                del self._sessions[session.client_id]
            if not session.closed and not quiet:
                log.info("client %s disconnected: freeing %d sequences", session.client_id, session.num_sequences,
                         extra=logs.fields(client_id=session.client_id))
            session.close()

    def close(self) -> None:
        """Free every session's sequences, carried KVs and buffer mappings."""
        self._closed.set()
        with self._lock:
            for session in list(self._sessions.values()):
                self._end(session)

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    @property
    def num_streams(self) -> int:
        """Targets connected now: sessions with an open Step stream."""
        with self._lock:
            return sum(s.streaming for s in self._sessions.values())

    # ---- description and buffers ----------------------------------------------------------------

    @rpc_errors
    def Describe(self, request, context):
        # Host and GPU identities are answered salted with the caller's own client id: a target on the
        # same host (and GPU) computes the same digests; anyone else learns nothing it can reuse.
        client = client_id(context)
        description = wire.DrafterDescription(
            spec=self.proposer.spec, host_id=identity_digest(client, host_id()),
            device_uuid=identity_digest(client, device_uuid(self.device)),
            needs_target_head=self.head is None, step_columns=True, step_socket=self.step_socket,
            drafts_buffer=True, instance=self.instance, chains=chains(self.proposer),
            done_flags=chains(self.proposer) and done_flags(self.device), written_flags=self.written_flags,
            prefill_allocs=True, host_flags=self.host_flags, tree_keep=served_tree_keep(self.proposer),
            step_attach=True,
        )
        return wire.description_to_proto(description)

    @rpc_errors
    def RegisterBuffers(self, request, context):
        descriptors = [wire.descriptor_from_proto(d) for d in request.buffers]
        with self._session(context) as session:
            session.register(descriptors)
        return drafter_pb2.RegisterBuffersResponse()

    @rpc_errors
    def ReleaseBuffers(self, request, context):
        with self._session(context) as session:
            session.release(request.buffer_ids)
        return drafter_pb2.ReleaseBuffersResponse()

    # ---- sequences ------------------------------------------------------------------------------

    @rpc_errors
    def AllocState(self, request, context):
        seq_id, budget_tokens = wire.alloc_from_proto(request)
        with self._session(context) as session:
            session.alloc(seq_id, budget_tokens)
        return drafter_pb2.AllocStateResponse()

    @rpc_errors
    def PrefillDrafter(self, request, context):
        started = time.perf_counter()
        seq_id, op, budget = wire.prefill_from_proto(request)
        self._await_writes(context, [wire.SeqStep(seq_id, catchup=op)])
        ready = time.perf_counter()
        with self._session(context) as session:
            locked = time.perf_counter()
            if budget is not None:  # attached in one round trip: allocated here, freed again if the prefill fails
                session.alloc(seq_id, budget)
            allocated = time.perf_counter()
            try:
                appended = session.prefill(seq_id, op)
            except BaseException:
                if budget is not None:
                    try:
                        session.free(seq_id)
                    except Exception as exc:  # noqa: BLE001 - the prefill's error is the one to answer
                        log.warning("client %s: freeing sequence %d after its refused prefill failed (%s: %s)",
                                    session.client_id, seq_id, type(exc).__name__, exc,
                                    extra=logs.fields(client_id=session.client_id))
                raise
            phases = session.last_prefill
        self.metrics.prefilled({"ready": ready - started, "lock": locked - ready, "alloc": allocated - locked,
                                "rows": phases.rows, "context": phases.context, "wait": phases.wait})
        return drafter_pb2.PrefillDrafterResponse(rows_appended=appended)

    @rpc_errors
    def Propose(self, request, context):
        requests = wire.propose_from_proto(request)
        self._await_writes(context, head=True)
        with self._session(context) as session:
            proposals = session.propose(requests)
        self.metrics.proposed(proposals)
        return wire.proposals_to_proto(requests, proposals)

    def _apply(self, request, context) -> int:
        """The unary twins of a SeqStep go through the same applier as the Step stream."""
        step = wire.unary_to_seq_step(request)
        self._await_writes(context, [step])
        with self._session(context) as session:
            return session.apply(step)

    @rpc_errors
    def FreeState(self, request, context):
        self._apply(request, context)
        return drafter_pb2.FreeStateResponse()

    @rpc_errors
    def Stash(self, request, context):
        self._apply(request, context)
        return drafter_pb2.StashResponse()

    @rpc_errors
    def Commit(self, request, context):
        self._apply(request, context)
        return drafter_pb2.CommitResponse()

    @rpc_errors
    def Trim(self, request, context):
        self._apply(request, context)
        return drafter_pb2.TrimResponse()

    @rpc_errors
    def Catchup(self, request, context):
        return drafter_pb2.CatchupResponse(rows_appended=self._apply(request, context))

    # ---- carried KV -----------------------------------------------------------------------------

    @rpc_errors
    def TakeDrafterKV(self, request, context):
        with self._session(context) as session:
            return wire.carried_kv_to_proto(session.take_kv(request.seq_id))

    @rpc_errors
    def InstallDrafterKV(self, request, context):
        with self._session(context) as session:
            return wire.carried_kv_to_proto(session.install_kv(request.seq_id, request.handle))

    @rpc_errors
    def FreeDrafterKV(self, request, context):
        with self._session(context) as session:
            session.free_kv(request.handle)
        return drafter_pb2.FreeDrafterKVResponse()

    # ---- the step stream ------------------------------------------------------------------------

    @rpc_errors
    def Step(self, request_iterator, context):
        client = client_id(context)
        self._check_instance(context)
        session, stream = self.open_stream(client, context)
        context.add_callback(lambda: self.end_stream(session, stream))
        try:
            for request in _until_cancelled(request_iterator, context):
                answer = self.step_once(session, stream, request)
                if answer is None:
                    return
                yield answer
        finally:
            self.end_stream(session, stream)

    def step_once(self, session: Session, stream: "_Stream", request) -> drafter_pb2.StepResponse | None:
        """One Step message of an open stream (gRPC's or the step socket's); None: the session has
        ended (evicted, or the server closed) and so has the stream."""
        window = self.profile
        number = window.enter() if window is not None else 0
        try:
            return self._step_once(session, stream, request)
        finally:
            if window is not None:
                window.exit(number)

    def _step_once(self, session: Session, stream: "_Stream", request) -> drafter_pb2.StepResponse | None:
        started = time.perf_counter()
        batch, errors = wire.step_from_proto(request)
        parsed = time.perf_counter()
        working = bool(batch.seqs or batch.verified or batch.proposes or batch.register or batch.release
                       or (batch.chain is not None and not batch.chain.empty))
        if working:
            stream.last_work = time.monotonic()  # now: a stream waiting for its writes is not idle
        if batch.register:  # mapped first, so that the wait below covers rows in them
            with self._lock:
                if session.closed:
                    return None
                session.turns += 1
                self._quiesce()
                session.check_waits()
                session.register(batch.register)
            batch = dataclasses.replace(batch, register=())
        launch = None
        if batch.chain is not None and self.prepare_chains:  # sent ahead: its host work now, while the target verifies
            with self._lock:
                if session.closed:
                    return None
                session.turns += 1
                launch = session.prepare_chain(batch) if not errors else None
        prepared = time.perf_counter()
        # The target's GPU writes into the buffers this step reads, awaited here, outside the lock: a
        # target whose writes never finish ends its own stream (WritesPending), no one else waits. (A
        # launch whose stream waits for them on the device instead is called at once.)
        # (with two launches already queued behind waits the host waits too: a target that never writes may
        # not queue launches without end)
        if launch is None or not launch.device_waited or session.waits.pending > 1:
            session.await_writes(buffers_read(batch.seqs, batch.verified, batch.chain),
                                 head=bool(batch.proposes or (batch.chain is not None
                                                              and (batch.chain.seq_ids or batch.chain.commit_seq_ids))))
        ready = time.perf_counter()
        with self._lock:
            locked = time.perf_counter()
            if session.closed:  # evicted, or the server closed, while this message was read
                return None
            if working:  # again, after the wait
                stream.last_work = time.monotonic()
            if launch is not None:
                result = launch()
            else:
                session.turns += 1
                self._quiesce()
                session.check_waits()  # (a released wait ends the stream, whatever comes next)
                result = session.step(batch, errors)
            phases = session.last_phases
        stepped = time.perf_counter()
        answer = wire.step_result_to_proto(result, columns=batch.draft_columns)
        done = time.perf_counter()
        attaching = [s.seq_id for s in batch.seqs if s.alloc is not None]
        if attaching:
            refused = {e.seq_id for e in result.errors}
            attaching = [seq_id for seq_id in attaching if seq_id not in refused]
        self.metrics.answered(result, done - started, attached=len(attaching), phases={
            "parse": parsed - started, "ready": ready - prepared, "lock": locked - ready, "commit": phases.commit,
            "rows": phases.rows,
            "context": phases.context, "propose": phases.propose, "replay": phases.replay, "wait": phases.wait,
            "encode": done - stepped})
        return answer

    def end_stream(self, session: Session, stream: _Stream) -> None:
        with self._lock:
            if self._streams.get(session.client_id) is stream:
                del self._streams[session.client_id]
            self._end(session)

    def open_stream(self, client: str, call: grpc.ServicerContext | Cancellable, *,
                    page: HostPage | None = None) -> tuple[Session, _Stream]:
        """A Step stream for `client`, or CapacityExceeded at --max-targets (after reclaiming a quiet one).
        `page`: the DONE page its hello passed, the session's from now on (closed here if refused)."""
        try:
            return self._open_stream(client, call, page)
        except BaseException:
            if page is not None:
                page.close()  # (idempotent: closed already if the session refused it)
            raise

    def _open_stream(self, client: str, call: grpc.ServicerContext | Cancellable,
                     page: HostPage | None) -> tuple[Session, _Stream]:
        with self._lock:
            self._sweep_idle()
            session = self._sessions.get(client)
            if session is not None and session.streaming:
                raise AlreadyExists(f"client {client} already has an open Step stream")
            if self.num_streams >= self.max_targets and not self._reclaim_a_quiet_stream():
                if session is not None:  # what it registered before asking is freed: it will retry afresh
                    self._end(session)
                raise CapacityExceeded(f"the drafter serves its limit of {self.max_targets} targets "
                                       "(--max-targets)")
            session = self._get_or_create(client, streaming=True)
            if self.written_flags and session.waits is None:  # (its chained steps' launches wait on the device)
                session.waits = DeviceWaits(stream_ops(), self.device, peer="target",
                                            what="a chained step's written value")
            if page is not None:
                session.attach_page(page)
            session.streaming = True
            self._streams[client] = stream = _Stream(call)
            return session, stream

    def _reclaim_a_quiet_stream(self) -> bool:
        """End the stream that did no work for longest, if that is at least reclaim_stream_seconds,
        preferring one that holds no sequences: nothing proves a stream is a target, and an idle
        stranger must not keep a real target out. An evicted target re-attaches on its next request."""
        now = time.monotonic()
        streaming = {c: s for c, s in self._sessions.items() if s.streaming}
        quiet = [(streaming[c].num_sequences > 0, s.last_work, c) for c, s in self._streams.items()
                 if c in streaming and now - s.last_work >= self.limits.reclaim_stream_seconds]
        if not quiet:
            return False
        _, last_work, client = min(quiet)
        stream = self._streams.pop(client)
        skipped = _evictions.admit()
        if skipped is not None:
            log.info("the drafter serves --max-targets targets: ending the Step stream of client %s, without work "
                     "for %.0f s, for a newcomer%s", client, now - last_work,
                     f" ({skipped} more not logged)" if skipped else "")
        self._end(self._sessions[client], quiet=True)
        stream.call.cancel()
        return True


def _sessions_now(server_ref: "weakref.ref[DrafterServer]") -> list[Session]:
    """The server's sessions, for a metrics scrape: one copy of the dict, never the drafter lock (a
    scrape must not wait behind a step); a weak reference, so the metrics keep no server alive."""
    server = server_ref()
    return list(server._sessions.values()) if server is not None else []


def _reap_idle(server_ref: "weakref.ref[DrafterServer]", closed: threading.Event, idle_seconds: float) -> None:
    """Sweep idle stream-less connections a few times per idle period, until the server is closed or gone."""
    while not closed.wait(min(idle_seconds / 3, 5.0)):
        server = server_ref()
        if server is None:
            return
        with server._lock:
            server._sweep_idle()
        del server


def serve(server_obj: DrafterServer, listen: list[str], security: ServerSecurity = ServerSecurity(),
          metrics: MetricsAddress | None = None, *, step_socket: bool = True) -> Served:
    """Serve on every address with grpc.health.v1 and reflection, and the server's metrics at `metrics`
    (None: not over HTTP). Each open Step stream holds a thread (at most max_targets of them, plus
    spares for unary calls and health checks); keepalive pings (shared.serving) find a target that
    vanished without closing its socket. With `step_socket` and a unix address, the Step stream is also
    served without gRPC beside that address's socket (drafter_service.step_socket)."""
    register = lambda server: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(server_obj, server)  # noqa: E731
    message_bytes = server_obj.limits.message_bytes(server_obj.proposer.spec)
    # Busy while a target is connected: its requests in flight still want drafts.
    served = start_server(register, listen, SERVICE_NAME, max_workers=server_obj.max_targets + SPARE_THREADS,
                          busy=lambda: server_obj.num_streams > 0, max_message_bytes=message_bytes, security=security,
                          metrics=server_obj.metrics, metrics_address=metrics)
    unix = [a for a in listen if is_unix(grpc_target(a))]
    if step_socket and unix:  # in the gRPC socket's private folder (start_server has checked it)
        path = os.path.abspath(unix[0].removeprefix("unix:").removeprefix("//")) + ".step"
        try:
            served.listeners.append(StepSocketServer(server_obj, path, token=security.token,
                                                     max_message_bytes=message_bytes))
            server_obj.step_socket = path
        except OSError as err:  # e.g. a path past the 107 bytes a unix socket's name may have
            log.warning("no step socket at %s (%s): the Step stream goes over gRPC only", path, err)
    return served
