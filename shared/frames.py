"""The Step stream over a unix socket, without gRPC: length-prefixed frames.

gRPC Python's streaming round trip costs ~0.3 ms on an idle host (its threads hand every message over
twice on each side); the same bytes as frames on a unix socket take ~0.08 ms. A drafter that offers
one (DrafterDescription.step_socket) takes the Step stream there from targets on its host; the
messages, their order and their rules are those of the gRPC stream.

A frame is a 4-byte little-endian length and that many bytes. The client's first frame is the hello
(HELLO, the client id, a newline, the token or nothing); then each frame is a StepRequest. Each
answer is one kind byte and the rest: ANSWER and a StepResponse, or ENDED and "CODE\\n" message (a
gRPC status name), after which the drafter closes the socket.
"""

from __future__ import annotations

import socket
import struct
import time

from specsplit.shared.errors import InvalidRequest

HELLO = b"specsplit-step/1\n"
ANSWER, ENDED = 0, 1
MAX_HELLO_BYTES = 4096
CHUNK_BYTES = 1 << 20  # the most one read asks for
_LENGTH = struct.Struct("<I")


class FrameTooLarge(InvalidRequest):
    grpc_code = "RESOURCE_EXHAUSTED"


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, limit: int, deadline: float | None = None) -> bytes:
    """The next frame's bytes. EOFError when the peer closed before a frame began, ConnectionError
    when it closed inside one, FrameTooLarge (nothing more read) past `limit` bytes, TimeoutError
    when the whole frame has not arrived by `deadline` (time.monotonic(); None: the socket's own
    timeout applies to each read). Memory grows with the bytes that arrive, not with the length the
    header claims."""
    header = _recv_exactly(sock, _LENGTH.size, deadline, eof_ok=True)
    (length,) = _LENGTH.unpack(header)
    if length > limit:
        raise FrameTooLarge(f"a frame of {length} bytes is over this stream's limit of {limit}")
    return _recv_exactly(sock, length, deadline)


def _recv_exactly(sock: socket.socket, count: int, deadline: float | None, *, eof_ok: bool = False) -> bytes:
    chunks, got = [], 0
    while got < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {count} bytes arrived in time")
            sock.settimeout(left)
        chunk = sock.recv(min(count - got, CHUNK_BYTES))
        if not chunk:
            if eof_ok and got == 0:
                raise EOFError("the peer closed the step socket")
            raise ConnectionError(f"the peer closed the step socket inside a frame ({got} of {count} bytes)")
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def hello(client_id: str, token: str | None) -> bytes:
    return HELLO + client_id.encode() + b"\n" + (token or "").encode()


def parse_hello(payload: bytes) -> tuple[str, str]:
    """(client id, token) of a hello frame; InvalidRequest for anything else."""
    if not payload.startswith(HELLO):
        raise InvalidRequest("the step socket's first frame must be its hello")
    try:
        client, token = payload[len(HELLO):].decode("utf-8").split("\n")
    except (UnicodeDecodeError, ValueError):
        raise InvalidRequest("a malformed step socket hello") from None
    if not client or len(client) > 128 or not client.isprintable():
        raise InvalidRequest("the step socket hello needs a printable client id of at most 128 characters")
    return client, token


def ended(code: str, message: str) -> bytes:
    return bytes([ENDED]) + f"{code}\n{message}".encode()


def parse_ended(payload: bytes) -> tuple[str, str]:
    code, _, message = payload[1:].decode("utf-8", "replace").partition("\n")
    return code, message
