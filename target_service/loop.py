"""The engine's own thread: concurrent Generate streams share one verify forward per step."""

from __future__ import annotations

import logging
import queue
import threading

from shared.errors import SpecsplitError
from target_service.engine import Engine
from target_service.sequence import Request, StepEvent

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs `engine.step()` while there is work; each request's events go to its own queue.

    A failed step does not hang clients: every in-flight request receives the exception.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._streams: dict[str, queue.Queue] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> "queue.Queue[StepEvent | Exception | None]":
        """Queue a request; validation errors raise here, in the caller's thread."""
        events: queue.Queue = queue.Queue()
        with self._work:
            if self._stopped:
                raise SpecsplitError("the target is shutting down")
            self.engine.add(request)
            self._streams[request.request_id] = events
            self._work.notify()
        return events

    def cancel(self, request_id: str) -> None:
        """Abort the request; its consumer, if still waiting, gets `None` (the stream is over)."""
        with self._lock:
            if self.engine.abort(request_id):
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(None)

    def stop(self) -> None:
        with self._work:
            self._stopped = True
            self._work.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._stopped and not self.engine.has_work:
                    self._work.wait()
                if self._stopped:
                    self._fail_all(SpecsplitError("the target shut down"))
                    return
                try:
                    events = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - delivered to every waiting client
                    log.exception("engine step failed")
                    self._fail_all(exc)
                    continue
                for event in events:
                    self._deliver(event)

    def _deliver(self, event: StepEvent) -> None:
        stream = self._streams.get(event.request_id)
        if stream is None:
            return
        stream.put(event)
        if event.finish_reason is not None:
            del self._streams[event.request_id]

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(exc)
        self._streams.clear()
