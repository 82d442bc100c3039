"""The Step stream over a unix socket, without gRPC: length-prefixed frames.

gRPC Python's streaming round trip costs ~0.3 ms on an idle host (its threads hand every message over
twice on each side); the same bytes as frames on a unix socket take ~0.08 ms. A drafter that offers
one (DrafterDescription.step_socket) takes the Step stream there from targets on its host; the
messages, their order and their rules are those of the gRPC stream.

A frame is a 4-byte little-endian length and that many bytes. The client's first frame is the hello
(HELLO, the client id, a newline, the token or nothing), which may carry one file descriptor as SCM_RIGHTS
with its first bytes (the DONE page, DrafterDescription.host_flags); then each frame is a StepRequest. Each
answer is one kind byte and the rest: ANSWER and a StepResponse, or ENDED and "CODE\\n" message (a
gRPC status name), after which the drafter closes the socket.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from specsplit.shared.errors import InvalidRequest

HELLO = b"specsplit-step/1\n"
ANSWER, ENDED = 0, 1
MAX_HELLO_BYTES = 4096
CHUNK_BYTES = 1 << 20  # the most one read asks for
_LENGTH = struct.Struct("<I")
_FD = struct.Struct("i")


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


def send_hello(sock: socket.socket, client_id: str, token: str | None, fd: int | None = None) -> None:
    """The hello frame, with `fd` passed beside its first bytes when given."""
    frame = _LENGTH.pack(len(payload := hello(client_id, token))) + payload
    if fd is None:
        sock.sendall(frame)
        return
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
    if sent < len(frame):
        sock.sendall(frame[sent:])


def recv_hello(sock: socket.socket, deadline: float) -> tuple[bytes, int | None]:
    """The hello frame and the descriptor passed with it (None: none). The descriptor is ours to close
    whatever happens next; InvalidRequest (none left open) when more than one came, or another kind of
    ancillary data. A descriptor sent with any later byte is closed by the kernel unread: only this read
    asks for ancillary data."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no hello in time")
    sock.settimeout(left)
    first, ancillary, flags, _ = sock.recvmsg(_LENGTH.size, socket.CMSG_SPACE(_FD.size), socket.MSG_CMSG_CLOEXEC)
    fds = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(data) - len(data) % _FD.size
            fds += [fd for (fd,) in _FD.iter_unpack(data[:whole])]
    if len(fds) > 1 or flags & socket.MSG_CTRUNC or len(ancillary) > len(fds):
        for fd in fds:
            _close_quietly(fd)
        raise InvalidRequest("the step socket hello may carry one file descriptor (the DONE page) and nothing else")
    fd = fds[0] if fds else None
    try:
        if not first:
            raise EOFError("the peer closed the step socket")
        header = first + _recv_exactly(sock, _LENGTH.size - len(first), deadline)
        (length,) = _LENGTH.unpack(header)
        if length > MAX_HELLO_BYTES:
            raise FrameTooLarge(f"a hello of {length} bytes is over the limit of {MAX_HELLO_BYTES}")
        return _recv_exactly(sock, length, deadline), fd
    except BaseException:
        if fd is not None:
            _close_quietly(fd)
        raise


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


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
