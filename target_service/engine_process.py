"""The engine in a process of its own, apart from the gRPC front end (`target serve --engine-process`).

In one process, the engine's thread shares one GIL with the front end: a gRPC thread per Generate stream and
gRPC's own, each waking every step to send a chunk. While the engine's host work is the step's bound (a
graphed GPU step: a millisecond of launches and reads), every wake-up of theirs lands on the step's critical
path. In a process of its own the engine's only Python thread is its loop: it reads what the front end sent
between steps (`poll`, no thread to wake) and sends each step's events as one message down a pipe.

The front end's `EngineProcess` offers what `EngineLoop` does (submit, cancel, busy, stop, state), so the
servicer does not know which it talks to. One reader thread here turns each step's message into the streams'
queues. Requests are validated in the engine's process when they arrive there, and a refusal reaches the
stream as its first event, with the same status code. If the engine's process dies, every stream gets
UNAVAILABLE, later submits are refused, and `died` is set (the service exits; its supervisor restarts it).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

from specsplit.shared import logs
from specsplit.shared.errors import InvalidRequest, SpecsplitError
from specsplit.target_service.metrics import EngineState, engine_state
from specsplit.target_service.sequence import Request, StepEvent

log = logging.getLogger(__name__)
STATE_SECONDS = 10.0  # how long a scrape or Describe waits for the engine's state (a step in between)
STOP_SECONDS = 10.0


class EngineDied(SpecsplitError):
    """The engine's process is gone: streams in flight end, and the target serves nothing until it restarts."""

    grpc_code = "UNAVAILABLE"


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs of the engine that never changes, sent once it is built."""

    context_length: int
    vocab_size: int


class EngineProcess:
    """Starts `build()` (picklable: it runs in the new process) in a spawned process and serves it like
    `EngineLoop`. Blocks until the engine is built; a build that fails raises its error here."""

    def __init__(self, build: Callable[[], object]) -> None:
        context = multiprocessing.get_context("spawn")  # (CUDA and gRPC do not survive a fork)
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_engine_main, args=(child, build, logs.current()),
                                        name="specsplit-engine", daemon=True)
        self._process.start()
        child.close()
        try:
            kind, *body = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(STOP_SECONDS)
            raise EngineDied(f"the engine's process exited (code {self._process.exitcode}) before it was built") \
                from None
        if kind != "ready":
            self._process.join(STOP_SECONDS)
            raise body[-1]
        info: EngineInfo = body[0]
        self.context_length = info.context_length
        self.vocab_size = info.vocab_size
        self.died = threading.Event()
        # Sends may block while the engine steps (a full pipe): never under `_lock`, which the reader takes
        self._send_lock = threading.RLock()
        self._lock = threading.Lock()  # the streams, cancels and state requests below
        self._streams: dict[str, queue.Queue] = {}
        self._cancelling: set[str] = set()  # ids cancelled here and not yet aborted there: not free yet
        self._states: dict[int, list] = {}  # state requests in flight: [event, EngineState | None]
        self._state_ids = itertools.count()
        self._last_state: EngineState | None = None
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def submit(self, request: Request) -> "queue.Queue[StepEvent | Exception | None]":
        events: queue.Queue = queue.Queue()
        with self._send_lock:  # (an add goes down the pipe before its cancel can)
            with self._lock:
                if self.died.is_set() or self._stopping:
                    raise EngineDied("the target's engine is not running") if self.died.is_set() \
                        else SpecsplitError("the target is shutting down")
                if request.request_id in self._streams or request.request_id in self._cancelling:
                    raise InvalidRequest(f"request id {request.request_id!r} is already in flight")
                self._streams[request.request_id] = events
            self._send(("add", request))
        return events

    def cancel(self, request_id: str) -> None:
        """Abort the request; its consumer, if still waiting, gets `None` (the stream is over)."""
        with self._send_lock:
            with self._lock:
                stream = self._streams.pop(request_id, None)
                if stream is None:
                    return
                self._cancelling.add(request_id)
            self._send(("cancel", request_id))
        stream.put(None)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._streams)

    def state(self) -> EngineState:
        """The engine's counters and state, asked of its process (answered between two steps)."""
        if self.died.is_set():
            raise EngineDied("the target's engine is not running")
        waiter = [threading.Event(), None]
        with self._lock:
            token = next(self._state_ids)
            self._states[token] = waiter
        self._send(("state", token))
        if waiter[0].wait(STATE_SECONDS) and waiter[1] is not None:
            return waiter[1]
        with self._lock:
            self._states.pop(token, None)
        if self._last_state is not None:  # a step longer than the wait: what it said last time
            return self._last_state
        raise EngineDied(f"the target's engine did not answer within {STATE_SECONDS:.0f} s")

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._send(("stop",))
        self._process.join(STOP_SECONDS)
        if self._process.is_alive():
            log.warning("the engine's process did not stop within %.0f s: killed", STOP_SECONDS)
            self._process.kill()
            self._process.join(STOP_SECONDS)
        self._reader.join(STOP_SECONDS)
        self._conn.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the process is gone; the reader sees it and fails the streams
                pass

    def _read(self) -> None:
        while True:
            try:
                kind, *body = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - a message that does not unpickle here: the link is broken
                log.exception("a message from the engine's process could not be read")
                break
            if kind == "events":
                self._deliver(body[0])
            elif kind == "error":  # one request refused or failed there
                self._end(body[0], body[1])
            elif kind == "failed":  # a step failed: these requests were aborted there
                for request_id in body[0]:
                    self._end(request_id, body[1])
            elif kind == "aborted":
                with self._lock:
                    self._cancelling.discard(body[0])
            elif kind == "state":
                token, state = body
                self._last_state = state
                with self._lock:
                    waiter = self._states.pop(token, None)
                if waiter is not None:
                    waiter[1] = state
                    waiter[0].set()
        self._process.join(1.0)
        if self._process.is_alive():  # a link broken with the process still up: it serves no one now
            self._process.kill()
            self._process.join(STOP_SECONDS)
        code = self._process.exitcode
        with self._lock:
            stopping = self._stopping
            self.died.set()
            streams, self._streams = self._streams, {}
            waiters, self._states = self._states, {}
        if not stopping:
            log.error("the engine's process exited (code %s): %d streams in flight end", code, len(streams))
        error = EngineDied(f"the target's engine process exited (code {code})") if not stopping \
            else SpecsplitError("the target shut down")
        for stream in streams.values():
            stream.put(error)
        for waiter in waiters.values():
            waiter[0].set()

    def _deliver(self, events: list[StepEvent]) -> None:
        with self._lock:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None:  # cancelled meanwhile; its abort is on its way
                    continue
                stream.put(event)
                if event.finish_reason is not None:
                    del self._streams[event.request_id]

    def _end(self, request_id: str, exc: Exception) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(exc)


# ---- the engine's process ----------------------------------------------------------------------------


def _engine_main(conn: Connection, build: Callable[[], object], log_setup: tuple[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the front end's to handle: it stops us
    _die_with_parent()
    logs.configure(*log_setup)
    try:
        engine = build()
    except BaseException as exc:  # noqa: BLE001 - sent to the front end, which raises it
        log.exception("building the engine failed")
        conn.send(("failed", [], _portable(exc)))
        return
    config = engine.model.config
    try:
        conn.send(("ready", EngineInfo(config.max_position_embeddings, config.vocab_size)))
        _EngineServer(conn, engine).run()
    except (BrokenPipeError, ConnectionResetError):  # the front end is gone: so are we
        pass


def _die_with_parent() -> None:
    """SIGKILL this process when the front end dies, however it dies (Linux; elsewhere the pipe's end does)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it crosses the pipe intact, else a SpecsplitError with its text (the front end must read it)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return SpecsplitError(f"{type(exc).__name__}: {exc}")


class _EngineServer:
    """The engine's loop in its own process: what came down the pipe between steps, then a step."""

    def __init__(self, conn: Connection, engine) -> None:
        self.conn = conn
        self.engine = engine

    def run(self) -> None:
        engine = self.engine
        while True:
            wait = not engine.has_work  # idle: block until something comes
            while wait or self.conn.poll(0):
                wait = False
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):  # the front end is gone
                    return
                if not self._handle(message):
                    return
            if not engine.has_work:
                continue
            try:
                events = engine.step()
            except Exception as exc:  # noqa: BLE001 - every request in the engine gets it
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            if events:
                self.conn.send(("events", events))

    def _handle(self, message: tuple) -> bool:
        kind, *body = message
        if kind == "add":
            request: Request = body[0]
            try:
                self.engine.add(request)  # (validates it)
            except Exception as exc:  # noqa: BLE001 - refused: the stream ends with it
                self.conn.send(("error", request.request_id, _portable(exc)))
        elif kind == "cancel":
            try:
                self.engine.abort(body[0])
            except Exception as exc:  # noqa: BLE001 - logged; the loop goes on serving the others
                log.exception("aborting request %s failed", body[0])
                self.conn.send(("error", body[0], _portable(exc)))
            self.conn.send(("aborted", body[0]))
        elif kind == "state":
            self.conn.send(("state", body[0], engine_state(self.engine)))
        elif kind == "stop":
            self._fail_all(None)
            return False
        return True

    def _fail_all(self, exc: Exception | None) -> None:
        ids = [seq.request.request_id for seq in self.engine.waiting] + list(self.engine.running)
        for request_id in ids:
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the others are aborted still
                log.exception("aborting request %s failed", request_id)
        if exc is not None:
            self.conn.send(("failed", ids, _portable(exc)))
