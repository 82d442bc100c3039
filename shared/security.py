"""Who may call a service: the bearer token, mutual TLS on TCP, and the private folder of a unix socket;
and how a client opens its channel (needs grpcio only, so the Python client can use it)."""

from __future__ import annotations

import hmac
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from specsplit.shared.errors import InvalidRequest

log = logging.getLogger(__name__)
TOKEN_ENV = "SPECSPLIT_AUTH_TOKEN"
AUTH_HEADER = "authorization"
# Probes (kubelet grpc probes, deploy/bin/health_probe.py) carry no token: health answers anyone.
UNAUTHENTICATED_PREFIX = "/grpc.health.v1.Health/"
# What a client accepts from the server it chose to call (drafts with sampled distributions can be large).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def load_token(path: str | os.PathLike | None) -> str | None:
    """The shared secret: the file at `path` if given, else $SPECSPLIT_AUTH_TOKEN, else None (no auth).

    The file must be private (no access for group or others): a token others can read is no secret.
    """
    if path is None:
        value = os.environ.get(TOKEN_ENV)
        return None if value is None else _nonempty(value, f"${TOKEN_ENV}")
    try:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            raise InvalidRequest(f"token file {path} is accessible by group or others (mode {stat.S_IMODE(mode):o}): "
                                 f"chmod 600 {path}")
        return _nonempty(Path(path).read_text().strip(), f"token file {path}")
    except OSError as err:
        raise InvalidRequest(f"cannot read token file {path}: {err.strerror}") from None


def _nonempty(token: str | None, where: str) -> str:
    token = (token or "").strip()
    if not token:
        raise InvalidRequest(f"{where} is empty: give a token, or none at all to serve without authentication")
    return token


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client adds to every call (none without a token)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


class TokenAuth(grpc.ServerInterceptor):
    """Refuses every call but health checks unless it carries `authorization: Bearer <token>`.

    The comparison takes constant time, and a refusal (UNAUTHENTICATED) says nothing about the token.
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_PREFIX):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get(AUTH_HEADER, "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return handler
        return _refusal(handler)


def _refuse(request_or_iterator, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that refuses the call."""
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](_refuse)


@dataclass(frozen=True)
class ServerTLS:
    """--tls-cert/--tls-key: the server's certificate chain and key (PEM); --tls-client-ca: when given,
    every client must present a certificate it signed (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials([(_read(self.key), _read(self.cert))], root_certificates=ca,
                                           require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    """--tls-ca: the CA that signed the server's certificate (default: the system's roots);
    --tls-cert/--tls-key: this client's certificate, for a server that asks for one."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidRequest("--tls-cert and --tls-key go together")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None)


@dataclass(frozen=True)
class ServerSecurity:
    """What a service asks of its callers: a token (None: anyone) and TLS on its TCP addresses."""

    token: str | None = None
    tls: ServerTLS | None = None


@dataclass(frozen=True)
class ClientSecurity:
    """What a client presents: the token and, on a TCP address, TLS."""

    token: str | None = None
    tls: ClientTLS | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return auth_metadata(self.token)


def grpc_target(address: str) -> str:
    """ADDR as the CLI takes it (host:port or unix:PATH) → a gRPC channel target."""
    if ":" in address:  # host:port, [v6]:port or unix:PATH
        return address
    raise InvalidRequest(f"address {address!r}: expected host:port or unix:PATH")


def is_unix(target: str) -> bool:
    return target.startswith("unix:")


def open_channel(target: str, options: list, tls: ClientTLS | None) -> grpc.Channel:
    """A channel to `target` (a grpc target string): TLS on TCP when configured, a plain unix socket."""
    if tls is None or is_unix(target):
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=options)


def private_socket_dir(address: str) -> None:
    """A unix socket's folder must be this user's alone: made 0700 if missing, refused if another user
    owns it or group or others may write to it (they could replace the socket with their own)."""
    folder = Path(address.removeprefix("unix:").removeprefix("//")).parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True)
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise InvalidRequest(f"cannot listen on {address}: its folder {folder} belongs to another user "
                             f"(uid {info.st_uid}): put the socket in a folder of your own (a missing folder is made 0700)")
    if info.st_mode & 0o022:
        raise InvalidRequest(f"cannot listen on {address}: its folder {folder} is writable by group or others "
                             f"(mode {stat.S_IMODE(info.st_mode):o}): put the socket in a folder only you can write "
                             "(a missing folder is made 0700)")


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise InvalidRequest(f"cannot read {path}: {err.strerror}") from None
