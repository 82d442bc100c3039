"""The one place where exceptions become gRPC status codes, for every servicer of both services."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections import deque
from typing import Callable

import grpc

from specsplit.shared.errors import InvalidRequest, SpecsplitError

log = logging.getLogger(__name__)


class Throttle:
    """At most `per_minute` log lines a minute: callers can make a service log at will."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._sent: deque[float] = deque()
        self._skipped = 0
        self._lock = threading.Lock()

    def admit(self) -> int | None:
        """None: leave this line out; otherwise how many were left out since the last line logged."""
        now = time.monotonic()
        with self._lock:
            while self._sent and now - self._sent[0] > 60.0:
                self._sent.popleft()
            if len(self._sent) >= self.per_minute:
                self._skipped += 1
                return None
            self._sent.append(now)
            skipped, self._skipped = self._skipped, 0
            return skipped


_unexpected = Throttle(per_minute=10)
_malformed = Throttle(per_minute=6)


class Malformed:
    """A request whose bytes are not a message of the method's type, as `lenient` hands it on: the
    handler refuses it with INVALID_ARGUMENT (gRPC itself would answer INTERNAL, the code of a bug).
    A handler that reads a stream of requests meets it as an item: any attribute raises the same."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def error(self) -> InvalidRequest:
        return InvalidRequest(f"malformed request: {self.reason}")

    def __getattr__(self, name: str):
        raise self.error()


def lenient(deserializer: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """`deserializer` that answers unparsable bytes with a `Malformed` (one log line, rate-limited)."""
    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or whatever a parser raises
            reason = str(exc).replace("\n", " ") or "unparsable"
            skipped = _malformed.admit()
            if skipped is not None:
                log.warning("refused a malformed message (%s)%s", reason,
                            f"; {skipped} more not logged" if skipped else "")
            return Malformed(reason)
    return parse


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SpecsplitError):
        return grpc.StatusCode[exc.grpc_code], str(exc)
    skipped = _unexpected.admit()
    if skipped is not None:  # a bug: keep its traceback, but a caller that found it cannot flood the log
        log.error("unexpected error in an RPC handler%s", f" ({skipped} more not logged)" if skipped else "",
                  exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: BaseException):
    code, message = status_of(exc)
    context.abort(code, message)


def rpc_errors(handler):
    """Decorate a servicer method (unary or streaming) so domain errors reach the client as statuses."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def streaming(self, request, context):
            try:
                if isinstance(request, Malformed):
                    raise request.error()
                yield from handler(self, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
                _abort(context, exc)
        return streaming

    @functools.wraps(handler)
    def unary(self, request, context):
        try:
            if isinstance(request, Malformed):
                raise request.error()
            return handler(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            _abort(context, exc)
    return unary
