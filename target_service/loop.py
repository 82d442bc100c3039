"""The engine's own thread: concurrent Generate streams share one verify forward per step."""

from __future__ import annotations

import logging
import queue
import threading

from specsplit.shared.errors import InvalidRequest, SpecsplitError
from specsplit.target_service.engine import Engine
from specsplit.target_service.metrics import EngineState, engine_state
from specsplit.target_service.sequence import Request, StepEvent

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs `engine.step()` while there is work; each request's events go to its own queue.

    Only the loop's thread touches the engine's queues. `submit` and `cancel` leave their
    request in an inbox and return at once, so a cancel never waits behind a busy engine: the
    consumer gets `None` immediately and the engine frees the sequence (both sides) before its
    next step (a long prompt's prefill takes a chunk per step, so it stops at the next chunk). A failed
    step does not hang clients: every in-flight request receives the exception.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._work = threading.Condition()
        self._streams: dict[str, queue.Queue] = {}
        self._admissions: list[Request] = []
        self._cancels: list[str] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> "queue.Queue[StepEvent | Exception | None]":
        """Queue a request; validation errors raise here, in the caller's thread."""
        self.engine.validate(request)
        events: queue.Queue = queue.Queue()
        with self._work:
            if self._stopped:
                raise SpecsplitError("the target is shutting down")
            if request.request_id in self._streams or request.request_id in self._cancels:
                # A cancelled request runs until the engine thread aborts it: its id is not free yet.
                raise InvalidRequest(f"request id {request.request_id!r} is already in flight")
            self._streams[request.request_id] = events
            self._admissions.append(request)
            self._work.notify()
        return events

    def cancel(self, request_id: str) -> None:
        """Abort the request; its consumer, if still waiting, gets `None` (the stream is over)."""
        with self._work:
            stream = self._streams.pop(request_id, None)
            if stream is None:  # finished, failed or cancelled already
                return
            queued = [r for r in self._admissions if r.request_id == request_id]
            if queued:
                self._admissions.remove(queued[0])
            else:
                self._cancels.append(request_id)
                self._work.notify()
        stream.put(None)

    @property
    def context_length(self) -> int:
        return self.engine.model.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    def state(self) -> EngineState:
        """The engine's counters and state for a scrape or Describe, read from this thread (no lock)."""
        return engine_state(self.engine)

    @property
    def busy(self) -> bool:
        """Whether any request is still streaming."""
        with self._work:
            return bool(self._streams)

    def stop(self) -> None:
        with self._work:
            self._stopped = True
            self._work.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._work:
                while not (self._stopped or self._admissions or self._cancels or self.engine.has_work):
                    self._work.wait()
                admissions = self._admissions
                self._admissions = []
                cancels = list(self._cancels)
                stopped = self._stopped
            for request_id in cancels:
                self._abort(request_id)
            with self._work:
                del self._cancels[:len(cancels)]  # aborted: the ids are free again
            if stopped:
                self._fail_all(SpecsplitError("the target shut down"))
                return
            for request in admissions:
                try:
                    self.engine.add(request)
                except Exception as exc:  # noqa: BLE001 - the engine changed since validation
                    self._deliver_error(request.request_id, exc)
            if not self.engine.has_work:
                continue
            try:
                events = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - delivered to every waiting client
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            with self._work:
                for event in events:
                    self._deliver(event)

    def _deliver(self, event: StepEvent) -> None:
        stream = self._streams.get(event.request_id)
        if stream is None:  # cancelled meanwhile; the abort is queued
            return
        stream.put(event)
        if event.finish_reason is not None:
            del self._streams[event.request_id]

    def _abort(self, request_id: str) -> None:
        """An abort that fails must not kill the engine thread: the request's client gets the error."""
        try:
            self.engine.abort(request_id)
        except Exception as exc:  # noqa: BLE001 - logged; the thread goes on serving the others
            log.exception("aborting request %s failed", request_id)
            self._deliver_error(request_id, exc)

    def _deliver_error(self, request_id: str, exc: Exception) -> None:
        with self._work:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(exc)

    def _fail_all(self, exc: Exception) -> None:
        with self._work:
            streams, self._streams = self._streams, {}
            self._admissions = []
        for request_id, stream in streams.items():
            self._abort(request_id)  # a no-op for requests the engine never admitted
            stream.put(exc)
