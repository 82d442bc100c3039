#!/usr/bin/env python3
"""An exec probe: exit 0 when the gRPC server at ADDR answers grpc.health.v1 Check with SERVING.

The drafter listens only on a unix socket in the pod (only the pod's containers can reach it), and a
kubelet `grpc:` probe dials the pod IP, so the drafter is probed from inside its container with this.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(serving, what was seen): one Check call, no retries (the kubelet repeats the probe)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse
    return reply.status == status.SERVING, status.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="unix:PATH or host:port")
    parser.add_argument("--service", default="", help="the service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for an answer; keep it below the probe's timeoutSeconds")
    args = parser.parse_args(argv)
    serving, seen = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {seen}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
