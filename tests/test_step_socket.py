"""The Step stream over the drafter's step socket: the same drafts as over gRPC, and a socket that
bytes from anyone on the host cannot crash, stall or read through."""

from __future__ import annotations

import os
import random
import socket
import struct
import time

import pytest

from specsplit.drafter_service import step_socket
from specsplit.drafter_service.server import DrafterServer, serve
from specsplit.protos.v1 import drafter_pb2
from specsplit.shared import frames, wire
from specsplit.shared.errors import DrafterUnavailable
from specsplit.shared.proposer import ProposeRequest
from specsplit.shared.security import ClientSecurity, ServerSecurity
from specsplit.target_service.drafter_client import RemoteProposer
from tests.test_drafter_server import BUDGET, make_drafter, rows

TOKEN = "step-socket-token"


@pytest.fixture
def drafter(tmp_path):
    """A drafter served at unix:tmp/d.sock, its step socket beside it; yields (server object, address)."""
    made = make_drafter()
    server_obj = DrafterServer(made, head=made.head, device="cpu")
    address = f"unix:{tmp_path}/d.sock"
    server = serve(server_obj, [address])
    server_obj.served = server  # for a test that needs the step socket's server
    yield server_obj, address
    server.stop(None).wait()
    server_obj.close()


def drafts(proposer: RemoteProposer) -> list[list[int]]:
    """Two sequences prefilled, committed and proposed for, the same way on any proposer."""
    for seq_id in range(2):
        proposer.alloc(seq_id, BUDGET)
        proposer.prefill(seq_id, [3 + seq_id, 4, 5], rows(3, seq_id))
    out = [p.tokens for p in proposer.propose([ProposeRequest(0, 6, 3, 3), ProposeRequest(1, 7, 3, 3)])]
    proposer.commit_verified_many([0, 1], rows(8, 9), [0, 4], [4, 4], [2, 0], [3, 3], [[6, 21, 22], [7]])
    out += [p.tokens for p in proposer.propose([ProposeRequest(0, 23, 6, 3), ProposeRequest(1, 24, 4, 3)])]
    for seq_id in range(2):
        proposer.free(seq_id)
    proposer.flush()
    return out


def connect(path: str, hello: bytes | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    if hello is not None:
        frames.send_frame(sock, hello)
    return sock


def ending(sock: socket.socket) -> tuple[str, str]:
    """The status the drafter ended the connection with (it must then close it)."""
    payload = frames.recv_frame(sock, 1 << 20)
    assert payload[0] == frames.ENDED, payload
    with pytest.raises(EOFError):
        frames.recv_frame(sock, 1 << 20)
    return frames.parse_ended(payload)


def still_serves(server_obj: DrafterServer, address: str, reference: list[list[int]]) -> None:
    proposer = RemoteProposer(address, max_batch=4)
    try:
        assert proposer.step_transport == "socket"
        assert drafts(proposer) == reference
    finally:
        proposer.close()
    deadline = time.monotonic() + 10
    while server_obj.num_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_obj.num_sessions == 0, "a connection's session outlived it"


def test_a_target_on_the_host_steps_over_the_socket_and_gets_the_drafts_grpc_gives(drafter):
    server_obj, address = drafter
    over_grpc = RemoteProposer(address, max_batch=4, step_socket=False)
    over_socket = RemoteProposer(address, max_batch=4)
    try:
        assert (over_grpc.step_transport, over_socket.step_transport) == ("grpc", "socket")
        assert over_socket.mode == "shm"  # one host: rows by shared memory, so the socket path is ours too
        assert drafts(over_socket) == drafts(over_grpc)
        assert server_obj.num_streams == 2
    finally:
        over_grpc.close()
        over_socket.close()


def reference(address: str) -> list[list[int]]:
    proposer = RemoteProposer(address, max_batch=4, step_socket=False)
    try:
        return drafts(proposer)
    finally:
        proposer.close()


HELLO = frames.hello("attacker", None)
ATTACKS = {
    # (what is sent, the status the drafter ends with)
    "http instead of frames": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "RESOURCE_EXHAUSTED"),
    "a hello of the wrong protocol": (struct.pack("<I", 5) + b"hello", "INVALID_ARGUMENT"),
    "a hello without a client id": (struct.pack("<I", len(frames.HELLO) + 1) + frames.HELLO + b"\n", "INVALID_ARGUMENT"),
    "a hello that is not text": (struct.pack("<I", len(frames.HELLO) + 3) + frames.HELLO + b"\xff\n\xfe",
                                 "INVALID_ARGUMENT"),
    "a 4 GiB frame after the hello": (struct.pack("<I", len(HELLO)) + HELLO + struct.pack("<I", 0xFFFFFFFF),
                                      "RESOURCE_EXHAUSTED"),
    "a frame that is no StepRequest": (struct.pack("<I", len(HELLO)) + HELLO + struct.pack("<I", 4) + b"\xff\xff\xff\xff",
                                       "INVALID_ARGUMENT"),
    "columns of unequal lengths": (
        struct.pack("<I", len(HELLO)) + HELLO + (lambda m: struct.pack("<I", len(m)) + m)(
            drafter_pb2.StepRequest(step_id=1, propose_columns=drafter_pb2.ProposeColumns(
                seq_ids=[1, 2], last_tokens=[3], positions=[4, 5], num_drafts=[3, 3])).SerializeToString()),
        "INVALID_ARGUMENT"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_bytes_end_only_their_own_connection(drafter, attack):
    server_obj, address = drafter
    expected_drafts = reference(address)
    sent, code = ATTACKS[attack]
    with connect(server_obj.step_socket) as sock:
        sock.sendall(sent)
        assert ending(sock)[0] == code
    still_serves(server_obj, address, expected_drafts)


def test_a_step_for_sequences_it_does_not_hold_is_answered_with_their_errors(drafter):
    server_obj, address = drafter
    with connect(server_obj.step_socket, HELLO) as sock:
        request = wire.step_to_proto(wire.StepBatch(7, proposes=(ProposeRequest(41, 5, 3, 3),)))
        frames.send_frame(sock, request.SerializeToString())
        payload = frames.recv_frame(sock, 1 << 20)
        assert payload[0] == frames.ANSWER
        answer = wire.step_result_from_proto(drafter_pb2.StepResponse.FromString(payload[1:]))
        assert answer.step_id == 7 and not answer.proposals
        assert [(e.seq_id, e.code) for e in answer.errors] == [(41, "NOT_FOUND")]
        assert server_obj.num_streams == 1
    still_serves(server_obj, address, reference(address))


def test_a_connection_cut_inside_a_frame_frees_its_session(drafter):
    server_obj, address = drafter
    with connect(server_obj.step_socket, HELLO) as sock:
        frames.send_frame(sock, wire.step_to_proto(wire.StepBatch(1)).SerializeToString())
        assert frames.recv_frame(sock, 1 << 20)[0] == frames.ANSWER
        assert server_obj.num_streams == 1
        sock.sendall(struct.pack("<I", 1000) + b"\x08\x02")  # 2 of 1000 bytes, then gone
    still_serves(server_obj, address, reference(address))


def test_silent_connections_are_dropped_and_capped(drafter, monkeypatch):
    """A connection that never says hello is closed after HELLO_SECONDS; past the cap on open
    connections, newcomers are refused at once: a stranger cannot hold the drafter's threads."""
    server_obj, address = drafter
    expected_drafts = reference(address)
    monkeypatch.setattr(step_socket, "HELLO_SECONDS", 1.0)
    (socket_server,) = server_obj.served.listeners
    silent = [connect(server_obj.step_socket) for _ in range(socket_server.max_connections)]
    try:
        with connect(server_obj.step_socket) as refused:
            assert ending(refused)[0] == "RESOURCE_EXHAUSTED"
        started = time.monotonic()
        for sock in silent:  # each closed without an answer once its hello is overdue
            with pytest.raises(EOFError):
                frames.recv_frame(sock, 1 << 20)
        assert time.monotonic() - started < 6
    finally:
        for sock in silent:
            sock.close()
    still_serves(server_obj, address, expected_drafts)


def test_with_a_token_the_hello_must_carry_it(tmp_path):
    made = make_drafter()
    server_obj = DrafterServer(made, head=made.head, device="cpu")
    address = f"unix:{tmp_path}/d.sock"
    server = serve(server_obj, [address], ServerSecurity(token=TOKEN))
    try:
        for token in (None, "wrong"):
            with connect(server_obj.step_socket, frames.hello("stranger", token)) as sock:
                frames.send_frame(sock, wire.step_to_proto(wire.StepBatch(1)).SerializeToString())
                assert ending(sock)[0] == "UNAUTHENTICATED"
        assert server_obj.num_sessions == 0
        proposer = RemoteProposer(address, max_batch=4, security=ClientSecurity(token=TOKEN))
        try:
            assert proposer.step_transport == "socket"
            assert len(drafts(proposer)) == 4
        finally:
            proposer.close()
    finally:
        server.stop(None).wait()
        server_obj.close()


def test_a_draining_drafter_refuses_newcomers_and_serves_its_targets_until_it_stops(drafter):
    server_obj, address = drafter
    expected_drafts = reference(address)
    proposer = RemoteProposer(address, max_batch=4)
    try:
        (socket_server,) = server_obj.served.listeners
        socket_server.stop_accepting()  # what Served.drain does first
        with connect(server_obj.step_socket) as late:  # refused at once: a hello could meet a closed socket
            assert ending(late)[0] == "UNAVAILABLE"
        assert drafts(proposer) == expected_drafts  # the connected target goes on
        server_obj.served.stop(None).wait()
        with pytest.raises(DrafterUnavailable):
            proposer.propose([ProposeRequest(0, 5, 3, 3)])
        assert not proposer.available()
    finally:
        proposer.close()
    assert not os.path.exists(server_obj.step_socket)


def test_stopping_ends_the_accept_thread(drafter):
    """A closed listener does not wake a thread blocked in accept on Linux: without the shutdown, the
    thread (and through it the whole drafter) would outlive every serve/stop cycle."""
    server_obj, _ = drafter
    (socket_server,) = server_obj.served.listeners
    assert socket_server._thread.is_alive()
    server_obj.served.stop(None).wait()
    socket_server._thread.join(5)
    assert not socket_server._thread.is_alive()


def test_stopping_ends_each_connections_session_before_it_returns(drafter):
    """The socket's close waits for its connections' threads: once the server has stopped, no thread of it
    still ends a session (and logs) behind the caller's back."""
    server_obj, address = drafter
    proposer = RemoteProposer(address, max_batch=4)
    try:
        proposer.alloc(0, BUDGET)
        proposer.prefill(0, [3, 4, 5], rows(3, 0))
        proposer.propose([ProposeRequest(0, 6, 3, 3)])  # (its Step stream is the socket's connection)
        (socket_server,) = server_obj.served.listeners
        (connection,) = socket_server._connections
        assert connection.thread.is_alive() and server_obj.num_sessions == 1
        server_obj.served.stop(None).wait()
        assert not connection.thread.is_alive() and server_obj.num_sessions == 0
    finally:
        proposer.close()


def test_a_hello_trickled_in_byte_by_byte_still_has_its_deadline(drafter, monkeypatch):
    server_obj, address = drafter
    monkeypatch.setattr(step_socket, "HELLO_SECONDS", 1.0)
    frame = struct.pack("<I", len(HELLO)) + HELLO
    started = time.monotonic()
    with connect(server_obj.step_socket) as sock:
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for byte in frame:  # each byte well inside the deadline, all of them far past it
                sock.send(bytes([byte]))
                time.sleep(0.25)
    assert time.monotonic() - started < 4
    still_serves(server_obj, address, reference(address))


class _FailingOnce:
    """A listener whose next accept fails as when the process is out of file descriptors."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener, self.failed = listener, False

    def accept(self):
        if not self.failed:
            self.failed = True
            raise OSError(24, "Too many open files")
        return self.listener.accept()

    def __getattr__(self, name):
        return getattr(self.listener, name)


def test_an_accept_that_fails_does_not_end_the_step_socket(drafter):
    server_obj, address = drafter
    (socket_server,) = server_obj.served.listeners
    socket_server._listener = _FailingOnce(socket_server._listener)  # used from the accept after the next
    with connect(server_obj.step_socket, HELLO) as sock:  # the accept already waiting takes this one
        frames.send_frame(sock, wire.step_to_proto(wire.StepBatch(1)).SerializeToString())
        assert frames.recv_frame(sock, 1 << 20)[0] == frames.ANSWER
    still_serves(server_obj, address, reference(address))
    assert socket_server._listener.failed


def test_random_frames_are_answered_or_refused_and_the_drafter_lives(drafter):
    """Frames of random bytes after a good hello (mostly unparsable; some parse into odd StepRequests):
    each is answered or ends its connection with a status, never a hang or a crash."""
    server_obj, address = drafter
    expected_drafts = reference(address)
    rng = random.Random(0)
    kinds = {frames.ANSWER: 0, frames.ENDED: 0}
    for _ in range(60):
        with connect(server_obj.step_socket, HELLO) as sock:
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
            frames.send_frame(sock, payload)
            answer = frames.recv_frame(sock, 1 << 20)
            kinds[answer[0]] += 1
    assert kinds[frames.ENDED] > 0 and sum(kinds.values()) == 60
    still_serves(server_obj, address, expected_drafts)
