"""Issue 9 through a real drafter service: a stranger cannot crash it, register another process's segment or
read files through it, and every bad row reference is refused with its own status code, leaving other
clients alone. The drafter runs in a spawned process, so a bus error fails a test instead of killing pytest."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import re
import secrets
import shutil
import signal

import grpc
import pytest
import torch

from specsplit.drafter_service.server import DrafterServer, serve
from specsplit.protos.v1 import common_pb2, drafter_pb2
from specsplit.shared import wire
from specsplit.shared.proposer import ProposeRequest
from specsplit.shared.transport import HEADER_BYTES, SHM_DIR, SHM_PREFIX, BufferExporter, encode_inline
from tests.drafter_peer import DrafterPeer
from tests.test_drafter_server import BUDGET, FEATURE_DIM, make_drafter

TIMEOUT = 60  # seconds a spawned process may take to start (it imports torch)
INT64_MAX, INT32_MAX = 2**63 - 1, 2**31 - 1


# --- the drafter service, in its own process ------------------------------------------------------


def _drafter_main(address: str, conn) -> None:
    drafter = make_drafter()
    served = serve(DrafterServer(drafter, head=drafter.head, device="cpu"), [address])
    conn.send("ready")
    try:
        conn.recv()  # until the parent says stop or goes away
    except EOFError:
        pass
    served.stop(None)


class SpawnedDrafter:
    def __init__(self, address: str) -> None:
        ctx = mp.get_context("spawn")
        self.address = address
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_drafter_main, args=(address, child_conn), daemon=True)
        self.process.start()
        assert self.conn.poll(TIMEOUT) and self.conn.recv() == "ready"
        self.channel = grpc.insecure_channel(address)

    def alive(self) -> bool:
        return self.process.is_alive()

    def died_of(self) -> str:
        self.process.join(5)
        code = self.process.exitcode
        return f"the drafter exited with {code}" + (f" ({signal.Signals(-code).name})" if code and code < 0 else "")

    def stop(self) -> None:
        self.channel.close()
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    holder = {}
    directory = tmp_path_factory.mktemp("drafter")

    def get() -> SpawnedDrafter:
        current = holder.get("drafter")
        if current is None or not current.alive():  # a test that killed it does not take the others down
            if current is not None:
                current.stop()
            holder["drafter"] = SpawnedDrafter(f"unix:{directory}/drafter-{len(holder)}-{secrets.token_hex(2)}.sock")
        return holder["drafter"]

    yield get
    if "drafter" in holder:
        holder["drafter"].stop()


@pytest.fixture
def drafter(spawned):
    return spawned()


class Peer(DrafterPeer):
    """One process connecting to the drafter: its client id and the segments it created itself."""

    def __init__(self, drafter: SpawnedDrafter, name: str | None = None) -> None:
        super().__init__(drafter.channel, name)
        self.exporter = BufferExporter()

    def register(self, *descriptors) -> tuple[str, str]:
        protos = [d if not dataclasses.is_dataclass(d) else wire.descriptor_to_proto(d) for d in descriptors]
        return self.status("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(buffers=protos))

    def buffer(self, rows: int = 8, *, register: bool = True):
        """A fresh segment of rows x FEATURE_DIM float32 rows, numbered so a wrong slice shows."""
        buffer = self.exporter.create(rows, FEATURE_DIM)
        buffer.tensor.copy_(torch.arange(rows * FEATURE_DIM, dtype=torch.float32).view(rows, FEATURE_DIM))
        if register:
            assert self.register(buffer.describe()) == ("OK", "")
        return buffer

    def alloc(self, seq_id: int = 0) -> None:
        self.call("AllocState", wire.alloc_to_proto(seq_id, BUDGET))

    def stash(self, ref, seq_id: int = 0) -> tuple[str, str]:
        return self.status("Stash", wire.stash_to_proto(seq_id, ref))

    def close(self) -> None:
        self.exporter.close()


@pytest.fixture
def peers(drafter):
    made: list[Peer] = []

    def make(name: str | None = None) -> Peer:
        made.append(Peer(drafter, name))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


class Bystander:
    """Another target with a prefilled sequence: its drafts must not change whatever the others send."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        peer.alloc(0)
        prompt = torch.randn(4, FEATURE_DIM, generator=torch.Generator().manual_seed(3))
        peer.call("PrefillDrafter", wire.prefill_to_proto(0, wire.RowsOp((5, 6, 7, 8), encode_inline(prompt), 0)))
        self.before = self.drafts()

    def drafts(self) -> list[int]:
        reply = self.peer.call("Propose", wire.propose_to_proto([ProposeRequest(0, 9, 4, 3)]))
        return list(reply.proposals[0].tokens)

    def unharmed(self) -> None:
        assert self.drafts() == self.before


@pytest.fixture
def planted():
    """Create files under /dev/shm with valid-looking names (pid 1: never a live exporter of ours)."""
    paths: list[str] = []

    def plant() -> str:
        name = f"{SHM_PREFIX}1-{secrets.token_hex(8)}"
        paths.append(os.path.join(SHM_DIR, name))
        return name

    yield plant
    for path in paths:
        if os.path.lexists(path):
            os.unlink(path)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


# --- finding 1: a segment that shrinks after registration ----------------------------------------


@pytest.mark.parametrize("keep", [HEADER_BYTES, 0])
def test_a_segment_truncated_after_registration_is_refused_and_the_drafter_lives(drafter, peers, keep):
    bystander = Bystander(peers())
    attacker = peers()
    buffer = attacker.buffer(64, register=False)  # 16 KiB of rows: past the page the header sits in
    fd = os.open(_path(buffer.descriptor.name), os.O_RDWR)  # the creator keeps a handle on its own segment
    try:
        assert attacker.register(buffer.describe()) == ("OK", "")
        attacker.alloc(0)
        ref = buffer.ref(44, 4)
        os.ftruncate(fd, keep)  # the rows (and with keep=0 the generation word) are gone
        code, details = attacker.stash(ref)
    finally:
        os.close(fd)
    assert drafter.alive(), drafter.died_of()
    assert code == "FAILED_PRECONDITION", details
    assert "shrank" in details
    bystander.unharmed()
    again = attacker.buffer(8)  # the attacker's connection itself goes on with a sound segment
    assert attacker.stash(again.ref(0, 2)) == ("OK", "")


# --- finding 2: what a name may point at -----------------------------------------------------------


def test_a_symlink_to_a_valid_segment_is_refused(drafter, peers, planted, tmp_path):
    bystander = Bystander(peers())
    peer = peers()
    real = peer.buffer(8, register=False)
    copy = tmp_path / "elsewhere"
    shutil.copyfile(_path(real.descriptor.name), copy)  # header, token and rows: valid in every byte
    link = planted()
    os.symlink(copy, _path(link))
    code, details = peer.register(dataclasses.replace(real.describe(), name=link))
    assert code == "INVALID_ARGUMENT", details
    assert drafter.alive()
    bystander.unharmed()


def test_errors_do_not_leak_the_size_of_a_file_the_client_does_not_own(peers, planted, tmp_path):
    peer = peers()
    real = peer.buffer(1, register=False)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 101)  # smaller than the described buffer
    link = planted()
    os.symlink(secret, _path(link))
    code, details = peer.register(dataclasses.replace(real.describe(), name=link))
    assert code == "INVALID_ARGUMENT"
    assert not re.search(r"\b101\b", details), details


def _writable_by_others(path: str) -> None:
    os.chmod(path, 0o666)


def _owned_by_someone_else(path: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can hand a file to another user")
    os.chown(path, 65534, 65534)


@pytest.mark.parametrize("spoil", [_writable_by_others, _owned_by_someone_else])
def test_a_segment_others_could_write_or_own_is_refused(peers, spoil):
    peer = peers()
    buffer = peer.buffer(2, register=False)
    spoil(_path(buffer.descriptor.name))
    code, details = peer.register(buffer.describe())
    assert code == "INVALID_ARGUMENT", details


def test_a_fifo_named_like_a_segment_neither_hangs_nor_registers(drafter, peers, planted):
    bystander = Bystander(peers())
    peer = peers()
    real = peer.buffer(1, register=False)
    fifo = planted()
    os.mkfifo(_path(fifo), 0o600)
    code, details = peer.register(dataclasses.replace(real.describe(), name=fifo))
    assert code == "INVALID_ARGUMENT", details
    bystander.unharmed()


# --- finding 3: whose segment it is ---------------------------------------------------------------


def _as_stranger(descriptor, token: bytes = b""):
    """What anyone can learn of a segment from the /dev/shm listing (name, size), with a token of its own."""
    pb = wire.descriptor_to_proto(descriptor)
    pb.token = token
    return pb


@pytest.mark.parametrize("token", [b"", bytes(16), secrets.token_bytes(16)])
def test_another_process_segment_cannot_be_registered_without_its_token(peers, token):
    owner, stranger = peers(), peers()
    victim = owner.buffer(8, register=False)  # a live target's segment, not yet registered anywhere
    code, details = stranger.register(_as_stranger(victim.describe(), token))
    assert code == "INVALID_ARGUMENT", details
    assert owner.register(victim.describe()) == ("OK", "")  # the stranger's attempt spoiled nothing
    owner.alloc(0)
    assert owner.stash(victim.ref(0, 3)) == ("OK", "")


def test_a_registered_segment_cannot_be_registered_again_by_anyone(peers):
    owner, stranger = peers(), peers()
    victim = owner.buffer(8)
    code, details = stranger.register(victim.describe())  # even with the token (say it leaked)
    assert code == "INVALID_ARGUMENT", details
    again = dataclasses.replace(victim.describe(), buffer_id=victim.buffer_id + 100)
    assert owner.register(again)[0] == "INVALID_ARGUMENT"  # nor by its owner under a second id


# --- finding 8: a target killed with SIGKILL ------------------------------------------------------


def _target_main(address: str, conn) -> None:
    from specsplit.target_service.drafter_client import RemoteProposer

    proposer = RemoteProposer(address, max_batch=4)
    assert proposer.mode == "shm"
    conn.send(os.getpid())
    conn.recv()  # wait for the SIGKILL


def _segments(pid: int) -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}{pid}-")}


def test_a_target_killed_after_attaching_leaves_nothing_in_dev_shm(drafter):
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(target=_target_main, args=(drafter.address, child_conn), daemon=True)
    target.start()
    try:
        assert conn.poll(TIMEOUT), "the target did not attach"
        pid = conn.recv()
        os.kill(pid, signal.SIGKILL)
        target.join(TIMEOUT)
        assert target.exitcode == -signal.SIGKILL
        leftovers = _segments(pid)
        for name in leftovers:  # never leave them behind on this machine, pass or fail
            os.unlink(_path(name))
        assert not leftovers
    finally:
        if target.is_alive():
            target.kill()
    assert drafter.alive()


# --- every bad reference: its status code, and no effect on anyone else ----------------------------


def _stash_cases(buffer) -> list[tuple[str, common_pb2.RowRef, str]]:
    gen, n = buffer.generation, buffer.descriptor.rows
    raw = lambda offset, rows, generation=gen: common_pb2.RowRef(  # noqa: E731 - bypasses the domain checks
        buffer_id=buffer.buffer_id, row_offset=offset, rows=rows, generation=generation)
    return [
        ("offset = rows", raw(n, 1), "INVALID_ARGUMENT"),
        ("last row + 1", raw(n - 1, 2), "INVALID_ARGUMENT"),
        ("rows > buffer", raw(0, n + 1), "INVALID_ARGUMENT"),
        ("huge offset", raw(INT64_MAX, 1), "INVALID_ARGUMENT"),
        ("huge rows", raw(1, INT32_MAX), "INVALID_ARGUMENT"),
        ("offset + rows overflows int64", raw(INT64_MAX, INT32_MAX), "INVALID_ARGUMENT"),
        ("negative offset", raw(-1, 1), "INVALID_ARGUMENT"),
        ("most negative offset", raw(-(2**63), 2), "INVALID_ARGUMENT"),
        ("negative rows", raw(0, -1), "INVALID_ARGUMENT"),
        ("zero rows", raw(0, 0), "INVALID_ARGUMENT"),
        ("negative generation", raw(0, 1, -1), "INVALID_ARGUMENT"),
        ("future generation", raw(0, 1, gen + 1), "FAILED_PRECONDITION"),
        ("huge generation", raw(0, 1, INT64_MAX), "FAILED_PRECONDITION"),
        ("unknown buffer", common_pb2.RowRef(buffer_id=INT64_MAX, row_offset=0, rows=1, generation=gen),
         "INVALID_ARGUMENT"),
        ("buffer id 0", common_pb2.RowRef(buffer_id=0, row_offset=0, rows=1, generation=gen), "INVALID_ARGUMENT"),
    ]


def test_bad_references_are_refused_with_their_code_and_harm_nobody(peers):
    bystander = Bystander(peers())
    peer = peers()
    buffer = peer.buffer(8)
    peer.alloc(0)
    for what, ref, want in _stash_cases(buffer):
        code, details = peer.status("Stash", drafter_pb2.StashRequest(seq_id=0, rows=ref))
        assert code == want, (what, details)
    stale = buffer.ref(0, 2)
    buffer.bump()
    assert peer.stash(stale)[0] == "FAILED_PRECONDITION"
    assert peer.stash(buffer.ref(6, 2)) == ("OK", "")  # the last rows of the right generation still resolve
    bystander.unharmed()


def test_another_connections_buffer_id_is_unknown_here(peers):
    owner, other = peers(), peers()
    owner.buffer(4), owner.buffer(4)
    mine = other.buffer(4)
    owned = owner.exporter.get(2)
    other.alloc(0)
    assert owned.buffer_id != mine.buffer_id
    code, details = other.stash(owned.ref(0, 1))  # registered by `owner` only
    assert code == "INVALID_ARGUMENT" and "not registered" in details


def _descriptor_cases(peer: Peer, planted) -> list[tuple[str, object, str]]:
    good = peer.buffer(8, register=False).describe()
    base = wire.descriptor_to_proto(good)

    def variant(**fields):
        pb = wire.descriptor_to_proto(good)
        for key, value in fields.items():
            setattr(pb, key, value)
        return pb

    forged = peer.buffer(8, register=False)
    forged._header[3] = 1_000_000  # its own header claims more rows than the file holds
    fake_big = dataclasses.replace(forged.describe(), rows=1_000_000)
    missing = planted()
    return [
        ("more rows than the header", variant(rows=9), "INVALID_ARGUMENT"),
        ("rows overflow int64 bytes", variant(rows=INT64_MAX), "INVALID_ARGUMENT"),
        ("negative rows", variant(rows=-8), "INVALID_ARGUMENT"),
        ("other cols", variant(cols=FEATURE_DIM + 1), "INVALID_ARGUMENT"),
        ("larger than the segment", fake_big, "INVALID_ARGUMENT"),
        ("traversal", variant(name="../../etc/passwd"), "INVALID_ARGUMENT"),
        ("traversal after a valid prefix", variant(name=base.name + "/../x"), "INVALID_ARGUMENT"),
        ("garbage name", variant(name="specsplit-1-zz"), "INVALID_ARGUMENT"),
        ("NUL in the name", variant(name=base.name[:-1] + "\0"), "INVALID_ARGUMENT"),
        ("long name", variant(name="specsplit-1-" + "a" * 5000), "INVALID_ARGUMENT"),
        ("no such segment", variant(name=missing), "INVALID_ARGUMENT"),
        ("no name", variant(name=""), "INVALID_ARGUMENT"),
        ("shm with a CUDA handle", variant(mem_handle=b"x" * 64), "INVALID_ARGUMENT"),
        ("short CUDA handles", variant(kind=common_pb2.BUFFER_KIND_CUDA_IPC, mem_handle=b"x" * 3,
                                       event_handle=b"y" * 3, device_uuid="GPU-x"), "INVALID_ARGUMENT"),
        ("long CUDA handles", variant(kind=common_pb2.BUFFER_KIND_CUDA_IPC, mem_handle=b"x" * 65,
                                      event_handle=b"y" * 64, device_uuid="GPU-x"), "INVALID_ARGUMENT"),
        ("short token", _as_stranger(good, b"t" * 15), "INVALID_ARGUMENT"),
        ("other host", variant(host_id="elsewhere"), "INVALID_ARGUMENT"),
        ("buffer id 0", variant(buffer_id=0), "INVALID_ARGUMENT"),
    ]


def test_bad_registrations_are_refused_with_their_code_and_harm_nobody(peers, planted):
    bystander = Bystander(peers())
    peer = peers()
    for what, descriptor, want in _descriptor_cases(peer, planted):
        code, details = peer.register(descriptor)
        assert code == want, (what, details)
    buffer = peer.buffer(8)  # the connection is sound after all of them
    code, details = peer.register(buffer.describe())
    assert code == "ALREADY_EXISTS", details  # the same id twice on one connection
    peer.alloc(0)
    assert peer.stash(buffer.ref(4, 4)) == ("OK", "")
    bystander.unharmed()


def test_a_buffer_released_in_a_step_serves_that_step_and_is_unknown_after(peers):
    peer = peers()
    buffer = peer.buffer(8)
    peer.alloc(0)
    requests: queue.Queue = queue.Queue()
    responses = peer.stub.Step(iter(requests.get, None), metadata=peer.metadata)
    try:
        requests.put(wire.step_to_proto(wire.StepBatch(1, seqs=[wire.SeqStep(0, stash=buffer.ref(0, 2))],
                                                       release=(buffer.buffer_id,))))
        assert not wire.step_result_from_proto(next(responses)).errors
        requests.put(wire.step_to_proto(wire.StepBatch(2, seqs=[wire.SeqStep(0, stash=buffer.ref(2, 2))])))
        errors = wire.step_result_from_proto(next(responses)).errors
        assert [(e.seq_id, e.code) for e in errors] == [(0, "INVALID_ARGUMENT")]
    finally:
        requests.put(None)
        assert list(responses) == []



def test_unregistering_in_use_twice_or_for_another_connection_is_refused_or_harmless(peers):
    """Triton's unregister cases: a buffer released while its rows sit in a sequence's stash (they were
    copied: the commit goes on; the buffer's references are refused after), released twice, and a release
    naming another connection's buffer (refused; the owner's buffer keeps serving)."""
    bystander = Bystander(peers())
    owner, peer = peers(), peers()
    owner.buffer(8)
    theirs = owner.buffer(8)
    owner.alloc(0)
    buffer = peer.buffer(8)
    peer.alloc(0)
    assert theirs.buffer_id != buffer.buffer_id
    assert peer.stash(buffer.ref(0, 2)) == ("OK", "")
    def release(who: Peer, *ids: int) -> tuple[str, str]:
        return who.status("ReleaseBuffers", drafter_pb2.ReleaseBuffersRequest(buffer_ids=ids))

    assert release(peer, buffer.buffer_id) == ("OK", "")  # while its rows are stashed
    assert peer.status("Commit", wire.commit_to_proto(0, wire.CommitOp(2, 0, (5, 6)))) == ("OK", "")
    code, details = peer.stash(buffer.ref(2, 2))
    assert code == "INVALID_ARGUMENT" and "not registered" in details
    code, details = release(peer, buffer.buffer_id)  # twice
    assert code == "INVALID_ARGUMENT", details
    code, details = release(peer, theirs.buffer_id)  # the owner's id: unknown on this connection
    assert code == "INVALID_ARGUMENT", details
    assert owner.stash(theirs.ref(0, 2)) == ("OK", "")
    bystander.unharmed()
