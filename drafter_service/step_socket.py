"""The Step stream over a unix socket beside the drafter's gRPC one (shared.frames has the framing).

One thread per connection reads a frame, answers it through `DrafterServer.step_once` (the gRPC
stream's own code: same session, same checks, same lock) and writes the answer: no hand-over between
threads, which is most of what a gRPC Python round trip costs. The socket lives in the gRPC socket's
private folder; with a token the hello must carry it. The hello may pass the target's DONE page
(`shared.host_flags`), which the drafter checks before it maps it. Every frame is checked before it is parsed (its
length against the stream's message limit), a connection must say hello within HELLO_SECONDS, and at
most `max_targets` + SPARE_CONNECTIONS connections are open at once: a stranger can neither stall
the drafter nor hold its threads.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time

from google.protobuf.message import DecodeError

from specsplit.protos.v1 import drafter_pb2
from specsplit.shared import frames
from specsplit.shared.errors import (
    CapacityExceeded, DrafterUnavailable, InvalidRequest, SpecsplitError, Unauthenticated,
)
from specsplit.shared.status import Throttle, status_of

log = logging.getLogger(__name__)
HELLO_SECONDS = 5.0
CLOSE_SECONDS = 5.0  # how long `close` waits, in all, for the connections' threads to end their sessions
SPARE_CONNECTIONS = 4
DRAIN_BYTES = 1 << 20  # read from a refused connection before closing it
_refusals = Throttle(per_minute=6)


class _Connection:
    """A connection's socket; `cancel` (eviction, shutdown) wakes its thread out of its read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.thread: threading.Thread | None = None  # the one serving it, once started

    def cancel(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer


class StepSocketServer:
    """Serves `server`'s Step stream at `path` until `close`."""

    def __init__(self, server, path: str, *, token: str | None, max_message_bytes: int) -> None:
        self.server, self.path, self.token = server, path, token
        self.max_message_bytes = max_message_bytes
        self.max_connections = server.max_targets + SPARE_CONNECTIONS
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()
        self._accepting = True
        self._closed = False
        if os.path.exists(path):
            os.unlink(path)  # a socket file left by a killed drafter
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)
            os.chmod(path, 0o600)
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._accept, name="step-socket-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as err:
                if self._closed:
                    return
                # Out of file descriptors, a connection aborted before it was taken...: this thread is the
                # only way in, so it goes on (a moment later, not in a busy loop).
                skipped = _refusals.admit()
                if skipped is not None:
                    log.warning("step socket: accept failed (%s); going on", err)
                time.sleep(0.05)
                continue
            with self._lock:
                if not self._accepting:
                    refusal = DrafterUnavailable("the drafter is shutting down")
                elif len(self._connections) >= self.max_connections:
                    refusal = CapacityExceeded(f"the step socket has {self.max_connections} connections open")
                else:
                    refusal, connection = None, _Connection(sock)
                    self._connections.add(connection)
            if refusal is not None:
                _refuse(sock, refusal, linger=0.0)  # this thread accepts for everyone: it never waits
                continue
            try:
                connection.thread = threading.Thread(target=self._serve, args=(connection,), name="step-socket",
                                                     daemon=True)
                connection.thread.start()
            except RuntimeError as err:  # no thread to be had
                with self._lock:
                    self._connections.discard(connection)
                _refuse(sock, CapacityExceeded(f"no thread for a step socket connection ({err})"), linger=0.0)

    def _serve(self, connection: _Connection) -> None:
        sock, session, page_fd = connection.sock, None, None
        try:
            try:  # the whole hello within HELLO_SECONDS, however slowly its bytes trickle in
                hello, page_fd = frames.recv_hello(sock, time.monotonic() + HELLO_SECONDS)
            except (OSError, EOFError, ConnectionError):
                return  # gone, or no hello within HELLO_SECONDS
            client, token = frames.parse_hello(hello)
            if self.token is not None and not hmac.compare_digest(token.encode(), self.token.encode()):
                raise Unauthenticated("the step socket hello carried no valid token")
            sock.settimeout(None)
            fd, page_fd = page_fd, None  # (adopt_page takes it, whatever it finds)
            page = self.server.adopt_page(fd) if fd is not None else None
            session, stream = self.server.open_stream(client, connection, page=page)
            while True:
                try:
                    payload = frames.recv_frame(sock, self.max_message_bytes)
                except (OSError, EOFError, ConnectionError):
                    return  # the target went away (or was evicted): its session ends below
                try:
                    request = drafter_pb2.StepRequest.FromString(payload)
                except DecodeError as err:
                    raise InvalidRequest(f"a StepRequest that does not parse ({err})") from None
                answer = self.server.step_once(session, stream, request)
                if answer is None:
                    return
                frames.send_frame(sock, bytes([frames.ANSWER]) + answer.SerializeToString())
        except SpecsplitError as err:
            _refuse(sock, err)
        except OSError:
            pass  # the target closed while its answer was written
        except Exception as err:  # noqa: BLE001 - a bug: logged (rate-limited) and reported as INTERNAL
            _refuse(sock, err)
        finally:
            if page_fd is not None:
                os.close(page_fd)
            if session is not None:
                self.server.end_stream(session, stream)
            with self._lock:
                self._connections.discard(connection)
            sock.close()

    def stop_accepting(self) -> None:
        """New connections are refused (a draining drafter); open ones go on."""
        with self._lock:
            self._accepting = False

    def close(self) -> None:
        """Stop listening and end every open connection; returns once their threads have ended their sessions
        (up to CLOSE_SECONDS in all: a step still running on the device may hold one longer)."""
        self.stop_accepting()
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (a close alone does not, on Linux)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.cancel()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        deadline = time.monotonic() + CLOSE_SECONDS
        for connection in connections:
            thread = connection.thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


def _refuse(sock: socket.socket, err: BaseException, linger: float = 1.0) -> None:
    """Tell the peer why its stream ends (best effort), as the gRPC stream's status would; `linger`:
    seconds to go on reading what the peer sends before closing (0: only what has arrived)."""
    code, message = status_of(err)
    skipped = _refusals.admit()
    if skipped is not None:
        log.info("step socket: ending a connection (%s: %s)%s", code.name, message,
                 f"; {skipped} more not logged" if skipped else "")
    try:
        sock.settimeout(1.0)
        frames.send_frame(sock, frames.ended(code.name, message))
        sock.shutdown(socket.SHUT_WR)
        # Closing with unread bytes would reset the connection and could lose the status just sent: read
        # what the peer sent on (at most DRAIN_BYTES, for at most `linger` seconds) first.
        drained, deadline = 0, time.monotonic() + linger
        sock.settimeout(linger)
        while drained < DRAIN_BYTES and (linger == 0 or time.monotonic() < deadline):
            chunk = sock.recv(65536)  # with no linger: BlockingIOError once nothing more is there
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass
    finally:
        sock.close()
