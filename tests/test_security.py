"""Who may call the services: the bearer token on every RPC but health, private unix socket folders,
mutual TLS on TCP (services in this process, on the tiny random target of tests/conftest.py)."""

from __future__ import annotations

import datetime
import logging
import os
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.client import Client, Retry, ServiceError
from specsplit.local import LocalSetup
from specsplit.protos.v1 import drafter_pb2, drafter_pb2_grpc, target_pb2, target_pb2_grpc
from specsplit.services import DrafterSettings, TargetSettings, start_drafter, start_target
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.security import (
    TOKEN_ENV, ClientSecurity, ClientTLS, ServerSecurity, ServerTLS, load_token, private_socket_dir,
)
from specsplit.shared.serving import CLIENT_HEADER, start_server
from specsplit.target_service.engine import EngineConfig

TOKEN = "s3cret-token-for-tests"
PROMPT = "Count from one to ten:"


# ---- the token and its file ---------------------------------------------------------------------

def test_token_file_must_be_private(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    with pytest.raises(InvalidRequest, match="accessible by group or others.*chmod 600"):
        load_token(path)
    path.chmod(0o640)
    with pytest.raises(InvalidRequest, match="accessible by group or others"):
        load_token(path)
    path.chmod(0o600)
    assert load_token(path) == TOKEN  # the file wins over the environment
    assert load_token(None) == "from-env"
    monkeypatch.delenv(TOKEN_ENV)
    assert load_token(None) is None
    path.write_text("  \n")
    with pytest.raises(InvalidRequest, match="empty"):
        load_token(path)


def test_cli_refuses_a_readable_token_file(tmp_path, capsys):
    from specsplit.cli import main

    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o604)
    assert main(["target", "serve", "--listen", f"unix:{tmp_path}/t.sock", "--auth-token-file", str(path)]) == 2
    assert "chmod 600" in capsys.readouterr().err


# ---- unix socket folders ------------------------------------------------------------------------

def test_socket_folder_is_made_private_or_refused(tmp_path, monkeypatch):
    fresh = tmp_path / "new" / "sockets"
    private_socket_dir(f"unix:{fresh}/d.sock")
    assert fresh.is_dir() and fresh.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: anyone may create a socket there
    with pytest.raises(InvalidRequest, match="writable by group or others"):
        private_socket_dir(f"unix:{shared}/d.sock")
    shared.chmod(0o770)
    with pytest.raises(InvalidRequest, match="writable by group or others"):
        private_socket_dir(f"unix:{shared}/d.sock")
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(InvalidRequest, match="belongs to another user"):
        private_socket_dir(f"unix:{fresh}/d.sock")


def test_a_service_refuses_a_shared_socket_folder(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(InvalidRequest, match="writable by group or others"):
        start_server(lambda server: None, [f"unix:{shared}/x.sock"], "x", max_workers=2, busy=lambda: False)


def test_tcp_without_a_token_warns_at_start(caplog):
    with caplog.at_level(logging.WARNING, logger="specsplit.shared.serving"):
        served = start_server(lambda server: None, [f"127.0.0.1:{free_port()}"], "x", max_workers=2,
                              busy=lambda: False)
    served.stop(None).wait()
    assert "anyone who can reach this port can use the service" in caplog.text


# ---- the token on both services -----------------------------------------------------------------

@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_chat_dir):
    """A drafter and a target that both require TOKEN; the target presents it to its drafter."""
    folder = tmp_path_factory.mktemp("secured")
    drafter_addr, target_addr = f"unix:{folder}/d/drafter.sock", f"unix:{folder}/t/target.sock"
    security = ServerSecurity(TOKEN)
    drafter_obj, drafter_server = start_drafter(DrafterSettings(
        (drafter_addr,), LocalSetup(target=str(tiny_chat_dir), drafter="random-dflash"), security=security))
    loop, target_server = start_target(TargetSettings(
        (target_addr,), LocalSetup(target=str(tiny_chat_dir)), drafter_addr, EngineConfig(),
        security=security, drafter_security=ClientSecurity(TOKEN)))
    yield drafter_addr, target_addr
    target_server.stop(grace=1).wait()
    loop.stop()
    drafter_server.stop(grace=1).wait()
    drafter_obj.close()


def unauthenticated(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in (info.value.details() or "")
    return info.value.details()


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)],
                         ids=["missing", "wrong", "not-bearer"])
def test_the_drafter_refuses_calls_without_the_token(secured, metadata):
    drafter_addr, _ = secured
    with grpc.insecure_channel(drafter_addr) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        metadata = ((CLIENT_HEADER, "stranger"), *metadata)
        unauthenticated(lambda: stub.Describe(drafter_pb2.DescribeDrafterRequest(), metadata=metadata, timeout=10))
        unauthenticated(lambda: list(stub.Step(iter([drafter_pb2.StepRequest()]), metadata=metadata, timeout=10)))


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),)], ids=["missing", "wrong"])
def test_the_target_refuses_calls_without_the_token(secured, metadata):
    _, target_addr = secured
    with grpc.insecure_channel(target_addr) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        unauthenticated(lambda: stub.Describe(target_pb2.DescribeTargetRequest(), metadata=metadata, timeout=10))
        unauthenticated(lambda: list(stub.Generate(target_pb2.GenerateRequest(), metadata=metadata, timeout=10)))
    with Client(target_addr, token="wrong", timeout=60) as client, pytest.raises(ServiceError) as info:
        client.generate(PROMPT)
    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED


def test_health_answers_without_a_token(secured):
    for address in secured:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_right_token_generates_through_both_services(secured):
    _, target_addr = secured
    with Client(target_addr, token=TOKEN, timeout=120) as client:
        result = client.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(result.token_ids) == 12
    assert result.stats.drafted > 0  # the target reached its drafter with the token


def test_generate_server_sends_the_token_file(secured, tmp_path, capsys, monkeypatch):
    from specsplit.cli import main

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    _, target_addr = secured
    argv = ["generate", "--server", target_addr, "--prompt", PROMPT, "--max-tokens", "3", "--json"]
    assert main(argv) == 2
    assert "missing or invalid bearer token" in capsys.readouterr().err
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    assert main([*argv, "--auth-token-file", str(path)]) == 0
    assert '"token_ids"' in capsys.readouterr().out


@pytest.mark.slow  # (11 s on the CPU: it spawns a pair; the default run stays under five minutes)
def test_a_spawned_pair_shares_its_token(tmp_path, tiny_chat_dir, monkeypatch):
    """specsplit.pair: both services get the spec's token (in their environment, never argv) and its
    client sends it; a token in this process's environment is not what they use."""
    from specsplit.pair import ServiceSpec, spawn

    monkeypatch.setenv(TOKEN_ENV, "not-the-pair-token")
    spec = ServiceSpec(target=str(tiny_chat_dir), drafter="random-dflash", auth_token=TOKEN, startup_timeout=120)
    with spawn(spec, tmp_path / "pair") as services:
        with services.client() as client:
            result = client.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
        assert result.stats.drafted > 0
        with Client(services.target_address, timeout=60) as client, pytest.raises(ServiceError) as info:
            client.generate(PROMPT)
        assert info.value.code is grpc.StatusCode.UNAUTHENTICATED


# ---- mutual TLS on TCP --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mutual_tls_on_tcp(tmp_path, tiny_chat_dir):
    pki = pytest.importorskip("cryptography", reason="the TLS test makes a throwaway CA with the "
                                                     "`cryptography` package (pip install cryptography)")
    del pki
    files = write_pki(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    loop, server = start_target(TargetSettings(
        (address,), LocalSetup(target=str(tiny_chat_dir)), None, EngineConfig(),
        security=ServerSecurity(TOKEN, ServerTLS(files["server.crt"], files["server.key"], files["ca.crt"]))))
    try:
        mutual = ClientTLS(files["ca.crt"], files["client.crt"], files["client.key"])
        with Client(address, token=TOKEN, tls=mutual, timeout=20) as client:
            assert len(client.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids) == 4
        for refused in (ClientTLS(files["ca.crt"]), None):  # no client certificate; plain TCP
            with Client(address, token=TOKEN, tls=refused, timeout=5, retry=Retry(attempts=1)) as client:
                with pytest.raises(ServiceError) as info:
                    client.generate(PROMPT, SamplingParams(max_tokens=2))
            assert info.value.code is grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=1).wait()
        loop.stop()


def write_pki(folder) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(name, key, issuer, issuer_key, *, ca=False, san=None):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    files = {}

    def write(name, data: bytes) -> None:
        path = folder / name
        path.write_bytes(data)
        files[name] = str(path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specsplit test CA")])
    ca = certificate("specsplit test CA", ca_key, ca_name, ca_key, ca=True)
    write("ca.crt", ca.public_bytes(serialization.Encoding.PEM))
    for role, san in (("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                      ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(f"{role}.crt", certificate(role, key, ca_name, ca_key, san=san).public_bytes(serialization.Encoding.PEM))
        write(f"{role}.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return files
