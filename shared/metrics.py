"""Prometheus metrics both services share: a registry per server, its HTTP endpoint, and every call counted
by method and status code.

Each server owns its `CollectorRegistry` (never the process-global one), so several servers in one
process (tests) keep apart. What a service counts on its hot path are plain
integers read at scrape time (`target_service.counters`): no lock and no device sync per step.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, GCCollector, ProcessCollector, start_http_server
from prometheus_client.utils import floatToGoString

from specsplit.shared.errors import InvalidRequest

log = logging.getLogger(__name__)
_KINDS = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
          (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
          (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
          (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}


@dataclass(frozen=True)
class MetricsAddress:
    """Where /metrics is served over HTTP: --metrics-host and --metrics-port (0 here: any free port)."""

    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequest(f"--metrics-port must be in [0, 65535], got {self.port}")
        if not self.host:
            raise InvalidRequest("--metrics-host is empty")


def _final_code(context: grpc.ServicerContext, error: BaseException | None) -> str:
    code = context.code()  # what abort() or set_code() left; None while nothing did
    if code is not None:
        return code.name
    if isinstance(error, GeneratorExit) or not context.is_active():
        return "CANCELLED"  # the client went away mid-stream
    return "OK" if error is None else "UNKNOWN"  # grpc answers UNKNOWN for an exception it did not map


class CallObserver(grpc.ServerInterceptor):
    """Counts each call by method and final status code. Only methods the server serves are counted, so
    a caller cannot invent label values."""

    def __init__(self, calls: Counter) -> None:
        self.calls = calls

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        name, make = _KINDS[handler.request_streaming, handler.response_streaming]
        behaviour = getattr(handler, name)
        wrapped = (self._streamed if handler.response_streaming else self._answered)(
            behaviour, handler_call_details.method)
        return make(wrapped, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    def _answered(self, behaviour: Callable, method: str) -> Callable:
        def answered(request, context):
            with self._observed(method, context):
                return behaviour(request, context)
        return answered

    def _streamed(self, behaviour: Callable, method: str) -> Callable:
        def streamed(request, context):
            with self._observed(method, context):
                yield from behaviour(request, context)
        return streamed

    @contextlib.contextmanager
    def _observed(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        error = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.calls.labels(method, _final_code(context, error)).inc()


class ServiceMetrics:
    """One server's registry: process metrics, its calls by method and code, and (once `expose`d) the
    HTTP endpoint Prometheus scrapes. `prefix` names the service: specsplit_target, specsplit_drafter."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        calls = Counter(f"{prefix}_rpcs", "gRPC calls served, by method and final status code",
                        ["method", "code"], registry=self.registry)
        self.observer = CallObserver(calls)
        self._server = None

    def expose(self, address: MetricsAddress) -> int:
        """Serve http://HOST:PORT/metrics from a daemon thread until `close`; returns the port bound."""
        if self._server is not None:
            raise InvalidRequest("metrics are already exposed")
        try:
            self._server, _ = start_http_server(address.port, address.host, registry=self.registry)
        except OSError as err:
            raise InvalidRequest(f"cannot serve metrics on {address.host}:{address.port}: {err.strerror or err}") \
                from None
        port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", address.host, port)
        return port

    @property
    def port(self) -> int | None:
        """The endpoint's port while it serves."""
        return self._server.server_port if self._server is not None else None

    def close(self) -> None:
        """Stop the HTTP endpoint (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def buckets(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    """A histogram's cumulative (le, count) pairs from per-bucket counts: counts[i] values <= bounds[i],
    the last past every bound (as `target_service.counters.Tally` keeps them)."""
    cumulative, out = 0, []
    for bound, count in zip((*map(floatToGoString, bounds), "+Inf"), counts):
        cumulative += count
        out.append((bound, cumulative))
    return out
