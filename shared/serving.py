"""gRPC plumbing both services share: addresses, channel/server options, health, reflection, metrics, the
client header."""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import Callable, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.metrics import MetricsAddress, ServiceMetrics
# CHANNEL_OPTIONS and grpc_target live with open_channel (torch- and grpc_health-free for the Python client).
from specsplit.shared.security import (  # noqa: F401 (re-exported)
    CHANNEL_OPTIONS,
    ClientTLS,
    ServerSecurity,
    TokenAuth,
    grpc_target,
    is_unix,
    open_channel,
    private_socket_dir,
)
from specsplit.shared.status import Throttle, lenient

log = logging.getLogger(__name__)

# Every call from a target to a drafter names the connecting target (its session on the drafter).
CLIENT_HEADER = "x-specsplit-client"
# ... and, once it has described the drafter, that drafter process (DrafterDescription.instance): a drafter
# restarted at the same address refuses the calls of a connection made to the one before it.
INSTANCE_HEADER = "x-specsplit-drafter-instance"
# A target's channel to its drafter: a dead or frozen (SIGSTOPped) drafter is found within about 2 s,
# even mid-step, by HTTP/2 pings; a lost connection is retried within a second or two, not minutes.
# (grpc.http2.ping_timeout_ms is what bounds the wait for a ping's answer in grpc >= 1.6x; without it a
# SIGSTOPped peer held a stream for as long as it stayed stopped.) A connection counts as up only once
# the peer's HTTP/2 SETTINGS arrived, so a stopped drafter's socket, though it accepts, is never "ready".
PEER_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.keepalive_time_ms", 1_000), ("grpc.keepalive_timeout_ms", 1_000), ("grpc.http2.ping_timeout_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_sent_ping_interval_without_data_ms", 1_000), ("grpc.http2.min_time_between_pings_ms", 1_000),
    ("grpc.initial_reconnect_backoff_ms", 1_000), ("grpc.min_reconnect_backoff_ms", 1_000),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Server threads kept beyond the long-lived streams a service admits: unary calls and health checks.
SPARE_THREADS = 8
DEFAULT_MESSAGE_BYTES = 4 << 20  # a target's Generate request: a prompt of at most a context of text


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Messages past `max_message_bytes` are refused (RESOURCE_EXHAUSTED) before they are parsed. The
    server pings idle clients (a vanished target is found) and lets clients ping it every second."""
    return [
        ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000), ("grpc.http2.ping_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500), ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ]


class Served:
    """A started gRPC server with its health service.

    `drain` is the graceful stop Kubernetes expects on SIGTERM: health turns NOT_SERVING for good
    (watchers are told at once), new calls are refused, and the service's own work in flight (as
    `busy` reports it) gets up to `grace` seconds to finish; then every call still open, health
    watches included, is cancelled.
    """

    def __init__(self, server: grpc.Server, health_servicer: health.HealthServicer,
                 busy: Callable[[], bool], metrics: ServiceMetrics | None = None) -> None:
        self.server = server
        self._health = health_servicer
        self._busy = busy
        self._metrics = metrics  # its HTTP endpoint answers until the server has stopped
        self.listeners: list[Listener] = []  # served beside gRPC (the drafter's step socket), stopped with it

    def drain(self, grace: float) -> None:
        self._health.enter_graceful_shutdown()
        for listener in self.listeners:
            listener.stop_accepting()
        stopped = self.server.stop(grace)
        deadline = time.monotonic() + grace
        while self._busy() and not stopped.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.server.stop(None).wait()
        self._close_rest()

    def stop(self, grace: float | None = None):
        """grpc.Server.stop: returns an event set once the server has stopped."""
        stopped = self.server.stop(grace)
        self._close_rest()
        return stopped

    def _close_rest(self) -> None:
        for listener in self.listeners:
            listener.close()
        if self._metrics is not None:
            self._metrics.close()


class Listener(Protocol):
    """Something served beside the gRPC server: refuses newcomers when draining, ends all on close."""

    def stop_accepting(self) -> None: ...

    def close(self) -> None: ...


def start_server(register: Callable[[grpc.Server], None], listen: list[str], service_name: str, *,
                 max_workers: int, busy: Callable[[], bool], max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
                 security: ServerSecurity = ServerSecurity(), metrics: ServiceMetrics | None = None,
                 metrics_address: MetricsAddress | None = None) -> Served:
    """Bind every address, register the servicer, grpc.health.v1 and server reflection, start, mark SERVING.

    With a token every call but health checks must carry it; TLS (when configured) covers the TCP
    addresses, and a unix socket lives in a folder only this user may open. With `metrics` every call
    is counted (refused ones too), and with `metrics_address` the metrics are served over HTTP. The
    caller drains or stops the returned server.
    """
    _quiet_malformed_messages()
    interceptors = [metrics.observer] if metrics is not None else []
    interceptors += [TokenAuth(security.token)] if security.token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=server_options(max_message_bytes), interceptors=interceptors)
    register(_LenientParsing(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Reflection lists and describes the services (grpcurl, Postman); with a token it needs the token too.
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if metrics is not None and metrics_address is not None:
        metrics.expose(metrics_address)
    try:
        for address in listen:
            _bind(server, address, security)
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    server.start()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Served(server, health_servicer, busy, metrics)


def _bind(server: grpc.Server, address: str, security: ServerSecurity) -> None:
    target = grpc_target(address)
    if is_unix(target):
        private_socket_dir(target)
    elif security.token is None:
        log.warning("%s: no auth token (--auth-token-file or $SPECSPLIT_AUTH_TOKEN): anyone who can reach "
                    "this port can use the service", address)
    elif security.tls is None:
        log.warning("%s: no TLS (--tls-cert, --tls-key): the token travels in clear", address)
    try:
        if security.tls is not None and not is_unix(target):
            port = server.add_secure_port(target, security.tls.credentials())
        else:
            port = server.add_insecure_port(target)
    except RuntimeError as err:
        raise InvalidRequest(f"cannot listen on {address!r}: {err}") from None
    if port == 0:
        raise InvalidRequest(f"cannot listen on {address!r}")


class _LenientParsing:
    """The server as a generated `add_*Servicer_to_server` sees it: each method's request deserializer
    is wrapped by `shared.status.lenient`, so bytes that do not parse reach the handler, which refuses
    them with INVALID_ARGUMENT, instead of gRPC answering INTERNAL."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # generated code adds the same methods again below, where their deserializers can be wrapped

    def add_registered_method_handlers(self, service: str, method_handlers: dict) -> None:
        wrapped = {name: handler._replace(request_deserializer=lenient(handler.request_deserializer))
                   for name, handler in method_handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self._server.add_registered_method_handlers(service, wrapped)


class _MalformedMessages(logging.Filter):
    """grpc logs a full traceback for every request it cannot parse, and a stranger can send those at
    will: each becomes one line, at most a few a minute (the next line counts those left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.throttle = Throttle(per_minute=6)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Exception deserializing"):
            return True
        skipped = self.throttle.admit()
        if skipped is None:
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = "refused a malformed message (%s)" + (f"; {skipped} more not logged" if skipped else "")
        record.args = (str(error).replace("\n", " ") or "unparsable",)
        return True


def _quiet_malformed_messages() -> None:
    grpc_log = logging.getLogger("grpc._common")
    if not any(isinstance(f, _MalformedMessages) for f in grpc_log.filters):
        grpc_log.addFilter(_MalformedMessages())


def wait_healthy(address: str, timeout: float = 60.0, service: str = "",
                 alive: Callable[[], bool] = lambda: True, tls: ClientTLS | None = None) -> None:
    """Block until the server at `address` answers SERVING (any specsplit service; health needs no token).

    `alive` lets a caller that spawned the server stop waiting as soon as the process died.
    """
    deadline = time.monotonic() + timeout
    with open_channel(grpc_target(address), [], tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if not alive():
                raise RuntimeError(f"{address}: the server's process exited before it became healthy")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become healthy within {timeout:.0f} s")
            time.sleep(0.1)
