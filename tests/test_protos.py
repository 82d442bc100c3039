"""The protocol: generated stubs match the .proto files, every RPC and field is commented, stubs work."""

from __future__ import annotations

import filecmp
import re
import subprocess
from concurrent import futures
from pathlib import Path

import google.protobuf
import grpc
import pytest

from specsplit.protos.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, target_pb2
from specsplit.shared import wire
from specsplit.shared.proposer import DrafterKind, DrafterSpec, FeatureKind, Proposal

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos" / "specsplit" / "v1"
PROTOS = sorted(PROTO_DIR.glob("*.proto"))
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_the_three_protos_exist():
    assert [p.name for p in PROTOS] == ["common.proto", "drafter.proto", "target.proto"]


def test_generated_stubs_are_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the stubs")
    subprocess.run(["bash", str(ROOT / "tools" / "gen_protos.sh"), str(tmp_path)], check=True, capture_output=True)
    for proto in PROTOS:
        for suffix in GENERATED_SUFFIXES:
            name = proto.stem + suffix
            fresh = tmp_path / "protos" / "specsplit" / "v1" / name
            assert filecmp.cmp(fresh, PROTO_DIR / name, shallow=False), f"{name} is stale: run tools/gen_protos.sh"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def test_gencode_is_not_newer_than_the_protobuf_runtime():
    runtime = _version(google.protobuf.__version__)
    for proto in PROTOS:
        source = (PROTO_DIR / f"{proto.stem}_pb2.py").read_text()
        found = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", source)
        assert found, f"{proto.stem}_pb2.py has no runtime version check"
        gencode = tuple(int(x) for x in found.groups())
        assert gencode <= runtime, f"{proto.stem}_pb2.py needs protobuf >= {gencode}, runtime is {runtime}"


# --- every RPC, field, message, enum and enum value carries a comment ---------------------------

_DECLARATIONS = {
    "rpc": re.compile(r"rpc\s+\w+\s*\("),
    "field": re.compile(r"(optional\s+|repeated\s+)?[\w.]+\s+\w+\s*=\s*\d+\s*;"),
    "enum value": re.compile(r"[A-Z][A-Z0-9_]*\s*=\s*-?\d+\s*;"),
    "message": re.compile(r"message\s+\w+"),
    "enum": re.compile(r"enum\s+\w+"),
    "service": re.compile(r"service\s+\w+"),
    "oneof": re.compile(r"oneof\s+\w+"),
}


def declarations(text: str) -> list[tuple[str, str, bool]]:
    """(kind, declaration, commented) for each declaration: a // line right above, or a trailing //."""
    found, comment_above = [], False
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("//"):
            comment_above = True
            continue
        code = line.split("//", 1)[0].strip()
        for kind, pattern in _DECLARATIONS.items():
            if pattern.match(code):
                found.append((kind, code, comment_above or "//" in line))
                break
        comment_above = False
    return found


def test_the_comment_checker_sees_missing_comments():
    snippet = (
        "// ok\nmessage A {\n  // ok\n  int32 x = 1;\n  repeated B y = 2;\n\n  // gap\n\n  C z = 3; // trailing\n}\n"
    )
    assert [(k, c) for k, c, ok in declarations(snippet) if not ok] == [("field", "repeated B y = 2;")]
    assert [k for k, *_ in declarations("service S {\n  rpc F(A) returns (stream B);\n}")] == ["service", "rpc"]


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_declaration_is_commented(proto):
    found = declarations(proto.read_text())
    missing = [f"{kind}: {code}" for kind, code, ok in found if not ok]
    assert not missing, f"{proto.name}: uncommented " + "; ".join(missing)


def test_the_checker_counted_every_field_and_rpc():
    """Guards the test above against a parser that silently finds nothing."""
    counted = {kind: 0 for kind in _DECLARATIONS}
    for proto in PROTOS:
        for kind, _, _ in declarations(proto.read_text()):
            counted[kind] += 1
    fields = sum(
        len(m.fields)
        for pb in (common_pb2, drafter_pb2, target_pb2)
        for m in pb.DESCRIPTOR.message_types_by_name.values()
    )
    rpcs = sum(len(s.methods) for pb in (drafter_pb2, target_pb2) for s in pb.DESCRIPTOR.services_by_name.values())
    assert counted["field"] == fields and counted["rpc"] == rpcs


# --- services -----------------------------------------------------------------------------------


def test_drafter_service_speaks_every_proposer_verb():
    service = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"]
    assert set(service.methods_by_name) == {
        "Describe",
        "RegisterBuffers",
        "ReleaseBuffers",
        "AllocState",
        "PrefillDrafter",
        "FreeState",
        "Propose",
        "Stash",
        "Commit",
        "Trim",
        "Catchup",
        "TakeDrafterKV",
        "InstallDrafterKV",
        "FreeDrafterKV",
        "Step",
    }
    step = service.methods_by_name["Step"]
    assert step.client_streaming and step.server_streaming
    assert not any(m.client_streaming or m.server_streaming for n, m in service.methods_by_name.items() if n != "Step")
    generate = target_pb2.DESCRIPTOR.services_by_name["TargetService"].methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    assert drafter_pb2.DESCRIPTOR.package == "specsplit.v1"


class _EchoDrafter(drafter_pb2_grpc.DrafterServiceServicer):
    """Answers each step with one draft per propose: last_token + 1 .. + num_drafts."""

    def Describe(self, request, context):
        spec = DrafterSpec(DrafterKind.MTP, FeatureKind.LAST_HIDDEN, 8, 8, 100, 2)
        return wire.description_to_proto(wire.DrafterDescription(spec, host_id="h"))

    def Step(self, request_iterator, context):
        for pb in request_iterator:
            batch, errors = wire.step_from_proto(pb)
            proposals = {
                p.seq_id: Proposal([p.last_token + i for i in range(1, p.num_drafts + 1)]) for p in batch.proposes
            }
            yield wire.step_result_to_proto(wire.StepResult(batch.step_id, proposals, tuple(errors)))


@pytest.fixture(scope="module")
def server():
    health = pytest.importorskip("grpc_health.v1.health", reason="grpcio-health-checking is a runtime dependency")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(_EchoDrafter(), srv)
    checker = health.HealthServicer()
    checker.set("specsplit.v1.DrafterService", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, health_pb2, health_pb2_grpc
    channel.close()
    srv.stop(None)


def test_health_checking_works_with_this_protobuf(server):
    channel, health_pb2, health_pb2_grpc = server
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service="specsplit.v1.DrafterService"), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_step_stream_over_a_real_channel(server):
    channel = server[0]
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    assert (
        wire.description_from_proto(stub.Describe(drafter_pb2.DescribeDrafterRequest(), timeout=10)).spec.max_drafts
        == 2
    )
    good = drafter_pb2.StepRequest(
        step_id=1, proposes=[drafter_pb2.ProposeItem(seq_id=4, last_token=10, position=3, num_drafts=2)]
    )
    bad = drafter_pb2.StepRequest(
        step_id=2,
        proposes=[
            drafter_pb2.ProposeItem(seq_id=5, last_token=10, position=3, num_drafts=0),
            drafter_pb2.ProposeItem(seq_id=6, last_token=1, position=1, num_drafts=1),
        ],
    )
    first, second = [wire.step_result_from_proto(r) for r in stub.Step(iter([good, bad]), timeout=10)]
    assert first.step_id == 1 and first.proposals[4].tokens == [11, 12]
    assert second.step_id == 2 and second.proposals[6].tokens == [2]  # the bad sequence did not fail the stream
    assert [(e.seq_id, e.code) for e in second.errors] == [(5, "INVALID_ARGUMENT")]
