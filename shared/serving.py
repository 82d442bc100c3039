"""gRPC plumbing both services share: addresses, channel/server options, health, the client header."""

from __future__ import annotations

import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specsplit.shared.errors import InvalidRequest

# Every call from a target to a drafter names the connecting target (its session on the drafter).
CLIENT_HEADER = "x-specsplit-client"
_MESSAGE_LIMITS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
CHANNEL_OPTIONS = list(_MESSAGE_LIMITS)  # inline rows between hosts can be large
# Server threads kept beyond the long-lived streams a service admits: unary calls and health checks.
SPARE_THREADS = 8
SERVER_OPTIONS = _MESSAGE_LIMITS + [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)]


def grpc_target(address: str) -> str:
    """ADDR as the CLI takes it (host:port or unix:PATH) → a gRPC channel target."""
    if ":" in address:  # host:port, [v6]:port or unix:PATH
        return address
    raise InvalidRequest(f"address {address!r}: expected host:port or unix:PATH")


class Served:
    """A started gRPC server with its health service.

    `drain` is the graceful stop Kubernetes expects on SIGTERM: health turns NOT_SERVING for good
    (watchers are told at once), new calls are refused, and the service's own work in flight (as
    `busy` reports it) gets up to `grace` seconds to finish; then every call still open, health
    watches included, is cancelled.
    """

    def __init__(self, server: grpc.Server, health_servicer: health.HealthServicer,
                 busy: Callable[[], bool]) -> None:
        self.server = server
        self._health = health_servicer
        self._busy = busy

    def drain(self, grace: float) -> None:
        self._health.enter_graceful_shutdown()
        stopped = self.server.stop(grace)
        deadline = time.monotonic() + grace
        while self._busy() and not stopped.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.server.stop(None).wait()

    def stop(self, grace: float | None = None):
        """grpc.Server.stop: returns an event set once the server has stopped."""
        return self.server.stop(grace)


def start_server(register: Callable[[grpc.Server], None], listen: list[str], service_name: str, *,
                 max_workers: int, busy: Callable[[], bool]) -> Served:
    """Bind every address (insecure), register the servicer and grpc.health.v1, start, mark SERVING.

    The caller drains or stops the returned server.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS)
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for address in listen:
        try:
            port = server.add_insecure_port(grpc_target(address))
        except RuntimeError as err:
            raise InvalidRequest(f"cannot listen on {address!r}: {err}") from None
        if port == 0:
            raise InvalidRequest(f"cannot listen on {address!r}")
    server.start()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Served(server, health_servicer, busy)
