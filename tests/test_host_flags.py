"""The DONE page in host memory (shared.host_flags): a sealed memfd the target passes with its step socket
hello, which the drafter maps only after checking it, so a target can neither crash the drafter through
it (a page it could shrink would turn the drafter's next store into SIGBUS) nor leave a descriptor open
there. Its flags are what device waits wait on, and the watchdog releases them with a store of its CPU.
(On the GPU, both sides' streams waiting on the page: tests/test_split_gpu.py.)"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import time
from types import SimpleNamespace

import pytest
import torch

from specsplit.drafter_service.server import DrafterServer
from specsplit.protos.v1 import drafter_pb2
from specsplit.shared import frames, wire
from specsplit.shared.device_waits import DeviceWaits
from specsplit.shared.errors import AlreadyExists, InvalidRequest
from specsplit.shared.host_flags import PAGE_BYTES, Flag, HostPage, check_page
from specsplit.shared.transport import BufferDescriptor, BufferImporter, BufferKind, BufferRole, RowRef, host_id
from specsplit.shared import device_waits
from tests.test_device_waits import _Device
from tests import test_step_socket
from tests.test_step_socket import connect, ending

ALL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@pytest.fixture
def device(monkeypatch):
    """Streams and stream operations stood for (tests/test_device_waits.py)."""
    fake = _Device()
    monkeypatch.setattr(device_waits, "torch", fake.torch)
    return fake


drafter = test_step_socket.drafter  # (its fixture: a drafter on the CPU, its step socket beside it)


def memfd(size: int = PAGE_BYTES, seals: int = ALL_SEALS) -> int:
    fd = os.memfd_create("test-page", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def is_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def opened(fd: int) -> int:
    """How many descriptors of this process are open on `fd`'s file (other threads' come and go: counted
    by the file, not by number)."""
    want = os.fstat(fd)
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue  # (closed since, or the listing's own)
        count += (info.st_dev, info.st_ino) == (want.st_dev, want.st_ino)
    return count


def test_a_page_made_here_and_adopted_there_is_one_memory():
    """The owner's page passes the adopter's checks, and a store through either side's flag is the other's."""
    page = HostPage.create(None)
    try:
        check_page(page.fd)
        other = HostPage.adopt(os.dup(page.fd), None)
        try:
            assert other.fd is None  # (the mapping holds the page: the adopter keeps no descriptor)
            other.flag(1).store(7)
            assert int(page.ints[1]) == 7
            page.flag(0).store(2**32 - 1)  # (a done value near the wrap: stored as the int32 it is)
            assert int(other.ints[0]) == -1
            with pytest.raises(IndexError):
                page.flag(PAGE_BYTES // 4)
        finally:
            other.close()
        assert other.closed
    finally:
        page.close()
    with pytest.raises(RuntimeError):
        page.flag(0)


@pytest.mark.parametrize("make, why", [
    (lambda: memfd(seals=0), "sealed against shrinking"),
    (lambda: memfd(seals=fcntl.F_SEAL_SHRINK), "sealed against shrinking"),  # (no F_SEAL_SEAL)
    (lambda: memfd(size=2 * PAGE_BYTES), f"{PAGE_BYTES} bytes"),
    (lambda: memfd(size=64), f"{PAGE_BYTES} bytes"),
    (lambda: memfd(seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL), "writable"),
    (lambda: os.open(f"/proc/self/fd/{memfd()}", os.O_RDONLY), "reading and writing"),
    (lambda: os.open(os.path.realpath(__file__), os.O_RDWR), "memfd that takes seals"),
    (lambda: os.pipe()[0], "not a socket, pipe or device"),
    (lambda: socket.socket().detach(), "not a socket, pipe or device"),
    (lambda: os.open("/dev/null", os.O_RDWR), "not a socket, pipe or device"),
], ids=["unsealed", "shrink-only", "two-pages", "short", "write-sealed", "read-only",
        "regular-file", "pipe", "socket", "device"])
def test_a_page_that_is_not_a_sealed_memfd_is_refused_and_its_descriptor_closed(make, why):
    fd = make()
    with pytest.raises(InvalidRequest, match=why):
        HostPage.adopt(fd, None)
    assert is_closed(fd)


def test_a_sealed_page_cannot_be_shrunk_under_the_drafter():
    page = HostPage.create(None)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(page.fd, 0)
        with pytest.raises(PermissionError):
            fcntl.fcntl(page.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        page.flag(0).store(3)
        assert int(page.ints[0]) == 3
    finally:
        page.close()


def test_the_hello_carries_one_descriptor_and_nothing_else_stays_open():
    """One descriptor with the hello's first bytes comes out beside the hello; two are refused (both
    closed), and one sent with a byte past the frame's length is closed by the kernel unread."""
    page = HostPage.create(None)
    try:
        a, b = socket.socketpair()
        with a, b:
            frames.send_hello(a, "client", "token", page.fd)
            payload, fd = frames.recv_hello(b, time.monotonic() + 5)
            assert frames.parse_hello(payload) == ("client", "token")
            assert os.fstat(fd).st_ino == os.fstat(page.fd).st_ino
            os.close(fd)

            held = opened(page.fd)  # (ours, and the one our mapping keeps)
            frame = struct.pack("<I", len(hello := frames.hello("client", None))) + hello
            a.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("ii", page.fd, page.fd))])
            with pytest.raises(InvalidRequest, match="one file descriptor"):
                frames.recv_hello(b, time.monotonic() + 5)
            b.recv(1 << 16)  # (the rest of that hello)
            assert opened(page.fd) == held

            a.sendall(frame[:4])
            a.sendmsg([frame[4:]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", page.fd))])
            payload, fd = frames.recv_hello(b, time.monotonic() + 5)
            assert fd is None and frames.parse_hello(payload) == ("client", "")
            assert opened(page.fd) == held
    finally:
        page.close()


@contextlib.contextmanager
def taking_pages(monkeypatch):
    """A drafter on the CPU that takes DONE pages (a GPU drafter with chained steps offers host_flags)."""
    monkeypatch.setattr(DrafterServer, "host_flags", property(lambda self: True))
    yield


def hello_with(path: str, fd: int, client: str = "paged") -> socket.socket:
    sock = connect(path)
    frames.send_hello(sock, client, None, fd)
    return sock


def step_answer(sock: socket.socket) -> drafter_pb2.StepResponse:
    frames.send_frame(sock, drafter_pb2.StepRequest(step_id=1).SerializeToString())
    payload = frames.recv_frame(sock, 1 << 20)
    assert payload[0] == frames.ANSWER, frames.parse_ended(payload)
    return drafter_pb2.StepResponse.FromString(payload[1:])


def socket_path(server_obj: DrafterServer) -> str:
    assert server_obj.step_socket
    return server_obj.step_socket


def page_descriptor(buffer_id: int = 5, cols: int = 1, **fields) -> BufferDescriptor:
    return BufferDescriptor(buffer_id, BufferKind.HOST_PAGE, fields.pop("name", ""), torch.int32, 1, cols, host_id(),
                            role=fields.pop("role", BufferRole.DONE), **fields)


def test_a_drafter_that_takes_no_page_ends_a_hello_that_passes_one(drafter):
    """On the CPU the drafter offers no host_flags: a hello passing a page ends INVALID_ARGUMENT, and the
    descriptor does not stay open in the drafter (here: this process)."""
    server_obj, _ = drafter
    page = HostPage.create(None)
    try:
        held = opened(page.fd)  # (ours, and the one our mapping keeps)
        with connect(socket_path(server_obj)) as sock:
            frames.send_hello(sock, "paged", None, page.fd)
            code, message = ending(sock)
            assert code == "INVALID_ARGUMENT" and "takes no DONE page" in message
            assert opened(page.fd) == held
    finally:
        page.close()
    assert not server_obj.num_sessions


@pytest.mark.parametrize("make", [lambda: memfd(seals=0), lambda: memfd(size=8 * PAGE_BYTES), lambda: os.pipe()[1]],
                         ids=["unsealed", "too-big", "pipe"])
def test_a_hello_passing_a_bad_page_ends_invalid_argument_and_the_drafter_serves_on(drafter, monkeypatch, make):
    server_obj, address = drafter
    with taking_pages(monkeypatch):
        fd = make()
        held = opened(fd)
        with hello_with(socket_path(server_obj), fd) as sock:
            code, message = ending(sock)
        assert code == "INVALID_ARGUMENT" and "DONE page" in message
        assert opened(fd) == held  # (the drafter kept no descriptor of it)
        os.close(fd)
        assert not server_obj.num_sessions
        page = HostPage.create(None)  # a good page next: the drafter took no harm
        try:
            with hello_with(socket_path(server_obj), page.fd) as sock:
                step_answer(sock)
                assert server_obj.num_sessions == 1
        finally:
            page.close()


def test_a_page_passed_with_the_hello_becomes_the_connections_done_buffer(drafter, monkeypatch):
    """The session holds the page; a HOST_PAGE DONE descriptor registers its flags (once a connection),
    which are the target's memory; the page goes with the session."""
    server_obj, _ = drafter
    with taking_pages(monkeypatch):
        page = HostPage.create(None)
        try:
            mine = opened(page.fd)
            with hello_with(socket_path(server_obj), page.fd) as sock:
                step_answer(sock)
                session = server_obj._sessions["paged"]
                assert opened(page.fd) == mine + 1  # (the drafter's mapping)
                assert session.page is not None and not session.page.closed
                session.register([page_descriptor()])
                flags = session.importer.done_target(5)
                assert len(flags) == 1 and flags[0].host is not None
                flags[0].store(41)
                assert int(page.ints[0]) == 41
                with pytest.raises(AlreadyExists, match="once a connection"):
                    session.register([page_descriptor(6)])
                with pytest.raises(InvalidRequest, match="holds no rows"):
                    session.importer.whole(5)
                held = session.page
                del flags, session
            deadline = time.monotonic() + 10
            while server_obj.num_sessions:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert held.closed and opened(page.fd) == mine  # (unmapped with the session)
        finally:
            page.close()


def test_a_host_page_descriptor_without_a_page_or_out_of_its_rules_is_refused():
    importer = BufferImporter()
    with pytest.raises(InvalidRequest, match="no host page came"):
        importer.register([page_descriptor()])
    for fields, why in ((dict(role=BufferRole.ROWS), "only a done buffer"),
                        (dict(cols=2), "one column"),  # (no written values: the drafter never waits on a page)
                        (dict(name="specsplit-1-0123456789abcdef"), "no segment name"),
                        (dict(device_uuid="GPU-1"), "no device or CUDA handles")):
        cols = fields.pop("cols", 1)
        with pytest.raises(InvalidRequest, match=why):
            page_descriptor(cols=cols, **fields)
    pb = wire.descriptor_to_proto(page_descriptor())
    assert wire.descriptor_from_proto(pb) == page_descriptor()
    importer.page = page = HostPage.create(None)
    try:
        importer.register([page_descriptor()])
        assert [f.address for f in importer.done_target(5)] == [page.ints.data_ptr()]
    finally:
        page.close()


def test_a_wait_on_a_host_page_flag_is_released_by_a_store_not_a_stream_write(device):
    """The watchdog releases a wait on a host page's flag with a store of our CPU (it reaches a stream
    waiting while its context loads a kernel module, where a stream write does not): no side stream write."""
    page = HostPage.create(None)
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = page.flag(0)
    device.host[flag.address] = flag.host
    try:
        waits.wait(flag, 5, time.perf_counter() + 0.1)
        deadline = time.monotonic() + 10
        while waits.failure is None:
            assert time.monotonic() < deadline, "the watchdog never released the wait"
            time.sleep(0.01)
        assert int(page.ints[0]) == 5 and waits.released == 1 and device.writes == []
        while waits.pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waits.wait(Flag.of(torch.zeros(1, dtype=torch.int32)), 1, time.perf_counter() + 60)  # device memory ...
        waits.release()
        assert [w[0] for w in device.writes] == ["side"]  # ... is still released by the side stream
    finally:
        waits.close()
        page.close()


def test_a_page_that_cannot_be_unregistered_safely_is_kept_mapped(monkeypatch):
    """Closing a registered page waits for our stream's last use of it; past RETIRE_POLL_SECONDS it stays
    registered and mapped for good (memory a stream may write is never unregistered under it)."""
    from specsplit.shared import host_flags

    page = HostPage.create(None)
    page.flag(0)  # (handed to a stream)
    page.device = torch.device("cuda", 0)  # (as if registered)
    never = SimpleNamespace(record=lambda stream: None, query=lambda: False)
    unregistered = []
    monkeypatch.setattr(host_flags, "RETIRE_POLL_SECONDS", 0.05)
    monkeypatch.setattr(host_flags.torch.cuda, "Event", lambda: never)
    monkeypatch.setattr(host_flags, "_driver",
                        lambda: SimpleNamespace(unregister=lambda index, address: unregistered.append(address)))
    page.close(stream=object())
    assert page.closed and unregistered == [] and page in host_flags._kept and page.ints is not None
    host_flags._kept.remove(page)
    page.device = None


def test_the_watchdog_makes_no_cuda_call_while_a_wait_on_a_host_page_holds_its_stream(device):
    """While a wait on a host page's flag is pending its stream may be held, and a CUDA call (an event's
    query) made then, while another thread loads a kernel module, may wait for that load, which waits for
    the held stream: the watchdog would never reach its release. It reads the page instead, stores the
    release at the deadline, and queries events only once every such flag holds its value."""
    page = HostPage.create(None)
    waits = DeviceWaits(device, torch.device("cpu"))
    early, held = page.flag(0), page.flag(1)
    for flag in (early, held):
        device.host[flag.address] = flag.host
    queried_while_held, armed = [], []
    query = device.torch.cuda.Event.query

    def watched_query(event):
        queried_while_held.append(bool(armed) and int(held.host.item()) < 9)
        return query(event)

    device.torch.cuda.Event.query = watched_query
    try:
        waits.wait(early, 3, time.perf_counter() + 60)
        early.store(3)  # (the peer, in time)
        waits.wait(held, 9, time.perf_counter() + 0.2)  # (never written by the peer)
        armed.append(True)
        deadline = time.monotonic() + 10
        while waits.failure is None:
            assert time.monotonic() < deadline, "the watchdog never released the wait"
            time.sleep(0.01)
        while waits.pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert int(held.host.item()) == 9 and waits.released == 1 and device.writes == []
        assert queried_while_held.count(True) == 0 and queried_while_held  # (queried after the store only)
    finally:
        device.torch.cuda.Event.query = query
        waits.close()
        page.close()


def _held_through_a_load(conn) -> None:
    """(A fresh process: no kernel loaded yet.) A stream waits on a host page's flag nobody writes, the
    host launches a kernel never launched here (its module's load waits for the held stream), and our
    watchdog releases the wait at its deadline with a store: does the launch return, and its result?"""
    try:
        _hold_through_a_load(conn)
    except BaseException as exc:  # noqa: BLE001 - said to the test, not taken for a hang
        conn.send(f"{type(exc).__name__}: {exc}")


def _hold_through_a_load(conn) -> None:
    from specsplit.shared.stream_ops import stream_ops

    device = torch.device("cuda", 0)
    page = HostPage.create(device)
    waits = DeviceWaits(stream_ops(), device)
    x = torch.rand(64, device=device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    waits.wait(page.flag(0), 7, started + 0.3)
    y = torch.erfinv(x)  # (a precompiled kernel nothing in this process has launched)
    launched = time.perf_counter() - started
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + 20
    while not done.query():
        if time.monotonic() > deadline:
            conn.send("the stream was not released within 20 s of the launch")
            os._exit(3)
        time.sleep(1e-3)
    conn.send((launched, waits.released, waits.failure is not None,
               bool(torch.allclose(y.cpu(), torch.erfinv(x.cpu()), atol=1e-4))))
    waits.close()
    page.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_wait_on_a_host_page_is_released_while_a_kernel_module_loads():
    """The hang that keeps device waits off by default (README, "Device waits"): a kernel's first launch
    while a stream waits loads its module, which waits for the held stream, and a release by a stream
    write never got through. A wait on the DONE page is released by the watchdog's store: the launch
    returns after the deadline, and its result is right."""
    import multiprocessing as mp

    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_held_through_a_load, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.poll(120), "no answer within 120 s: the process hung in the kernel's load"
        answer = parent.recv()
        assert isinstance(answer, tuple), answer
        launched, released, failed, right = answer
        print(f"the launch returned {launched * 1e3:.0f} ms after the wait was queued")
        assert released == 1 and failed and right
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


def test_a_closed_pages_flags_still_reach_its_memory_until_they_go():
    """A flag handed out keeps the page's mapping: closing the page does not unmap it under the flag (a store
    through a view of a closed mapping would be a SIGSEGV); the mapping goes with the last flag."""
    import gc
    import weakref

    page = HostPage.create(None)
    flag = page.flag(0)
    mapping = weakref.ref(page._map)
    page.close()
    flag.store(5)
    assert int(flag.host.item()) == 5
    del flag, page
    gc.collect()
    assert mapping() is None or mapping().closed


def test_an_unused_page_is_unregistered_at_once(monkeypatch):
    """A page no stream was given (a hello the drafter refused) is unregistered and unmapped without waiting
    for any stream: a refused page costs no thread's time and is never kept."""
    from specsplit.shared import host_flags

    page = HostPage.create(None)
    page.device = torch.device("cuda", 0)  # (as if registered)
    unregistered = []
    monkeypatch.setattr(host_flags.torch.cuda, "Event", lambda: pytest.fail("an unused page waited for a stream"))
    monkeypatch.setattr(host_flags, "_driver",
                        lambda: SimpleNamespace(unregister=lambda index, address: unregistered.append(address)))
    address = page.ints.data_ptr()
    page.close()
    assert unregistered == [address] and page not in host_flags._kept and page.ints is None


def test_a_store_the_stream_does_not_see_is_followed_by_a_stream_write(device, monkeypatch):
    """A peer that punched a hole in the page (fallocate) leaves our CPU's view apart from the memory our GPU
    reads: a release stored there, still not passed after STORE_FALLBACK, is written by the side stream too."""
    monkeypatch.setattr(device_waits, "STORE_FALLBACK", 0.05)
    page = HostPage.create(None)
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = page.flag(0)  # (not in device.host: the stand-in GPU reads device.memory, not our CPU's view)
    try:
        waits.wait(flag, 4, time.perf_counter() + 0.1)
        deadline = time.monotonic() + 10
        while waits.pending:
            assert time.monotonic() < deadline, "the stream never saw the release"
            time.sleep(0.01)
        assert int(page.ints[0]) == 4 and device.writes and device.writes[0] == ("side", flag.address, 4)
        assert waits.failure is not None and waits.released == 1
    finally:
        waits.close()
        page.close()


def test_a_page_a_wait_is_still_watched_on_is_not_closed_by_its_target():
    """The target closes a retired page only once its watchdog watches no wait on it (a late release is a
    stream write to its address): a page still watched stays registered, for good."""
    from specsplit.target_service.drafter_client import RemoteProposer

    page = HostPage.create(None)
    flag = page.flag(0)
    waits = SimpleNamespace(holds=lambda memory: memory is page)
    proposer = SimpleNamespace(_waits=waits)
    RemoteProposer._close_page(proposer, page)
    from specsplit.shared import host_flags
    assert page in host_flags._kept and page.ints is not None  # (kept registered and mapped, for good)
    host_flags._kept.remove(page)
    page.closed = False
    waits.holds = lambda memory: False
    RemoteProposer._close_page(proposer, page)
    assert page.closed
    del flag


def test_device_waits_hold_the_memory_of_a_wait_still_watched(device):
    page = HostPage.create(None)
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = page.flag(0)
    device.host[flag.address] = flag.host
    try:
        assert not waits.holds(page)
        waits.wait(flag, 2, time.perf_counter() + 60)
        assert waits.holds(page) and not waits.holds(object())
        flag.store(2)  # (the peer)
        assert waits.pending == 0 and not waits.holds(page)
    finally:
        waits.close()
        page.close()


def test_the_drafter_waits_for_written_values_only_in_device_memory():
    """A chained step's written value (drafter --device-waits) is waited for in its written buffer's element
    0 (beside a target's host page) or its DONE buffer's element 1, and never on a host page: a target could
    punch a hole in it, parting what the drafter's GPU reads from what its watchdog stores."""
    from specsplit.drafter_service.session import Session
    from specsplit.shared.wire import ChainStep

    page = HostPage.create(None)
    memory = torch.zeros(1, 2, dtype=torch.int32)
    device_flags = [Flag.of(memory[0, i:i + 1]) for i in range(2)]
    buffers = {4: [page.flag(0)], 6: device_flags, 8: device_flags[:1], 9: [page.flag(0)]}
    session = SimpleNamespace(importer=SimpleNamespace(done_target=buffers.__getitem__), device=torch.device("cpu"))

    def chain(done_buffer: int, written_buffer: int = 0) -> ChainStep:
        return ChainStep(seq_ids=(0,), ahead=(0,), num_drafts=3, feed=RowRef(5, 0, 3, 1), done_buffer=done_buffer,
                         done_value=1, written_value=2, written_buffer=written_buffer)

    try:
        assert Session._written_target(session, chain(4, 8), buffers[4]) is device_flags[0]
        assert Session._written_target(session, chain(6), buffers[6]) is device_flags[1]
        with pytest.raises(InvalidRequest, match="element 1"):
            Session._written_target(session, chain(4), buffers[4])  # (the page: one column)
        with pytest.raises(InvalidRequest, match="CUDA IPC memory"):
            Session._written_target(session, chain(4, 9), buffers[4])  # (a written buffer on the page)
    finally:
        page.close()


def test_a_flag_our_cpu_reads_written_is_not_taken_for_the_streams_word(device, monkeypatch):
    """A drafter that punched a hole in the page and wrote its done value there with its CPU: our CPU reads
    the value, our GPU (the page it pinned) does not. The wait is kept until its event is seen done, so its
    deadline still comes: released then, where our GPU reads it (a stream write), and reported."""
    monkeypatch.setattr(device_waits, "STORE_FALLBACK", 0.05)
    page = HostPage.create(None)
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = page.flag(0)  # (not in device.host: the stand-in GPU reads device.memory, apart from our CPU's view)
    try:
        waits.wait(flag, 6, time.perf_counter() + 0.2)
        flag.store(6)  # (the hostile drafter, into our CPU's view only)
        assert waits.pending == 1
        deadline = time.monotonic() + 10
        while waits.pending:
            assert time.monotonic() < deadline, "the wait our GPU never saw written was never released"
            time.sleep(0.01)
        assert device.writes == [("side", flag.address, 6)] and device.memory[flag.address] == 6
        assert "where our GPU reads it" in waits.failure and waits.released == 1
    finally:
        waits.close()
        page.close()


def test_a_due_wait_written_in_time_is_confirmed_not_released_while_another_holds_the_stream(device):
    """A wait whose deadline comes while a later one holds the stream (its flag not written yet), itself
    written in time: the watchdog makes no CUDA call then, so it looks again shortly, and once nothing holds
    the stream it sees the first one done. Nothing is released, no failure."""
    page = HostPage.create(None)
    waits = DeviceWaits(device, torch.device("cpu"))
    early, late = page.flag(0), page.flag(1)
    for flag in (early, late):
        device.host[flag.address] = flag.host
    try:
        waits.wait(early, 1, time.perf_counter() + 0.1)
        early.store(1)  # (the drafter, in time)
        waits.wait(late, 1, time.perf_counter() + 60)  # (not written yet: it holds the stream)
        time.sleep(0.3)  # (past the first deadline)
        assert waits.failure is None and waits.released == 0 and device.writes == []
        late.store(1)
        deadline = time.monotonic() + 10
        while waits.pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert waits.failure is None and waits.released == 0 and device.writes == []
    finally:
        waits.close()
        page.close()


def test_waits_on_a_host_page_written_in_time_are_forgotten_as_the_next_is_armed(device, monkeypatch):
    """A wait armed every step on the DONE page's flag, each written by the drafter before the next is armed:
    the ones seen done are forgotten as the next is armed (they piled up while the newest held the stream,
    and from their deadlines on the watchdog looked every RELEASE_AGAIN seconds, reading the page for each),
    and arming reads the page a few times, not once for every wait remembered."""
    page = HostPage.create(None)
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = page.flag(0)
    device.host[flag.address] = flag.host
    reads = []
    reached = device_waits._reached
    monkeypatch.setattr(device_waits, "_reached", lambda f, v: reads.append(v) or reached(f, v))
    try:
        waits.wait(flag, 1, time.perf_counter() + 30)  # (starts the watchdog, asleep until that deadline)
        time.sleep(0.05)
        looks, most = waits.looks, 0
        for value in range(1, 201):
            flag.store(value)  # (the drafter, in time)
            before = len(reads)
            waits.wait(flag, value + 1, time.perf_counter() + 30)
            most = max(most, len(reads) - before)
        time.sleep(0.05)
        assert most <= 3, f"arming a wait read the page {most} times"
        assert waits.pending == 1 and waits.looks == looks and waits.failure is None and device.writes == []
    finally:
        flag.store(201)
        waits.close()
        page.close()


def test_no_stream_write_while_a_wait_on_a_host_page_holds_the_stream(device, monkeypatch):
    """A released wait the stream has not passed, and behind it a wait on a host page not written yet: the
    fallback stream write of the first waits (a CUDA call while the stream may be held would keep the
    watchdog from the second's release). Once the second is written, the write goes out."""
    monkeypatch.setattr(device_waits, "STORE_FALLBACK", 0.1)
    page = HostPage.create(None)
    waits = DeviceWaits(device, torch.device("cpu"))
    stuck, behind = page.flag(0), page.flag(1)  # (stuck: apart from the GPU's view; behind: shared with it)
    device.host[behind.address] = behind.host
    try:
        waits.wait(stuck, 3, time.perf_counter() + 60)
        waits.release()  # (the drafter dropped: its wait released, our store not seen by the stand-in GPU)
        waits.wait(behind, 2, time.perf_counter() + 60)
        time.sleep(0.4)  # (past STORE_FALLBACK)
        assert device.writes == []
        behind.store(2)
        deadline = time.monotonic() + 10
        while waits.pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert device.writes and all(w == ("side", stuck.address, 3) for w in device.writes)
    finally:
        waits.close()
        page.close()


def test_a_page_whose_unregistration_fails_is_kept_mapped(monkeypatch):
    """The driver refusing to unregister a page (it is still registered): kept mapped, for good, not unmapped
    under its registration."""
    from specsplit.shared import host_flags

    page = HostPage.create(None)
    page.device = torch.device("cuda", 0)  # (as if registered)

    def refuse(index, address):
        raise OSError("cuMemHostUnregister returned CUresult 1")

    monkeypatch.setattr(host_flags, "_driver", lambda: SimpleNamespace(unregister=refuse))
    page.close()
    assert page in host_flags._kept and page.ints is not None
    host_flags._kept.remove(page)
    page.device = None


@pytest.mark.parametrize("asked, offers, ours, made, waits", [
    (None, True, True, True, True),  # the default: where the page goes, our stream waits on it
    (None, False, True, False, False),  # a drafter that takes no page: our host polls
    (None, True, False, False, False),  # --no-host-flags: our host polls
    (True, True, True, True, True),
    (True, False, True, False, True),  # --device-waits: into device memory where no page goes
    (False, True, True, False, False),  # --no-device-waits: no page made, our host polls
], ids=["default", "default-no-page-taken", "default-no-host-flags", "on", "on-device-memory", "off"])
def test_device_waits_by_default_only_where_the_host_page_goes(monkeypatch, tmp_path, asked, offers, ours, made,
                                                               waits):
    """RemoteProposer(device_waits=None), the target's default: its stream waits on the device only for done
    values in the host page (a wait there is released by a store of our CPU, which gets through a kernel
    module's load); where no page goes, its host polls. True also waits in device memory; False never."""
    from specsplit.target_service import drafter_client

    monkeypatch.setattr(drafter_client, "stream_ops", lambda: object())  # (a GPU's stream operations, stood for)
    monkeypatch.setattr(drafter_client, "ATTACH_WAIT", 0.05)  # (no drafter there: its first attach fails fast)
    proposer = drafter_client.RemoteProposer(f"unix:{tmp_path / 'none.sock'}", device_waits=asked, host_flags=ours)
    conn = SimpleNamespace(feed=object(), drafts=object(), page=None)
    desc = SimpleNamespace(done_flags=True, host_flags=offers)
    try:
        conn.page = proposer._page_for(conn, desc)
        assert (conn.page is not None) == made
        assert proposer._wants_done(conn, desc) == waits
        assert not proposer._wants_done(SimpleNamespace(feed=None, drafts=object(), page=conn.page), desc)
        assert not proposer._wants_done(conn, SimpleNamespace(done_flags=False, host_flags=offers))
        if made:  # a page refused or failed once: none is made again, and the default polls on our host
            proposer._page_refused = "refused"
            again = SimpleNamespace(feed=object(), drafts=object(), page=None)
            assert proposer._page_for(again, desc) is None
            assert proposer._wants_done(again, desc) == (asked is True)
    finally:
        if conn.page is not None:
            conn.page.close()
        proposer.close()


def test_the_target_service_leaves_device_waits_to_the_host_page_unless_told():
    """`specsplit target serve`: device waits where the host page goes by default; --device-waits and
    --no-device-waits decide for every connection."""
    from specsplit import cli
    from specsplit.services import TargetSettings

    assert TargetSettings.__dataclass_fields__["device_waits"].default is None
    parser = cli.build_parser()
    base = ["target", "serve", "--listen", "unix:/tmp/t.sock", "--drafter", "unix:/tmp/d.sock"]
    assert parser.parse_args(base).device_waits is None
    assert parser.parse_args(base + ["--device-waits"]).device_waits is True
    assert parser.parse_args(base + ["--no-device-waits"]).device_waits is False


def test_only_the_drafters_refusal_keeps_the_host_page_from_later_attaches():
    """An attach whose DONE buffer on the page fails because the drafter refused it (INVALID_ARGUMENT) passes no
    page again; one that failed because the drafter went away or was slow passes one at the next attach (by
    default, no page means no device waits: a passing failure must not cost them for the target's life)."""
    import grpc

    from specsplit.shared.errors import DrafterUnavailable
    from specsplit.target_service.drafter_client import _refuses_page

    class Failed(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

    assert _refuses_page(Failed(grpc.StatusCode.INVALID_ARGUMENT))
    assert _refuses_page(InvalidRequest("a DONE page out of its rules"))
    for passing in (Failed(grpc.StatusCode.UNAVAILABLE), Failed(grpc.StatusCode.DEADLINE_EXCEEDED),
                    Failed(grpc.StatusCode.CANCELLED), grpc.RpcError(), DrafterUnavailable("gone"),
                    ConnectionResetError("reset by peer")):
        assert not _refuses_page(passing), passing
