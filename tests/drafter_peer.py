"""A raw gRPC caller of the drafter service under a client id of its own, for tests that attack it."""

from __future__ import annotations

import secrets

import grpc

from specsplit.drafter_service.server import CLIENT_HEADER
from specsplit.protos.v1 import drafter_pb2_grpc


class DrafterPeer:
    """A caller under its own client id (nothing proves it is a target)."""

    def __init__(self, channel: grpc.Channel, name: str | None = None) -> None:
        self.stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        self.name = name or secrets.token_hex(8)
        self.metadata = ((CLIENT_HEADER, self.name),)

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=20)

    def status(self, method: str, request) -> tuple[str, str]:
        """(status code name, details) of one call; ("OK", "") when it succeeded."""
        try:
            self.call(method, request)
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
        return "OK", ""
