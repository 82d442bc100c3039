"""A Python client that also exposes the raw stub, for tests that read a call's protocol-level outcome."""

from __future__ import annotations

import grpc

from specsplit.client import Client
from specsplit.protos.v1 import target_pb2_grpc


class RawClient(Client):
    """A `Client` that also holds a raw stub and channel, for calls whose protocol-level outcome a test
    reads (a cancelled call, a refused stream, health) where the Client would check or retry first."""

    def __init__(self, address: str, timeout: float = 120.0) -> None:
        super().__init__(address, timeout=timeout)
        self.channel = grpc.insecure_channel(address)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        super().close()
