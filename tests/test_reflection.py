"""gRPC server reflection on both services: a generic client (grpcurl, Postman, grpc_reflection's own
descriptor database here) lists the services and learns their methods, behind the token when one is set."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specsplit.local import LocalSetup
from specsplit.services import DrafterSettings, TargetSettings, start_drafter, start_target
from specsplit.shared.security import ServerSecurity, auth_metadata
from specsplit.target_service.engine import EngineConfig

TOKEN = "reflection-test-token"


@pytest.fixture(scope="module")
def addresses(tmp_path_factory, tiny_chat_dir):
    """{"drafter": address, "target": address}: a random DFlash drafter and the tiny target, token-protected."""
    folder = tmp_path_factory.mktemp("reflection")
    security = ServerSecurity(TOKEN)
    drafter = f"unix:{folder}/d.sock"
    drafter_obj, drafter_served = start_drafter(DrafterSettings(
        (drafter,), LocalSetup(target=str(tiny_chat_dir), drafter="random-dflash"), security=security))
    target = f"unix:{folder}/t.sock"
    loop, target_served = start_target(TargetSettings((target,), LocalSetup(target=str(tiny_chat_dir)), None,
                                                      EngineConfig(), security=security))
    yield {"drafter": drafter, "target": target}
    target_served.stop(None).wait()
    loop.stop()
    drafter_served.stop(None).wait()
    drafter_obj.close()


class _WithToken(grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The reflection client has no metadata argument: add the bearer token to each call."""

    def _add(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + auth_metadata(TOKEN))

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._add(details), request)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._add(details), requests)


@pytest.mark.parametrize("service, expected", [
    ("target", "specsplit.v1.TargetService"), ("drafter", "specsplit.v1.DrafterService")])
def test_reflection_lists_the_service_health_and_itself(addresses, service, expected):
    with grpc.intercept_channel(grpc.insecure_channel(addresses[service]), _WithToken()) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert set(database.get_services()) == {expected, "grpc.health.v1.Health",
                                                 "grpc.reflection.v1alpha.ServerReflection"}
        methods = {m.name for m in DescriptorPool(database).FindServiceByName(expected).methods}
    assert ("Generate" in methods) if service == "target" else {"Step", "Propose", "RegisterBuffers"} <= methods


def test_reflection_needs_the_token_like_every_call_but_health(addresses):
    with grpc.insecure_channel(addresses["target"]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
