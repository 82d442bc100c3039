"""Row transport: rows cross processes through shared memory (and CUDA IPC on a GPU), refs are validated."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import secrets
import stat

import pytest
import torch

from specsplit.shared import transport
from specsplit.shared.errors import AlreadyExists, InvalidRequest, SpecsplitError, StateConflict, WritesPending
from specsplit.shared.transport import (
    SHM_DIR,
    SHM_PREFIX,
    TOKEN_BYTES,
    BufferDescriptor,
    BufferExporter,
    BufferImporter,
    BufferKind,
    BufferRole,
    InlineRows,
    RowRef,
    UnknownBuffer,
    choose_mode,
    decode_inline,
    encode_inline,
    host_id,
)

TIMEOUT = 60  # seconds a child may take to answer (spawn imports torch)


def _segments(pid: int | None = None) -> set[str]:
    prefix = SHM_PREFIX if pid is None else f"{SHM_PREFIX}{pid}-"
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


def _pattern(rows: int, cols: int, generation: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Rows whose every value names (generation, row, col), so a wrong slice cannot pass."""
    r = torch.arange(rows, device=device)[:, None] * 1000
    c = torch.arange(cols, device=device)[None, :]
    return (generation * 100_000 + r + c).to(dtype)


# --- the exporting child process (spawn: a fresh interpreter, no inherited mappings) -------------


def _exporter_main(conn, device: str) -> None:
    """Serve commands from the parent: create / bump / release / close / exit_without_close."""
    exporter = BufferExporter()
    while True:
        command, *args = conn.recv()
        if command == "create":
            rows, cols, dtype = args
            buffer = exporter.create(rows, cols, dtype, device)
            buffer.tensor.copy_(_pattern(rows, cols, buffer.generation, dtype, device))
            buffer.record()
            conn.send((buffer.describe(), buffer.ref(0, rows)))
        elif command == "bump":
            buffer_id, *cycles = args
            buffer = exporter.get(buffer_id)
            buffer.bump()
            if device != "cpu":  # default ~0.1 s: the write lands well after the ref is sent
                torch.cuda._sleep(cycles[0] if cycles else 200_000_000)
            rows, cols = buffer.tensor.shape
            buffer.tensor.copy_(_pattern(rows, cols, buffer.generation, buffer.tensor.dtype, device))
            buffer.record()
            conn.send(buffer.ref(1, rows - 1))
        elif command == "write_drafts":  # the importer's side of a DRAFTS buffer: write, then record
            descriptor, values, *cycles = args
            importer = BufferImporter()
            importer.register([descriptor])
            view, event = importer.drafts_target(descriptor.buffer_id)
            drafts = torch.tensor(values, dtype=torch.int32, device=device)  # (a host copy waits for the stream)
            torch.cuda._sleep(cycles[0] if cycles else 200_000_000)  # ~0.1 s: lands well after the answer
            view.copy_(drafts)
            event.record()
            conn.send("written")  # the parent reads after waiting on the event, not on us
            conn.recv()  # keep the mapping until the parent has read
            importer.close()
            conn.send("closed")
        elif command == "release":
            exporter.release(args[0])
            conn.send("released")
        elif command == "close":
            exporter.close()
            conn.send("closed")
            return
        elif command == "exit_without_close":
            conn.send("bye")
            return  # the RowBuffers' finalizers unlink at interpreter exit


class Child:
    """A spawned exporter process driven over a pipe."""

    def __init__(self, device: str = "cpu") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_exporter_main, args=(child_conn, device), daemon=True)
        self.process.start()

    def ask(self, *command):
        self.conn.send(command)
        if not self.conn.poll(TIMEOUT):
            raise TimeoutError(f"exporter did not answer {command[0]}")
        return self.conn.recv()

    def join(self) -> None:
        self.process.join(TIMEOUT)
        assert self.process.exitcode == 0


@pytest.fixture(scope="module")
def child():
    child = Child()
    yield child
    if child.process.is_alive():
        child.ask("close")
        child.join()


# --- across processes ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_cross_processes_through_shm(child, dtype):
    descriptor, ref = child.ask("create", 6, 5, dtype)
    assert descriptor.kind is BufferKind.SHM and descriptor.host_id == host_id()
    with BufferImporter() as importer:
        importer.register([descriptor])
        rows = importer.resolve(ref, cols=5, dtype=dtype)
        torch.testing.assert_close(rows, _pattern(6, 5, 1, dtype), rtol=0, atol=0)
        middle = importer.resolve(RowRef(descriptor.buffer_id, 2, 3, 1))
        torch.testing.assert_close(middle, _pattern(6, 5, 1, dtype)[2:5], rtol=0, atol=0)
    child.ask("release", descriptor.buffer_id)


def test_stale_generation_is_refused_after_the_owner_reuses_slots(child):
    descriptor, old = child.ask("create", 4, 3, torch.float32)
    with BufferImporter() as importer:
        importer.register([descriptor])
        importer.resolve(old)
        new = child.ask("bump", descriptor.buffer_id)
        assert new.generation == old.generation + 1
        with pytest.raises(StateConflict, match="stale"):
            importer.resolve(old)
        torch.testing.assert_close(importer.resolve(new), _pattern(4, 3, 2)[1:], rtol=0, atol=0)
        with pytest.raises(StateConflict):  # a generation the owner has not reached yet
            importer.resolve(RowRef(descriptor.buffer_id, 0, 1, new.generation + 1))
    child.ask("release", descriptor.buffer_id)


def test_a_view_given_before_its_writes_is_read_only_after_check_current(child):
    """`resolve(before_written=True)` gives a CUDA view while the owner's writes are pending (a gate stands for
    its event here), for work queued later; `check_current` is what lets that work go: WritesPending until
    the writes are seen done, StateConflict once the owner has moved the buffer to another generation or
    released it. A plain `resolve` never gives the view before the writes."""
    descriptor, ref = child.ask("create", 4, 3, torch.float32)

    class Gate:
        open = False

        def done(self):
            return self.open

    with BufferImporter() as importer:
        importer.register([descriptor])
        imported = importer._buffers[descriptor.buffer_id]
        gate = Gate()
        imported.tensor, imported.event = torch.zeros(4, 3), gate  # read as a CUDA view behind its event
        with pytest.raises(WritesPending):
            importer.resolve(ref)
        view = importer.resolve(ref, before_written=True)
        assert view.data_ptr() == imported.tensor.data_ptr()
        with pytest.raises(WritesPending):
            importer.check_current(ref)
        gate.open = True
        importer.check_current(ref)
        gate.open = False  # seen done once for this generation: not asked again
        importer.check_current(ref)
        new = child.ask("bump", descriptor.buffer_id)
        with pytest.raises(StateConflict, match="stale"):
            importer.check_current(ref)
        with pytest.raises(WritesPending):  # the new generation's writes not seen done yet
            importer.check_current(new)
        importer.release([descriptor.buffer_id])
        with pytest.raises(SpecsplitError):
            importer.check_current(new)
    child.ask("release", descriptor.buffer_id)


def test_registering_consumes_the_name_and_the_rows_stay_readable(child):
    descriptor, ref = child.ask("create", 2, 2, torch.float32)
    assert descriptor.name in _segments()
    importer = BufferImporter()
    importer.register([descriptor])
    assert descriptor.name not in _segments()  # a SIGKILLed owner leaves nothing behind from here on
    with pytest.raises(InvalidRequest, match="cannot open"):  # and nobody else can open it
        BufferImporter().register([descriptor])
    torch.testing.assert_close(importer.resolve(ref), _pattern(2, 2, 1), rtol=0, atol=0)
    child.ask("release", descriptor.buffer_id)  # the owner unlinks nothing that is not its file
    torch.testing.assert_close(importer.resolve(ref), _pattern(2, 2, 1), rtol=0, atol=0)  # the fd keeps the memory


@pytest.mark.slow  # (5-7 s on the CPU: child processes; test_buffer_security covers a killed target)
def test_child_leaves_no_segments_on_close_or_on_normal_exit():
    for farewell in ("close", "exit_without_close"):
        child = Child()
        descriptors = [child.ask("create", 3, 4, torch.float32)[0] for _ in range(2)]
        assert {d.name for d in descriptors} <= _segments(child.process.pid)
        child.ask(farewell)
        child.join()
        assert not _segments(child.process.pid), farewell


# --- validation (in one process: the exporter's segments are ordinary files) -------------------


@pytest.fixture
def pair():
    exporter = BufferExporter()
    buffer = exporter.create(8, 4, torch.float32)
    buffer.tensor.copy_(_pattern(8, 4, 1))
    importer = BufferImporter()
    importer.register([buffer.describe()])
    yield exporter, buffer, importer
    importer.close()
    exporter.close()
    assert not _segments(os.getpid())


def test_unknown_and_released_buffers_are_refused(pair):
    exporter, buffer, importer = pair
    with pytest.raises(UnknownBuffer):
        importer.resolve(RowRef(buffer.buffer_id + 1, 0, 1, 1))
    importer.release([buffer.buffer_id])
    with pytest.raises(UnknownBuffer):
        importer.resolve(buffer.ref(0, 1))
    with pytest.raises(UnknownBuffer):
        importer.release([buffer.buffer_id])
    exporter.release(buffer.buffer_id)
    with pytest.raises(UnknownBuffer):
        buffer.ref(0, 1)
    assert issubclass(UnknownBuffer, InvalidRequest)


@pytest.mark.parametrize("offset, rows", [(-1, 2), (0, 0), (0, -3), (7, 2), (8, 1), (0, 9), (2**63 - 1, 1),
                                          (1, 2**31 - 1), (2**63 - 1, 2**63 - 1), (-(2**63), 2**63 - 1)])
def test_rows_outside_the_buffer_are_refused(pair, offset, rows):
    _, buffer, importer = pair
    with pytest.raises(InvalidRequest):
        importer.resolve(RowRef(buffer.buffer_id, offset, rows, buffer.generation))
    with pytest.raises(InvalidRequest):
        buffer.ref(offset, rows)


def test_last_rows_of_the_buffer_resolve(pair):
    _, buffer, importer = pair
    torch.testing.assert_close(importer.resolve(buffer.ref(6, 2)), _pattern(8, 4, 1)[6:], rtol=0, atol=0)


def test_cols_and_dtype_must_match_what_the_caller_expects(pair):
    _, buffer, importer = pair
    ref = buffer.ref(0, 2)
    with pytest.raises(InvalidRequest, match="columns"):
        importer.resolve(ref, cols=5)
    with pytest.raises(InvalidRequest, match="bfloat16"):
        importer.resolve(ref, dtype=torch.bfloat16)
    assert importer.resolve(ref, cols=4, dtype=torch.float32).shape == (2, 4)


def test_registration_is_checked_and_all_or_nothing(pair):
    exporter, buffer, importer = pair
    with pytest.raises(AlreadyExists):
        importer.register([buffer.describe()])
    other = exporter.create(2, 2)
    good = other.describe()
    bad = dataclasses.replace(good, buffer_id=99, rows=1)  # rows disagree with the header
    fresh = BufferImporter()
    with pytest.raises(InvalidRequest, match="does not hold"):
        fresh.register([good, bad])
    assert len(fresh) == 0 and good.name in _segments()  # the good one was neither kept nor consumed
    other._header[3] = 3  # the owner's header claims more rows than its file holds
    with pytest.raises(InvalidRequest, match="rows need"):
        fresh.register([dataclasses.replace(good, rows=3)])
    other._header[3] = 2
    far = BufferDescriptor(good.buffer_id, BufferKind.SHM, good.name, torch.float32, 2, 2, "elsewhere")
    with pytest.raises(InvalidRequest, match="another host"):
        fresh.register([far])
    for name in ("../etc/passwd", "specsplit-1-zz"):
        with pytest.raises(InvalidRequest, match="segment name"):
            fresh.register([BufferDescriptor(7, BufferKind.SHM, name, torch.float32, 1, 1, good.host_id)])
    missing = good.name[:-4] + ("0000" if not good.name.endswith("0000") else "1111")
    with pytest.raises(InvalidRequest, match="cannot open"):
        fresh.register([BufferDescriptor(7, BufferKind.SHM, missing, torch.float32, 1, 1, good.host_id)])
    assert not os.path.exists(os.path.join(SHM_DIR, missing))  # opening never creates a segment
    fresh.register([good])
    assert good.buffer_id in fresh and fresh.with_role(BufferRole.ROWS) == [good]


def test_descriptors_and_refs_validate_their_fields():
    name, host = "specsplit-1-0123456789abcdef", "h"
    for bad in (
        dict(buffer_id=0),
        dict(rows=0),
        dict(cols=-1),
        dict(dtype=torch.int64),
        dict(name=""),
        dict(kind="nvlink"),
        dict(mem_handle=b"x"),
        dict(kind=BufferKind.CUDA_IPC),
        dict(kind=BufferKind.CUDA_IPC, device_uuid="GPU-1", mem_handle=b"m" * 63, event_handle=b"e" * 64),
        dict(kind=BufferKind.CUDA_IPC, device_uuid="GPU-1", mem_handle=b"m" * 64, event_handle=b"e" * 65),
        dict(token=b"t" * (TOKEN_BYTES - 1)),
    ):
        fields = dict(buffer_id=1, kind=BufferKind.SHM, name=name, dtype=torch.float32, rows=1, cols=1, host_id=host)
        with pytest.raises(InvalidRequest):
            BufferDescriptor(**{**fields, **bad})
    for args in ((0, 0, 1, 1), (1, -1, 1, 1), (1, 0, 0, 1), (1, 0, 1, -1)):
        with pytest.raises(InvalidRequest):
            RowRef(*args)


@pytest.mark.parametrize("token", [b"", bytes(TOKEN_BYTES), secrets.token_bytes(TOKEN_BYTES)])
def test_only_the_token_in_the_segments_header_registers_it(pair, token):
    exporter, _, _ = pair
    good = exporter.create(2, 2).describe()
    with pytest.raises(InvalidRequest, match="token"):
        BufferImporter().register([dataclasses.replace(good, token=token)])
    assert good.name in _segments()  # a refused registration consumes nothing
    with BufferImporter() as importer:
        importer.register([good])


def test_a_segment_is_registered_on_one_connection_at_a_time(pair, monkeypatch):
    exporter, _, _ = pair
    good = exporter.create(2, 2).describe()
    monkeypatch.setattr(transport._Segment, "unlink_name", lambda self: None)  # as if two raced to open it
    first, second = BufferImporter(), BufferImporter()
    first.register([good])
    with pytest.raises(AlreadyExists, match="registered already"):
        second.register([good])
    with pytest.raises(AlreadyExists, match="registered already"):  # nor twice on one connection
        first.register([dataclasses.replace(good, buffer_id=good.buffer_id + 50)])
    first.release([good.buffer_id])  # closed once no read holds it: free again
    second.register([good])
    second.close()


def test_only_regular_single_link_files_of_our_user_register(pair):
    exporter, _, _ = pair
    buffer = exporter.create(2, 2)
    path = os.path.join(SHM_DIR, buffer.descriptor.name)
    alias = f"{SHM_PREFIX}1-{secrets.token_hex(8)}"
    os.link(path, os.path.join(SHM_DIR, alias))  # a second name: the segment is no longer the owner's alone
    try:
        for name in (alias, buffer.descriptor.name):
            with pytest.raises(InvalidRequest, match="not a segment this service takes"):
                BufferImporter().register([dataclasses.replace(buffer.describe(), name=name)])
    finally:
        os.unlink(os.path.join(SHM_DIR, alias))
    os.symlink(path, os.path.join(SHM_DIR, alias))
    try:
        with pytest.raises(InvalidRequest, match="cannot open"):
            BufferImporter().register([dataclasses.replace(buffer.describe(), name=alias)])
    finally:
        os.unlink(os.path.join(SHM_DIR, alias))
    os.chmod(path, 0o620)
    with pytest.raises(InvalidRequest, match="not a segment this service takes"):
        BufferImporter().register([buffer.describe()])


def test_exported_segments_are_private_files_of_their_owner(pair):
    exporter, buffer, _ = pair
    other = exporter.create(1, 1)
    info = os.lstat(os.path.join(SHM_DIR, other.descriptor.name))
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert len(other.descriptor.token) == TOKEN_BYTES and other.descriptor.token != buffer.descriptor.token
    assert other.descriptor.token.hex() not in repr(other.descriptor)  # a secret stays out of logs


def test_exporter_generation_cycle(pair):
    _, buffer, importer = pair
    assert buffer.generation == 1
    first = buffer.ref(0, 1)
    assert buffer.bump() == 2 and buffer.ref(0, 1).generation == 2
    with pytest.raises(StateConflict):
        importer.resolve(first)
    assert importer.resolve(buffer.ref(0, 1)).shape == (1, 4)


def test_export_existing_copies_once_and_imports_whole(pair):
    exporter, _, importer = pair
    weight = torch.randn(10, 6).to(torch.bfloat16)
    buffer = exporter.export_existing(weight, BufferRole.TARGET_LM_HEAD)
    importer.register([buffer.describe()])
    (head,) = importer.with_role(BufferRole.TARGET_LM_HEAD)
    torch.testing.assert_close(importer.whole(head.buffer_id), weight, rtol=0, atol=0)
    with pytest.raises(InvalidRequest):
        exporter.export_existing(torch.zeros(3), BufferRole.TARGET_EMBEDDING)


def test_bad_exporter_arguments():
    with BufferExporter() as exporter:
        for args in ((0, 4), (4, 0)):
            with pytest.raises(InvalidRequest):
                exporter.create(*args)
        with pytest.raises(InvalidRequest):
            exporter.create(2, 2, torch.int32)
        with pytest.raises(InvalidRequest):
            exporter.create(2, 2, device="meta")
        with pytest.raises(UnknownBuffer):
            exporter.release(123)


# --- inline rows and mode choice ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inline_round_trip(dtype):
    rows = torch.randn(3, 7).to(dtype)
    inline = encode_inline(rows.t().contiguous().t())  # a non-contiguous source still encodes row-major
    assert len(inline.data) == 3 * 7 * dtype.itemsize
    torch.testing.assert_close(decode_inline(inline), rows, rtol=0, atol=0)
    with BufferImporter() as importer:
        torch.testing.assert_close(importer.resolve(inline, cols=7, dtype=dtype), rows, rtol=0, atol=0)
        with pytest.raises(InvalidRequest):
            importer.resolve(inline, cols=8)


def test_inline_validation():
    with pytest.raises(InvalidRequest):
        InlineRows(b"\0" * 11, torch.float32, 1, 3)
    with pytest.raises(InvalidRequest):
        InlineRows(b"", torch.float32, 0, 3)
    with pytest.raises(InvalidRequest):
        InlineRows(b"\0" * 8, torch.int64, 1, 1)
    with pytest.raises(InvalidRequest):
        encode_inline(torch.zeros(4))
    with pytest.raises(InvalidRequest):
        encode_inline(torch.zeros(2, 2, dtype=torch.int32))


def test_choose_mode():
    me = host_id()
    assert me and me == host_id()
    assert choose_mode(me, me, "GPU-a", "GPU-a") == "cuda_ipc"
    assert choose_mode(me, me, "GPU-a", "GPU-b") == "shm"
    assert choose_mode(me, me, "", "") == "shm"
    assert choose_mode(me, me, "", "GPU-a") == "shm"
    assert choose_mode(me, "other", "GPU-a", "GPU-a") == "inline"
    assert choose_mode("", "", "", "") == "inline"


def _report_host_id(queue) -> None:
    queue.put(host_id())


def test_host_id_agrees_across_processes():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_report_host_id, args=(queue,))
    process.start()
    assert queue.get(timeout=TIMEOUT) == host_id()
    process.join(TIMEOUT)


# --- CUDA IPC (run on a GPU host: pytest -m gpu) -------------------------------------------------


def _need_cuda_ipc():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def gpu_child():
    _need_cuda_ipc()
    child = Child("cuda:0")
    yield child
    if child.process.is_alive():
        child.ask("close")
        child.join()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ipc_rows_cross_processes(gpu_child, dtype):
    descriptor, ref = gpu_child.ask("create", 64, 48, dtype)
    assert descriptor.kind is BufferKind.CUDA_IPC and len(descriptor.mem_handle) == 64
    with BufferImporter() as importer:
        importer.register([descriptor])
        rows = importer.resolve(ref, cols=48, dtype=dtype)
        assert rows.device.type == "cuda"
        torch.testing.assert_close(rows.clone(), _pattern(64, 48, 1, dtype, "cuda"), rtol=0, atol=0)
    gpu_child.ask("release", descriptor.buffer_id)


@pytest.mark.gpu
def test_cuda_ipc_reader_reads_only_once_its_host_saw_the_owners_writes_done(gpu_child):
    """The owner's write of a new generation sleeps on its GPU (~1 s): the importer refuses to read it
    (WritesPending, no wait), a short await gives up, a long one sees it done, and then the rows read are
    the new generation's. Stale references are refused as ever."""
    descriptor, old = gpu_child.ask("create", 1024, 256, torch.float32)
    with BufferImporter() as importer:
        importer.register([descriptor])
        new = gpu_child.ask("bump", descriptor.buffer_id, 2_000_000_000)  # still sleeping on the GPU
        with pytest.raises(StateConflict):
            importer.resolve(old)
        with pytest.raises(WritesPending, match="not done"):
            importer.resolve(new)
        with pytest.raises(WritesPending, match="within 0.05 s"):
            importer.await_written([descriptor.buffer_id], 0.05)
        importer.await_written([descriptor.buffer_id, 12345], 60)  # unknown ids are skipped
        copy = importer.resolve(new).clone()
        torch.testing.assert_close(copy, _pattern(1024, 256, 2, device="cuda")[1:], rtol=0, atol=0)
        with pytest.raises(InvalidRequest):
            importer.resolve(RowRef(descriptor.buffer_id, 1000, 25, new.generation))
    gpu_child.ask("release", descriptor.buffer_id)
    assert descriptor.name not in _segments()


@pytest.mark.gpu
def test_cuda_ipc_refuses_an_invisible_gpu(gpu_child):
    descriptor, _ = gpu_child.ask("create", 2, 2, torch.float32)
    fields = {f: getattr(descriptor, f) for f in descriptor.__dataclass_fields__}
    ghost = BufferDescriptor(**{**fields, "device_uuid": "GPU-00000000-0000-0000-0000-000000000000"})
    with pytest.raises(InvalidRequest, match="not visible"):
        BufferImporter().register([ghost])
    gpu_child.ask("release", descriptor.buffer_id)


@pytest.mark.gpu
def test_cuda_drafts_buffer_is_written_by_its_importer_and_ordered_by_its_event(gpu_child):
    """The importer records the DRAFTS buffer's event after its (deliberately late, ~1 s) writes; the
    owner's host polls it: a short await gives up (False, no stream of ours waited), a long one sees
    the writes done, and the owner then reads them."""
    _need_cuda_ipc()
    with BufferExporter() as exporter:
        drafts = exporter.create(4, 6, torch.int32, "cuda", BufferRole.DRAFTS)
        values = (torch.arange(24).view(4, 6) * 7 + 3).tolist()
        assert gpu_child.ask("write_drafts", drafts.describe(), values, 2_000_000_000) == "written"
        assert not drafts.await_importer(0.05)
        assert drafts.await_importer(60)
        assert drafts.tensor.clone().tolist() == values
        assert gpu_child.ask("done") == "closed"
        with pytest.raises(StateConflict, match="drafts buffer"):
            exporter.create(2, 2, torch.float32, "cuda").await_importer(1)


def test_a_drafts_buffer_is_int32_cuda_memory_and_never_rows():
    """DRAFTS descriptors must be int32 CUDA IPC; int32 is no dtype for rows (buffers or inline)."""
    cuda = dict(device_uuid="GPU-1", mem_handle=bytes(64), event_handle=bytes(64))
    BufferDescriptor(1, BufferKind.CUDA_IPC, "specsplit-1-0123456789abcdef", torch.int32, 4, 4, "h",
                     role=BufferRole.DRAFTS, **cuda)
    bad = [
        dict(kind=BufferKind.CUDA_IPC, dtype=torch.float32, role=BufferRole.DRAFTS, **cuda),
        dict(kind=BufferKind.SHM, dtype=torch.int32, role=BufferRole.DRAFTS),
        dict(kind=BufferKind.CUDA_IPC, dtype=torch.int32, role=BufferRole.ROWS, **cuda),
        dict(kind=BufferKind.SHM, dtype=torch.int32, role=BufferRole.TARGET_EMBEDDING),
    ]
    for fields in bad:
        with pytest.raises(InvalidRequest):
            BufferDescriptor(buffer_id=1, name="specsplit-1-0123456789abcdef", rows=4, cols=4, host_id="h", **fields)
    with pytest.raises(InvalidRequest):
        InlineRows(b"\0" * 16, torch.int32, 2, 2)
    before = _segments()
    with BufferExporter() as exporter:  # nor made: on the CPU, in floats, or int32 rows (no segment is left)
        for dtype, role in ((torch.int32, BufferRole.DRAFTS), (torch.float32, BufferRole.DRAFTS),
                            (torch.int32, BufferRole.ROWS), (torch.int32, BufferRole.DONE),
                            (torch.float32, BufferRole.DONE)):
            with pytest.raises(InvalidRequest, match="drafts"):
                exporter.create(2, 2, dtype, "cpu", role)
    assert _segments() == before


class _Gate:
    """Stands for a peer's CUDA IPC event: done once opened (or after `opens_after` queries)."""

    def __init__(self, opens_after: int | None = None) -> None:
        self.open, self.queries, self.opens_after = False, 0, opens_after

    def done(self) -> bool:
        self.queries += 1
        return self.open or (self.opens_after is not None and self.queries > self.opens_after)


class _Segment:
    def __init__(self, generation: int) -> None:
        self.gen = generation

    def generation(self) -> int:
        return self.gen


def _gated_importer(gate: _Gate, generation: int = 3) -> tuple[BufferImporter, RowRef]:
    """An importer holding one 'CUDA' buffer (a CPU tensor behind a gate standing for its event)."""
    importer = BufferImporter()
    descriptor = BufferDescriptor(5, BufferKind.CUDA_IPC, "specsplit-1-0123456789abcdef", torch.float32, 4, 4,
                                  importer.host_id, device_uuid="GPU-1", mem_handle=bytes(64), event_handle=bytes(64))
    importer._buffers[5] = transport._Imported(descriptor, segment=_Segment(generation),
                                               tensor=torch.arange(16.0).view(4, 4), event=gate)
    return importer, RowRef(5, 1, 2, generation)


def test_rows_behind_a_pending_event_are_refused_until_the_host_sees_it_done():
    """A peer's CUDA rows are read only once an event query said its writes are done: resolve never
    waits (WritesPending), await_written polls with a deadline, and a generation seen done is not
    queried again."""
    gate = _Gate()
    importer, ref = _gated_importer(gate)
    with pytest.raises(WritesPending, match="generation 3 are not done"):
        importer.resolve(ref, cols=4)
    with pytest.raises(WritesPending, match="within 0.05 s"):
        importer.await_written([5], 0.05)
    assert gate.queries > 2  # it polled
    gate.open = True
    importer.await_written([5, 6], 1.0)  # 6: not registered, skipped
    queries = gate.queries
    assert importer.resolve(ref, cols=4).tolist() == [[4.0, 5, 6, 7], [8, 9, 10, 11]]
    importer.check_written(5)
    assert gate.queries == queries  # generation 3 was seen done once
    gate.open = False  # the owner's next generation: asked again
    importer._buffers[5].segment.gen = 4
    with pytest.raises(WritesPending):
        importer.resolve(RowRef(5, 0, 1, 4), cols=4)


class _FakeRuntime:
    """cupy.cuda.runtime's eventQuery as different cupy versions answer it: a status, or an exception."""

    class CUDARuntimeError(Exception):
        def __init__(self, status: int) -> None:
            super().__init__(status)
            self.status = status

    def __init__(self, answer) -> None:
        self.answer, self.cleared = answer, 0

    def eventQuery(self, ptr: int) -> int:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def getLastError(self) -> int:
        self.cleared += 1
        return 0


def test_an_event_query_tells_done_not_ready_and_broken_apart():
    """0 is done; cudaErrorNotReady (returned or raised) is not done, and leaves no error behind; any other
    status (a bad handle) is an error, never "not done yet", which a poll would wait out."""
    def cp(runtime):
        return type("cp", (), {"cuda": type("cuda", (), {"runtime": runtime})})

    assert transport._event_done(cp(_FakeRuntime(0)), 1)
    for answer in (600, _FakeRuntime.CUDARuntimeError(600)):
        runtime = _FakeRuntime(answer)
        assert not transport._event_done(cp(runtime), 1) and runtime.cleared == 1
    for answer in (400, _FakeRuntime.CUDARuntimeError(709)):
        with pytest.raises(StateConflict, match="cannot be queried"):
            transport._event_done(cp(_FakeRuntime(answer)), 1)


def test_polling_gives_up_at_its_deadline_and_sees_a_late_completion():
    assert transport.poll_until(lambda: True, 0.0)
    assert not transport.poll_until(lambda: False, 0.05)
    gate = _Gate(opens_after=300)  # past the first 2 ms of yielding: done while sleeping between queries
    assert transport.poll_until(gate.done, 5.0) and gate.queries == 301
    stopped = _Gate()
    assert not transport.poll_until(stopped.done, 60.0, stop=lambda: stopped.queries > 5)  # its caller left


def test_a_drafts_buffer_is_never_read_as_rows(monkeypatch):
    """A row reference into a registered DRAFTS buffer is refused (its ids are no feature rows), and
    only a DRAFTS buffer can be the target of drafts."""
    importer = BufferImporter()
    descriptor = BufferDescriptor(7, BufferKind.CUDA_IPC, "specsplit-1-0123456789abcdef", torch.int32, 4, 4,
                                  importer.host_id, role=BufferRole.DRAFTS, device_uuid="GPU-1",
                                  mem_handle=bytes(64), event_handle=bytes(64))
    rows = BufferDescriptor(8, BufferKind.SHM, "specsplit-1-0123456789abcdee", torch.float32, 4, 4,
                            importer.host_id)
    importer._buffers[7] = transport._Imported(descriptor, segment=None, tensor=torch.zeros(4, 4, dtype=torch.int32))
    importer._buffers[8] = transport._Imported(rows, segment=None)
    with pytest.raises(InvalidRequest, match="holds drafts"):
        importer.resolve(RowRef(7, 0, 1, 1), cols=4)
    with pytest.raises(InvalidRequest, match="not a drafts buffer"):
        importer.drafts_target(8)
    with pytest.raises(InvalidRequest):
        importer.drafts_target(9)


def test_a_done_buffer_is_one_int32_row_of_cuda_memory_never_rows_nor_drafts():
    """DONE descriptors (a chained step's done flag) must be int32 CUDA IPC memory of one row; a row
    reference into one is refused, it is no drafts buffer, and only a DONE buffer takes done values."""
    importer = BufferImporter()
    cuda = dict(device_uuid="GPU-1", mem_handle=bytes(64), event_handle=bytes(64))
    name = "specsplit-1-0123456789abcdef"
    done = BufferDescriptor(7, BufferKind.CUDA_IPC, name, torch.int32, 1, 1, importer.host_id, role=BufferRole.DONE,
                            **cuda)
    for fields in (dict(kind=BufferKind.CUDA_IPC, dtype=torch.float32, rows=1, **cuda),
                   dict(kind=BufferKind.SHM, dtype=torch.int32, rows=1),
                   dict(kind=BufferKind.CUDA_IPC, dtype=torch.int32, rows=2, **cuda)):
        with pytest.raises(InvalidRequest, match="done buffer"):
            BufferDescriptor(buffer_id=1, name=name, cols=1, host_id="h", role=BufferRole.DONE, **fields)
    drafts = dataclasses.replace(done, buffer_id=8, rows=4, cols=4, role=BufferRole.DRAFTS)
    importer._buffers[7] = transport._Imported(done, segment=None, tensor=torch.zeros(1, 1, dtype=torch.int32))
    importer._buffers[8] = transport._Imported(drafts, segment=None, tensor=torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(InvalidRequest, match="holds done"):
        importer.resolve(RowRef(7, 0, 1, 1), cols=1)
    with pytest.raises(InvalidRequest, match="not a drafts buffer"):
        importer.drafts_target(7)
    with pytest.raises(InvalidRequest, match="not a done buffer"):
        importer.done_target(8)
    with pytest.raises(InvalidRequest):
        importer.done_target(9)
    flags = importer.done_target(7)
    assert len(flags) == 1 and flags[0].address == importer._buffers[7].tensor.data_ptr() and flags[0].host is None


def _cuda_descriptor(rows: int, cols: int) -> BufferDescriptor:
    return BufferDescriptor(1, BufferKind.CUDA_IPC, "specsplit-1-0123456789abcdef", torch.float32, rows, cols, "h",
                            device_uuid="GPU-1", mem_handle=bytes(64), event_handle=bytes(64))


@pytest.mark.parametrize("ptr, base, size, fits", [
    (4096, 4096, 64, True),  # the whole allocation
    (4096, 4096, 63, False),  # one byte short
    (4096 + 16, 4096, 80, True),  # a view inside the allocation
    (4096 + 16, 4096, 79, False),
    (4096, 8192, 1 << 20, False),  # below the allocation
    (4096 + 64, 4096, 64, False),  # just past it
])
def test_a_cuda_view_must_fit_the_allocation_its_handle_opened(ptr, base, size, fits):
    descriptor = _cuda_descriptor(4, 4)  # 64 bytes; (base, size) stand for the driver's answer
    if fits:
        transport._check_fits_allocation(descriptor, ptr, base, size)
    else:
        with pytest.raises(InvalidRequest, match="do not fit"):
            transport._check_fits_allocation(descriptor, ptr, base, size)
    with pytest.raises(InvalidRequest, match="do not fit"):  # a size no allocation has
        transport._check_fits_allocation(_cuda_descriptor(2**61, 2**20), ptr, base, size)


@pytest.mark.gpu
def test_cuda_ipc_refuses_a_handle_declared_larger_than_its_allocation(gpu_child):
    small, _ = gpu_child.ask("create", 2, 4, torch.float32)
    large, _ = gpu_child.ask("create", 1024, 1024, torch.float32)  # 4 MiB: past any rounding of 32 bytes
    liar = dataclasses.replace(large, mem_handle=small.mem_handle, event_handle=small.event_handle)
    with pytest.raises(InvalidRequest, match="do not fit"):
        BufferImporter().register([liar])
    with BufferImporter() as importer:  # the truthful descriptors still register
        importer.register([small, large])
    gpu_child.ask("release", small.buffer_id)
    gpu_child.ask("release", large.buffer_id)


@pytest.mark.gpu
def test_cuda_export_existing_and_record_discipline():
    _need_cuda_ipc()
    with BufferExporter() as exporter:
        weight = torch.randn(32, 16, device="cuda", dtype=torch.bfloat16)
        buffer = exporter.export_existing(weight, BufferRole.TARGET_EMBEDDING)
        torch.testing.assert_close(buffer.tensor, weight, rtol=0, atol=0)
        buffer.bump()
        with pytest.raises(StateConflict, match="record"):
            buffer.ref(0, 1)  # a CUDA write must be recorded before it is referenced
        buffer.record()
        assert buffer.ref(0, 1).generation == 2


@pytest.mark.gpu
def test_a_cuda_buffer_is_recorded_once_per_generation():
    # Importers wait on the event once per generation they read, so a second record (writes after the
    # first) must come with a new generation.
    _need_cuda_ipc()
    exporter = BufferExporter()
    try:
        buffer = exporter.create(4, 8, torch.float32, "cuda:0")
        buffer.bump()
        buffer.record()
        with pytest.raises(StateConflict, match="already recorded"):
            buffer.record()
        buffer.bump()
        buffer.record()
    finally:
        exporter.close()
