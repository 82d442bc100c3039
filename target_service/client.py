"""A small client of the target service: what the CLI, the demo and the test harness use."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.protos.v1 import target_pb2, target_pb2_grpc
from specsplit.shared import wire
from specsplit.shared.errors import SpecsplitError
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.security import ClientSecurity, ClientTLS, open_channel
from specsplit.shared.serving import CHANNEL_OPTIONS, grpc_target


class TargetClient:
    def __init__(self, address: str, *, timeout: float = 600.0, security: ClientSecurity = ClientSecurity()) -> None:
        self.address = address
        self.timeout = timeout
        self.metadata = security.metadata
        self.channel = open_channel(grpc_target(address), CHANNEL_OPTIONS, security.tls)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)

    def stream(self, prompt: str | list[int], sampling: SamplingParams = SamplingParams(), *,
               chat: bool = False, speculative: bool = True, request_id: str = "") -> Iterator[wire.GenerateChunk]:
        """Chunks as the target accepts tokens; a failed call raises the matching domain error."""
        call = wire.GenerateCall(prompt if isinstance(prompt, str) else tuple(prompt), sampling, chat,
                                 speculative, request_id)
        try:
            for pb in self.stub.Generate(wire.generate_to_proto(call), timeout=self.timeout,
                                         metadata=self.metadata):
                yield wire.chunk_from_proto(pb)
        except grpc.RpcError as exc:
            raise wire.error_from_status(exc.code().name, exc.details() or exc.code().name) from None

    def generate(self, prompt: str | list[int], sampling: SamplingParams = SamplingParams(), **kw) -> dict:
        """The whole generation as the CLI's JSON shape: token_ids, text, stats."""
        chunks = list(self.stream(prompt, sampling, **kw))
        stats = chunks[-1].stats
        if stats is None:
            raise SpecsplitError("the stream ended without a final chunk")
        return {
            "token_ids": [t for c in chunks for t in c.token_ids],
            "text": "".join(c.text for c in chunks),
            "stats": {"steps": stats.steps, "drafted": stats.drafted, "accepted": stats.accepted,
                      "tau": round(stats.tau, 4)},
            "finish_reason": chunks[-1].finish_reason,
        }

    def describe(self) -> wire.TargetDescription:
        pb = self.stub.Describe(target_pb2.DescribeTargetRequest(), timeout=self.timeout, metadata=self.metadata)
        return wire.target_description_from_proto(pb)

    def close(self) -> None:
        self.channel.close()


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
