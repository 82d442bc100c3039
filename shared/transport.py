"""Row transport: buffers registered once per connection, rows referenced per step (shm, CUDA IPC, inline).

This is the one module that touches shared-memory names, CUDA IPC handles and device pointers.

Terms:
- buffer: a 2-D tensor [rows, cols] owned by the exporting side (the target), shared with the
  importing side (the drafter) once per connection through a `BufferDescriptor`.
- generation: a counter per buffer that the owner bumps before it reuses the buffer's slots (each
  step's capture band). It lives in a 64-byte header in shared memory, so the importer reads the
  owner's current value and refuses a `RowRef` stamped with any other generation.
- row reference: (buffer_id, row_offset, rows, generation), a few bytes on the wire per step.
- inline rows: the rows themselves as bytes, when the processes share no memory.

CUDA buffers are plain cudaMalloc allocations made through cupy (IPC handles name whole
allocations, which torch's caching allocator does not guarantee), with an interprocess event the
owner records after writing. The importer reads a generation only once its host has seen that event
complete (`BufferImporter.await_written`, polled with a deadline, outside any lock that other peers'
calls need): a stream never waits on a peer's event, since a peer that records it behind GPU work
that never ends would stall that stream, and with it everyone the stream serves. The DRAFTS buffer's
event goes the other way (the importer records, the owner's host polls it: `RowBuffer.await_importer`).
cupy is imported only on CUDA paths. The importer must finish reading a step's rows before it
answers the step: the owner reuses the slots once it has the answer.

The importer (the drafter) treats every descriptor as a stranger's (issue 9):
- It never maps a client's segment. The owner can shrink its file at any time, and a read of a mapping
  past the new end is a SIGBUS that kills the whole drafter. Rows are copied out with pread into a fresh
  tensor instead (the drafter copied what it kept anyway); the generation is one 8-byte pread per
  reference, and a short read refuses that reference (FAILED_PRECONDITION). Sealed memfds would make a
  mapping safe, but they travel as file descriptors (SCM_RIGHTS), which gRPC cannot carry.
- It opens a name with O_NOFOLLOW | O_RDONLY | O_NONBLOCK and takes only a regular file of its own user,
  writable by no one else, with a single link; of a refused file it tells nothing (not its size).
- The owner writes 16 random bytes (the token) into the header at creation and sends them only in its
  descriptor. Names and sizes are visible to everyone in /dev/shm, the header only to the owner's user,
  which the drafter shares: so the token is compared (in constant time) before anything else of the
  segment is believed or told. A segment (device, inode) is registered on one connection at a time.
- Registering consumes the names: once every descriptor of a registration is open, the importer unlinks
  them (its file descriptors keep the memory alive, and the owner its mapping). A target SIGKILLed after
  attaching leaves nothing in /dev/shm, and nobody can open its segments afterwards. A target killed
  between creating its segments and registering them still leaves those behind.
- A CUDA IPC view is sized by the allocation the handle opened (cuMemGetAddressRange), never by the
  descriptor alone.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import hmac
import mmap
import os
import re
import secrets
import socket
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from specsplit.shared.errors import AlreadyExists, InvalidRequest, StateConflict, WritesPending
from specsplit.shared.host_flags import Flag, HostPage

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # of rows
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int32: 4}  # the header's dtype word

SHM_DIR = "/dev/shm"
SHM_PREFIX = "specsplit-"  # every segment we create starts with this (leftovers are easy to find)
_SHM_NAME = re.compile(r"specsplit-[0-9]{1,10}-[0-9a-f]{16}")  # refuse anything else: no path tricks
HEADER_BYTES = 64  # keeps the rows 64-byte aligned after the header
# Header: int64 words [magic, layout, generation, rows, cols, dtype code], then the 16-byte token.
_MAGIC, _LAYOUT = 0x5353_5242_5546_0001, 2
_GEN = 2  # the word the owner bumps and the importer checks
TOKEN_BYTES = 16
_TOKEN_AT = HEADER_BYTES - TOKEN_BYTES  # after the six words
IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
# The importer's open: never through a symlink, never for writing, never blocking on a FIFO.
_IMPORT_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class UnknownBuffer(InvalidRequest):
    """No buffer is registered under this id on this connection (or it was released)."""


class BufferKind(str, enum.Enum):
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    HOST_PAGE = "host_page"  # the DONE page passed with the Step socket's hello (shared.host_flags)


class BufferRole(str, enum.Enum):
    ROWS = "rows"  # feature rows the owner rewrites every step
    TARGET_EMBEDDING = "target_embedding"  # [vocab, hidden], written once
    TARGET_LM_HEAD = "target_lm_head"  # [vocab, hidden], written once
    DRAFTS = "drafts"  # int32 draft ids the importer writes (CUDA_IPC only), ordered by the buffer's event
    FEED = "feed"  # int32 anchors and positions of a chained step the owner writes [3, cols] (StepRequest.chain)
    DONE = "done"  # int32 [1, cols] (CUDA_IPC, or HOST_PAGE): element 0 is the value the importer's stream writes
    # after a chained step's work and the owner's stream waits for (ChainStep.done_value)


HEAD_ROLES = frozenset({BufferRole.TARGET_EMBEDDING, BufferRole.TARGET_LM_HEAD})
INT_ROLES = frozenset({BufferRole.DRAFTS, BufferRole.FEED, BufferRole.DONE})  # the buffers of token ids and positions
FEED_ROWS = 3  # a feed buffer's rows: the commit's positions, the anchors, their positions


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in DTYPES.values():
        raise InvalidRequest(f"row dtype must be one of {sorted(DTYPES)}, got {dtype}")


@dataclass(frozen=True)
class BufferDescriptor:
    """What the importer needs to map one buffer (the domain side of the protobuf message)."""

    buffer_id: int
    kind: BufferKind
    name: str  # shm segment: the header + rows (SHM) or the header alone (CUDA_IPC)
    dtype: torch.dtype
    rows: int
    cols: int
    host_id: str  # the owner's `host_id()`
    device_uuid: str = ""  # CUDA_IPC: the GPU holding the allocation
    mem_handle: bytes = b""  # CUDA_IPC: cudaIpcMemHandle_t
    event_handle: bytes = b""  # CUDA_IPC: cudaIpcEventHandle_t of the owner's write event
    role: BufferRole = BufferRole.ROWS
    token: bytes = field(default=b"", repr=False)  # the segment header's random bytes; a secret of the owner's

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _enum(BufferKind, self.kind, "buffer kind"))
        object.__setattr__(self, "role", _enum(BufferRole, self.role, "buffer role"))
        if self.kind is BufferKind.HOST_PAGE and self.role is not BufferRole.DONE:
            raise InvalidRequest(f"buffer {self.buffer_id}: the host page is only a done buffer")
        if self.role is BufferRole.DRAFTS:
            if self.dtype != torch.int32 or self.kind is not BufferKind.CUDA_IPC:
                raise InvalidRequest(f"buffer {self.buffer_id}: a drafts buffer is int32 CUDA_IPC memory")
        elif self.role is BufferRole.DONE:
            if self.dtype != torch.int32 or self.kind not in (BufferKind.CUDA_IPC, BufferKind.HOST_PAGE) \
                    or self.rows != 1:
                raise InvalidRequest(f"buffer {self.buffer_id}: a done buffer is int32 CUDA_IPC memory or the host "
                                     "page, [1, cols]")
            if self.kind is BufferKind.HOST_PAGE and self.cols != 1:
                # (the drafter's stream never waits on a page: a target could punch a hole in it, and a store
                # of our CPU would then no longer reach what the GPU reads)
                raise InvalidRequest(f"buffer {self.buffer_id}: the host page is a done buffer of one column "
                                     "(done values; written values go into device memory)")
        elif self.role is BufferRole.FEED:
            if self.dtype != torch.int32 or self.rows != FEED_ROWS:
                raise InvalidRequest(f"buffer {self.buffer_id}: a feed buffer is int32 [{FEED_ROWS}, cols]")
        else:
            _check_dtype(self.dtype)
        if self.buffer_id <= 0 or self.rows <= 0 or self.cols <= 0:
            raise InvalidRequest(f"buffer {self.buffer_id}: id, rows and cols must be positive")
        if (not self.name and self.kind is not BufferKind.HOST_PAGE) or not self.host_id:
            raise InvalidRequest(f"buffer {self.buffer_id}: name and host_id are required")
        cuda_fields = (self.device_uuid, self.mem_handle, self.event_handle)
        if self.kind is BufferKind.CUDA_IPC and not all(cuda_fields):
            raise InvalidRequest(f"buffer {self.buffer_id}: CUDA_IPC needs device_uuid, mem_handle and event_handle")
        if self.kind is not BufferKind.CUDA_IPC and any(cuda_fields):
            raise InvalidRequest(f"buffer {self.buffer_id}: an {self.kind.name} buffer carries no device or CUDA "
                                 "handles")
        if self.kind is BufferKind.HOST_PAGE and (self.name or self.token):
            raise InvalidRequest(f"buffer {self.buffer_id}: the host page has no segment name or token")
        if self.kind is BufferKind.CUDA_IPC and {len(self.mem_handle), len(self.event_handle)} != {IPC_HANDLE_BYTES}:
            raise InvalidRequest(f"buffer {self.buffer_id}: CUDA IPC handles are {IPC_HANDLE_BYTES} bytes each")
        if len(self.token) not in (0, TOKEN_BYTES):  # empty: built by hand, refused when registered
            raise InvalidRequest(f"buffer {self.buffer_id}: a segment token is {TOKEN_BYTES} bytes")

    @property
    def nbytes(self) -> int:
        return _nbytes(self.rows, self.cols, self.dtype)


def _nbytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    if dtype not in _DTYPE_CODES:
        raise InvalidRequest(f"a buffer holds {sorted(DTYPES)} rows or int32 drafts, not {dtype}")
    if rows <= 0 or cols <= 0:
        raise InvalidRequest(f"a buffer needs rows > 0 and cols > 0, got {rows} x {cols}")
    return rows * cols * dtype.itemsize


def _enum(cls: type[enum.Enum], value: object, what: str):
    try:
        return cls(value)
    except ValueError:
        raise InvalidRequest(f"unknown {what} {value!r}") from None


@dataclass(frozen=True)
class RowRef:
    """rows consecutive rows of a registered buffer, as written in `generation`."""

    buffer_id: int
    row_offset: int
    rows: int
    generation: int

    def __post_init__(self) -> None:
        if self.buffer_id <= 0:
            raise InvalidRequest(f"row reference names buffer {self.buffer_id}; ids are positive")
        if self.row_offset < 0 or self.rows <= 0 or self.generation < 0:
            raise InvalidRequest(
                f"row reference needs row_offset >= 0, rows > 0, generation >= 0; got "
                f"{self.row_offset}, {self.rows}, {self.generation}"
            )


@dataclass(frozen=True)
class InlineRows:
    """Rows sent by value: rows * cols elements of dtype, row-major, little-endian."""

    data: bytes
    dtype: torch.dtype
    rows: int
    cols: int

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        if self.rows <= 0 or self.cols <= 0:
            raise InvalidRequest(f"inline rows need rows > 0 and cols > 0, got {self.rows} x {self.cols}")
        want = self.rows * self.cols * self.dtype.itemsize
        if len(self.data) != want:
            raise InvalidRequest(
                f"inline rows {self.rows} x {self.cols} {self.dtype} need {want} bytes, got {len(self.data)}"
            )


RowSource = RowRef | InlineRows  # what a verb's `rows` argument arrives as


def encode_inline(tensor: torch.Tensor) -> InlineRows:
    """[rows, cols] tensor (any device) → InlineRows (copies to the host)."""
    _check_dtype(tensor.dtype)
    if tensor.dim() != 2:
        raise InvalidRequest(f"inline rows must be 2-D [rows, cols], got shape {tuple(tensor.shape)}")
    rows, cols = tensor.shape
    raw = tensor.detach().contiguous().cpu().view(torch.uint8)  # numpy has no bfloat16; bytes do
    return InlineRows(raw.numpy().tobytes(), tensor.dtype, rows, cols)


def decode_inline(inline: InlineRows, device: torch.device | str | None = None) -> torch.Tensor:
    """InlineRows → [rows, cols] tensor on `device` (the host when None)."""
    raw = torch.frombuffer(bytearray(inline.data), dtype=torch.uint8)  # a writable copy
    rows = raw.view(inline.dtype).view(inline.rows, inline.cols)
    return rows if device is None else rows.to(device)


def _check_expected(
    what: str, cols: int, dtype: torch.dtype, want_cols: int | None, want_dtype: torch.dtype | None
) -> None:
    if want_cols is not None and cols != want_cols:
        raise InvalidRequest(f"{what} has rows of {cols} columns, expected {want_cols}")
    if want_dtype is not None and dtype != want_dtype:
        raise InvalidRequest(f"{what} holds {dtype}, expected {want_dtype}")


# --- where this process runs -------------------------------------------------------------------


@functools.cache
def host_id() -> str:
    """Identity of the memory this process can share: hostname, boot, IPC and mount namespaces.

    Two processes agree exactly when they see the same /dev/shm and can open each other's CUDA IPC
    handles (containers with a private IPC or mount namespace differ). Empty when there is no
    /dev/shm, so `choose_mode` falls back to inline rows.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespaces = [os.readlink(f"/proc/self/ns/{ns}") for ns in ("ipc", "mnt")]
    except OSError:
        return ""
    if not os.path.isdir(SHM_DIR):
        return ""
    return "/".join([socket.gethostname(), boot, *namespaces])


def identity_digest(salt: str, identity: str) -> str:
    """`identity` (a host_id or device_uuid) as a drafter's Describe answers it: salted with the
    caller's client id, so equal identities compare equal and the raw one is never sent. Empty stays
    empty (no shared memory, or the CPU)."""
    if not identity:
        return ""
    return hashlib.sha256(f"{salt}\0{identity}".encode()).hexdigest()


def device_uuid(device: torch.device | str) -> str:
    """UUID of a CUDA device (stable across processes, unlike its index); empty for the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(uuid: str) -> int | None:
    """Index of the visible CUDA device with this UUID, or None."""
    if not uuid or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


def choose_mode(local_host_id: str, peer_host_id: str, local_device_uuid: str, peer_device_uuid: str) -> str:
    """How rows should travel between two processes: "cuda_ipc" | "shm" | "inline".

    CUDA IPC only when both run on the same GPU; two GPUs of one host go through shared memory
    (the importer may not see the exporter's GPU, and peer access is not guaranteed).
    """
    if not local_host_id or local_host_id != peer_host_id:
        return "inline"
    if local_device_uuid and local_device_uuid == peer_device_uuid:
        return "cuda_ipc"
    return "shm"


# --- shared-memory segments: the owner's side ----------------------------------------------------


def _shm_path(name: str) -> str:
    if not _SHM_NAME.fullmatch(name):
        raise InvalidRequest(f"not a specsplit shared-memory segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def _shm_create(nbytes: int) -> tuple[str, torch.Tensor, tuple[int, int]]:
    """A fresh segment of nbytes → (name, [nbytes] uint8 view, (device, inode)). The caller must unlink it."""
    name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = _shm_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        info = os.fstat(fd)
        segment = mmap.mmap(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return name, torch.frombuffer(segment, dtype=torch.uint8), (info.st_dev, info.st_ino)  # the view keeps the mapping


def _unlink_if(path: str, key: tuple[int, int]) -> None:
    """Unlink path if it still names the file `key` (the importer may have unlinked it, and the name be taken since)."""
    try:
        info = os.stat(path, follow_symlinks=False)
        if (info.st_dev, info.st_ino) == key:
            os.unlink(path)
    except OSError:  # gone already, or not ours to remove
        pass


def _write_header(raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, token: bytes) -> torch.Tensor:
    """Stamp a fresh segment's first 64 bytes; returns the [8] int64 header view (generation 1)."""
    header = raw[:HEADER_BYTES].view(torch.int64)
    header[: _TOKEN_AT // 8].copy_(torch.tensor([_MAGIC, _LAYOUT, 1, rows, cols, _DTYPE_CODES[dtype]]))
    raw[_TOKEN_AT:HEADER_BYTES].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
    return header


# --- shared-memory segments: the importer's side -------------------------------------------------


class _Claims:
    """Segments (device, inode) registered on some connection of this process: each on one at a time."""

    def __init__(self) -> None:
        self._held: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def take(self, key: tuple[int, int], descriptor: BufferDescriptor) -> None:
        with self._lock:
            if key in self._held:
                raise AlreadyExists(f"buffer {descriptor.buffer_id}: segment {descriptor.name!r} is registered already")
            self._held.add(key)

    def drop(self, key: tuple[int, int]) -> None:
        with self._lock:
            self._held.discard(key)


_CLAIMS = _Claims()  # process-wide, like the files it keeps apart


def _close_segment(fd: int, key: tuple[int, int]) -> None:
    os.close(fd)
    _CLAIMS.drop(key)


class _Segment:
    """A segment another process created, opened read-only and never mapped (see the module docstring).

    The file descriptor closes (and the claim drops) when the last reference goes, so a read in flight
    never meets a closed, or reused, descriptor.
    """

    def __init__(self, name: str, fd: int, key: tuple[int, int]) -> None:
        self.name, self.fd, self.key = name, fd, key
        self._closer = weakref.finalize(self, _close_segment, fd, key)

    def close(self) -> None:
        self._closer()

    def unlink_name(self) -> None:
        _unlink_if(os.path.join(SHM_DIR, self.name), self.key)

    def read_into(self, buffer, offset: int) -> None:
        """Fill the writable `buffer` from byte `offset` of the file; a file shrunk below it is refused."""
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            try:
                got = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as err:
                raise StateConflict(f"segment {self.name!r} cannot be read: {err.strerror}") from None
            if got == 0:
                raise StateConflict(f"segment {self.name!r} shrank below its registered size since it was registered")
            done += got

    def generation(self) -> int:
        word = bytearray(8)
        self.read_into(word, _GEN * 8)
        return int.from_bytes(word, sys.byteorder, signed=True)  # the owner wrote it as a native int64

    def read_rows(self, descriptor: BufferDescriptor, row_offset: int, rows: int) -> torch.Tensor:
        """A fresh [rows, cols] tensor with the rows row_offset.. as the file holds them now."""
        out = torch.empty(rows, descriptor.cols, dtype=descriptor.dtype)
        row_bytes = descriptor.cols * descriptor.dtype.itemsize
        self.read_into(out.view(-1).view(torch.uint8).numpy(), HEADER_BYTES + row_offset * row_bytes)
        return out


def _open_segment(descriptor: BufferDescriptor, data_bytes: int) -> _Segment:
    """Open and check the descriptor's segment: its header and then data_bytes of rows."""
    name = descriptor.name
    try:
        fd = os.open(_shm_path(name), _IMPORT_OPEN)
    except OSError as err:
        raise InvalidRequest(f"cannot open shared-memory segment {name!r}: {err.strerror}") from None
    try:
        info = os.fstat(fd)
        _check_file(descriptor, info)
        header = os.pread(fd, HEADER_BYTES, 0)
        _check_header(descriptor, header, info.st_size, data_bytes)
        key = (info.st_dev, info.st_ino)
        _CLAIMS.take(key, descriptor)
    except BaseException:
        os.close(fd)
        raise
    return _Segment(name, fd, key)


def _check_file(descriptor: BufferDescriptor, info: os.stat_result) -> None:
    """Only what an exporter of this user makes: nothing here may tell the caller about other files."""
    mine = stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1
    if not mine or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InvalidRequest(
            f"buffer {descriptor.buffer_id}: {descriptor.name!r} is not a segment this service takes (a regular "
            "file of its own user with one name, writable by no one else)"
        )


def _check_header(descriptor: BufferDescriptor, header: bytes, file_bytes: int, data_bytes: int) -> None:
    """The token first: only a caller that proved it created the segment learns why it does not fit."""
    if len(header) < HEADER_BYTES or not hmac.compare_digest(header[_TOKEN_AT:], descriptor.token):
        raise InvalidRequest(
            f"buffer {descriptor.buffer_id}: segment {descriptor.name!r} was not created for this descriptor "
            "(its header token differs)"
        )
    words = torch.frombuffer(bytearray(header[:_TOKEN_AT]), dtype=torch.int64).tolist()
    magic, layout, _, rows, cols, dtype_code = words
    want = (_MAGIC, _LAYOUT, descriptor.rows, descriptor.cols, _DTYPE_CODES[descriptor.dtype])
    if (magic, layout, rows, cols, dtype_code) != want:
        raise InvalidRequest(
            f"buffer {descriptor.buffer_id}: segment {descriptor.name!r} does not hold the described rows"
        )
    if file_bytes < HEADER_BYTES + data_bytes:
        raise InvalidRequest(
            f"buffer {descriptor.buffer_id}: segment {descriptor.name!r} has {file_bytes} bytes, "
            f"its rows need {HEADER_BYTES + data_bytes}"
        )


# --- CUDA (cupy, imported lazily) ---------------------------------------------------------------


def _cupy():
    try:
        import cupy
    except ImportError:
        raise InvalidRequest(
            "CUDA IPC buffers need cupy (cupy-cuda12x or cupy-cuda13x); use shm or inline rows"
        ) from None
    return cupy


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _cuda_view(array, device_index: int, descriptor: BufferDescriptor) -> torch.Tensor:
    """A cupy uint8 array over the allocation → [rows, cols] torch view (keeps the array alive)."""
    flat = torch.as_tensor(array, device=f"cuda:{device_index}")
    return flat.view(descriptor.dtype).view(descriptor.rows, descriptor.cols)


_CUDA_ERROR_NOT_READY = 600


def _event_done(cp, ptr: int) -> bool:
    """cudaEventQuery from the host: whether the work the event's last record follows is done (true for
    an event never recorded). Never blocks. Any status but done / not ready (an invalid handle, an
    error of earlier work) is StateConflict, not "not done": it would never turn done."""
    try:
        status = cp.cuda.runtime.eventQuery(ptr)
    except cp.cuda.runtime.CUDARuntimeError as err:  # cupy versions that raise for a status
        status = getattr(err, "status", None)
    if status == 0:
        return True
    if status == _CUDA_ERROR_NOT_READY:
        clear = getattr(cp.cuda.runtime, "getLastError", None)  # not an error: leave none behind
        if clear is not None:
            clear()
        return False
    raise StateConflict(f"a peer's CUDA event cannot be queried (CUDA status {status})")


def poll_until(done: Callable[[], bool], timeout: float, stop: Callable[[], bool] | None = None) -> bool:
    """Poll `done` from the host until it is true (True), or `timeout` seconds pass or `stop()` turns
    true (False): yielding the GIL for the first 5 ms (the usual wait is microseconds; a chained step's
    propose sent ahead waits out the target's verify, 1-3 ms), then sleeping in steps of 0.2 ms."""
    if done():
        return True
    started = time.monotonic()
    deadline = started + timeout
    while (now := time.monotonic()) < deadline and not (stop is not None and stop()):
        time.sleep(0 if now - started < 5e-3 else min(2e-4, max(0.0, deadline - now)))
        if done():
            return True
    return done()


class _CudaExport:
    """The owner's allocation and write event (cupy objects; freed when the last view dies)."""

    def __init__(self, nbytes: int, device_index: int) -> None:
        cp = _cupy()
        self.device_index = device_index
        with cp.cuda.Device(device_index):
            # Memory() is one plain cudaMalloc (no pool), so the IPC handle names exactly this buffer.
            self.memory = cp.cuda.memory.Memory(nbytes)
            self.array = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(self.memory, 0))
            self.mem_handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self.memory.ptr))
            self.event = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
            self.event_handle = bytes(cp.cuda.runtime.ipcGetEventHandle(self.event.ptr))

    def record(self, stream: torch.cuda.Stream | None) -> None:
        cp = _cupy()
        stream = stream or torch.cuda.current_stream(self.device_index)
        with cp.cuda.Device(self.device_index):
            cp.cuda.runtime.eventRecord(self.event.ptr, stream.cuda_stream)

    def done(self) -> bool:
        """Whether the work before the event's last record (ours, or a DRAFTS importer's) is done."""
        cp = _cupy()
        with cp.cuda.Device(self.device_index):
            return _event_done(cp, self.event.ptr)


AllocationRange = Callable[[int], tuple[int, int]]  # device pointer → (base, size) of its allocation


@functools.cache
def _cu_mem_get_address_range():
    function = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    function.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    function.restype = ctypes.c_int
    return function


def cuda_allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding ptr (driver API; its device's context is current)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    result = _cu_mem_get_address_range()(ctypes.byref(base), ctypes.byref(size), ptr)
    if result != 0:
        raise InvalidRequest(f"the CUDA driver cannot size the allocation behind an IPC handle (CUresult {result})")
    return base.value, size.value


def _check_fits_allocation(descriptor: BufferDescriptor, ptr: int, base: int, size: int) -> None:
    """Refuse a descriptor whose rows would run past the allocation [base, base + size) its handle opened."""
    if not base <= ptr < base + size or descriptor.nbytes > size - (ptr - base):
        raise InvalidRequest(
            f"buffer {descriptor.buffer_id}: {descriptor.rows} x {descriptor.cols} {descriptor.dtype} rows do not "
            "fit the device allocation its handle names"
        )


class _IpcMapping:
    """An opened IPC allocation and its true extent; closed when the last tensor viewing it is gone."""

    def __init__(self, mem_handle: bytes, device_index: int, allocation_range: AllocationRange) -> None:
        cp = _cupy()
        self.device_index = device_index
        with cp.cuda.Device(device_index):
            self.ptr = cp.cuda.runtime.ipcOpenMemHandle(mem_handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            try:  # right after the open, on this thread: the driver query finds the device's context current
                self.base, self.size = allocation_range(self.ptr)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Unmap now (a handle is opened once per process at a time); idempotent."""
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr is None:
            return
        try:
            cp = _cupy()
            with cp.cuda.Device(self.device_index):
                cp.cuda.runtime.ipcCloseMemHandle(ptr)
        except Exception:  # interpreter shutdown: the driver releases the mapping with the process
            pass

    def __del__(self) -> None:
        self.close()


class _IpcEvent:
    """The owner's write event, opened on the importing side."""

    def __init__(self, event_handle: bytes, device_index: int) -> None:
        cp = _cupy()
        self.device_index = device_index
        with cp.cuda.Device(device_index):
            self.ptr = cp.cuda.runtime.ipcOpenEventHandle(event_handle)

    def done(self) -> bool:
        """Whether the owner's writes before its last record are done (a host query; never blocks)."""
        cp = _cupy()
        with cp.cuda.Device(self.device_index):
            return _event_done(cp, self.ptr)

    def record(self) -> None:
        """Record the event on the current torch stream (a DRAFTS buffer: our writes, for the owner to wait on)."""
        cp = _cupy()
        stream = torch.cuda.current_stream(self.device_index)
        with cp.cuda.Device(self.device_index):
            cp.cuda.runtime.eventRecord(self.ptr, stream.cuda_stream)

    def __del__(self) -> None:
        try:
            _cupy().cuda.runtime.eventDestroy(self.ptr)
        except Exception:
            pass


def _open_cuda(
    descriptor: BufferDescriptor, allocation_range: AllocationRange = cuda_allocation_range
) -> tuple[torch.Tensor, _IpcEvent]:
    index = local_device_index(descriptor.device_uuid)
    if index is None:
        raise InvalidRequest(
            f"buffer {descriptor.buffer_id}: GPU {descriptor.device_uuid} is not visible here; send rows inline"
        )
    cp = _cupy()
    mapping = _IpcMapping(descriptor.mem_handle, index, allocation_range)
    try:
        _check_fits_allocation(descriptor, mapping.ptr, mapping.base, mapping.size)
    except BaseException:
        mapping.close()  # now: the same handle may be opened again only once this mapping is closed
        raise
    with cp.cuda.Device(index):
        memory = cp.cuda.UnownedMemory(mapping.ptr, descriptor.nbytes, mapping, index)
        array = cp.ndarray((descriptor.nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
    return _cuda_view(array, index, descriptor), _IpcEvent(descriptor.event_handle, index)


# --- exporter -----------------------------------------------------------------------------------


class RowBuffer:
    """A buffer the exporting side owns: `tensor` [rows, cols] plus its generation counter.

    Owner's cycle per reuse: `bump()`, write rows into `tensor`, `record()` (CUDA: after the writes
    are enqueued), then hand out `ref(...)`s. `ref` refuses a CUDA buffer not recorded since the
    last bump, so a forgotten record cannot turn into a silent race.
    """

    def __init__(self, descriptor: BufferDescriptor, tensor: torch.Tensor, header: torch.Tensor,
                 cuda: _CudaExport | None, segment_key: tuple[int, int]) -> None:
        self.descriptor = descriptor
        self.tensor = tensor  # [rows, cols]
        self._header = header.numpy()  # [8] int64 in shared memory; word _GEN is the generation (set through numpy:
        # a torch tensor's item assignment costs ~2.6 µs of host time, twice a chained step)
        self._generation = int(header[_GEN])  # only we write it: read back from here, not from the segment
        self._cuda = cuda
        self._recorded = cuda is None  # host writes are complete when they return
        self._released = False
        self._finalizer = weakref.finalize(self, _unlink_if, os.path.join(SHM_DIR, descriptor.name), segment_key)

    @property
    def buffer_id(self) -> int:
        return self.descriptor.buffer_id

    @property
    def generation(self) -> int:
        return self._generation

    def describe(self) -> BufferDescriptor:
        return self.descriptor

    def bump(self) -> int:
        """Start reusing the buffer's slots: references to the old generation become stale."""
        self._check_live()
        generation = self._generation = self._generation + 1
        self._header[_GEN] = generation
        self._recorded = self._cuda is None
        return generation

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        """CUDA: record the interprocess event on `stream` (default: current) after the writes.

        Once per generation: an importer queries the event once per generation it reads, so writes
        after a record need a new generation (`bump()`), never a second record."""
        self._check_live()
        if self._cuda is not None:
            if self._recorded:
                raise StateConflict(f"buffer {self.buffer_id}: generation {self.generation} is already recorded; "
                                    "bump() before writing again")
            self._cuda.record(stream)
        self._recorded = True

    def await_importer(self, timeout: float) -> bool:
        """A DRAFTS buffer: poll from the host, for at most `timeout` seconds, until the importer's last
        record of the event is done, i.e. its writes into the buffer and the work it queued before them.
        False: not done in time (the caller gives the peer up; no stream of ours ever waits on its event).
        A peer that never recorded finds it done at once: its drafts are then whatever the buffer holds
        (the reader bounds them), never a hang."""
        self._check_live()
        if self.descriptor.role is not BufferRole.DRAFTS or self._cuda is None:
            raise StateConflict(f"buffer {self.buffer_id}: only a CUDA drafts buffer is written by its importer")
        return poll_until(self._cuda.done, timeout)

    def ref(self, row_offset: int, rows: int) -> RowRef:
        """A reference to tensor[row_offset : row_offset + rows] in the current generation."""
        self._check_live()
        if not self._recorded:
            raise StateConflict(
                f"buffer {self.buffer_id}: record() the writes of generation {self.generation} before referencing them"
            )
        ref = RowRef(self.buffer_id, row_offset, rows, self.generation)
        if row_offset + rows > self.descriptor.rows:
            raise InvalidRequest(
                f"rows {row_offset}..{row_offset + rows} lie outside buffer {self.buffer_id} "
                f"of {self.descriptor.rows} rows"
            )
        return ref

    def _check_live(self) -> None:
        if self._released:
            raise UnknownBuffer(f"buffer {self.buffer_id} was released")

    def _release(self) -> None:
        self._released = True
        self._finalizer()  # unlink the name now (unless registering did); the memory lives while anyone holds it


class BufferExporter:
    """Creates and owns the buffers one process shares; unlinks every segment on release/close.

    The importer unlinks a segment's name when it registers it; segments never registered are unlinked
    on release/close, when a RowBuffer is garbage-collected or the interpreter exits normally. Only a
    process killed between creating a segment and registering it leaves its `specsplit-<pid>-*` file.
    """

    def __init__(self) -> None:
        self.host_id = host_id()
        self._buffers: dict[int, RowBuffer] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def new_id(self) -> int:
        """A buffer id no buffer of this exporter has had (also for the host page, which it does not hold)."""
        with self._lock:
            buffer_id, self._next_id = self._next_id, self._next_id + 1
        return buffer_id

    def create(
        self,
        rows: int,
        cols: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        role: BufferRole = BufferRole.ROWS,
    ) -> RowBuffer:
        """A new zeroed buffer [rows, cols]: shared memory for a CPU device, cudaMalloc for CUDA."""
        rows, cols, device = int(rows), int(cols), torch.device(device)
        _nbytes(rows, cols, dtype)
        ints = role in INT_ROLES
        if ints != (dtype == torch.int32) or (role in (BufferRole.DRAFTS, BufferRole.DONE) and device.type != "cuda"):
            raise InvalidRequest("drafts and done buffers are int32 CUDA memory, a feed buffer int32, and only they "
                                 "hold int32")
        if device.type not in ("cpu", "cuda"):
            raise InvalidRequest(f"buffers live on the CPU or a CUDA device, not {device}")
        if not self.host_id:
            raise InvalidRequest("no /dev/shm on this host: rows can only travel inline")
        buffer_id = self.new_id()
        if device.type == "cpu":
            buffer = self._create_shm(buffer_id, rows, cols, dtype, role)
        else:
            buffer = self._create_cuda(buffer_id, rows, cols, dtype, _cuda_index(device), role)
        with self._lock:
            self._buffers[buffer_id] = buffer
        return buffer

    def _create_shm(self, buffer_id: int, rows: int, cols: int, dtype: torch.dtype, role: BufferRole) -> RowBuffer:
        name, raw, key = _shm_create(HEADER_BYTES + _nbytes(rows, cols, dtype))
        token = secrets.token_bytes(TOKEN_BYTES)
        descriptor = BufferDescriptor(buffer_id, BufferKind.SHM, name, dtype, rows, cols, self.host_id, role=role,
                                      token=token)
        header = _write_header(raw, rows, cols, dtype, token)
        tensor = raw[HEADER_BYTES:].view(dtype).view(rows, cols)
        return RowBuffer(descriptor, tensor, header, None, key)

    def _create_cuda(
        self, buffer_id: int, rows: int, cols: int, dtype: torch.dtype, index: int, role: BufferRole
    ) -> RowBuffer:
        cuda = _CudaExport(_nbytes(rows, cols, dtype), index)
        name, raw, key = _shm_create(HEADER_BYTES)  # the generation lives on the host, readable without a sync
        token = secrets.token_bytes(TOKEN_BYTES)
        descriptor = BufferDescriptor(
            buffer_id,
            BufferKind.CUDA_IPC,
            name,
            dtype,
            rows,
            cols,
            self.host_id,
            device_uuid=device_uuid(torch.device("cuda", index)),
            mem_handle=cuda.mem_handle,
            event_handle=cuda.event_handle,
            role=role,
            token=token,
        )
        tensor = _cuda_view(cuda.array, index, descriptor)
        tensor.zero_()
        return RowBuffer(descriptor, tensor, _write_header(raw, rows, cols, dtype, token), cuda, key)

    def export_existing(self, tensor: torch.Tensor, role: BufferRole) -> RowBuffer:
        """Share a tensor the owner already has (the target's embedding / LM head) by copying it once.

        Why a copy rather than torch's `storage._share_cuda_()`: torch's handle names a whole caching-
        allocator segment (with expandable segments, a different mechanism needing extra process
        permissions) and can only be opened through torch's private `_new_shared_cuda`; one plain
        allocation keeps a single code path. The copy is made once, on the owner's side; the
        importer maps it without copying. To hold a single copy afterwards, the owner points its
        parameter at the returned `buffer.tensor` and drops the original.
        """
        if tensor.dim() != 2:
            raise InvalidRequest(f"only 2-D tensors can be exported, got shape {tuple(tensor.shape)}")
        buffer = self.create(tensor.shape[0], tensor.shape[1], tensor.dtype, tensor.device, role)
        buffer.tensor.copy_(tensor)
        buffer.record()
        return buffer

    def get(self, buffer_id: int) -> RowBuffer:
        with self._lock:
            buffer = self._buffers.get(buffer_id)
        if buffer is None:
            raise UnknownBuffer(f"no buffer {buffer_id} is exported here")
        return buffer

    def descriptors(self) -> list[BufferDescriptor]:
        with self._lock:
            return [b.descriptor for b in self._buffers.values()]

    def release(self, buffer_id: int) -> None:
        """Unlink the buffer's segment; importers that already mapped it keep a valid mapping."""
        buffer = self.get(buffer_id)
        with self._lock:
            self._buffers.pop(buffer_id, None)
        buffer._release()

    def close(self) -> None:
        with self._lock:
            buffers, self._buffers = list(self._buffers.values()), {}
        for buffer in buffers:
            buffer._release()

    def __enter__(self) -> BufferExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- importer -----------------------------------------------------------------------------------


class _NoSegment:
    """A host page's stand-in for a segment: it has no header, no generation and no rows to read."""

    def close(self) -> None:
        pass

    def unlink_name(self) -> None:
        pass

    def generation(self) -> int:
        return 0

    def read_rows(self, descriptor: BufferDescriptor, row_offset: int, rows: int) -> torch.Tensor:
        raise InvalidRequest(f"buffer {descriptor.buffer_id} is the host page: it holds no rows")


@dataclass
class _Imported:
    descriptor: BufferDescriptor
    segment: _Segment | _NoSegment  # SHM: header + rows; CUDA_IPC: the header alone; HOST_PAGE: none
    tensor: torch.Tensor | None = None  # CUDA_IPC: [rows, cols] view of the owner's device memory
    event: _IpcEvent | None = None  # CUDA_IPC: the owner's write event
    written: int | None = None  # the last generation whose writes the host saw done
    flags: list[Flag] | None = None  # HOST_PAGE: the page's int32 flags, one a column

    def check_written(self, generation: int) -> None:
        """Refuse to read `generation` before the host has seen the owner's writes of it done (one event
        query per generation: the owner records once per generation, bump → write → record). Never
        waits: the caller awaited them (`BufferImporter.await_written`) where waiting blocks nobody else."""
        if self.written != generation:
            if not self.event.done():
                raise WritesPending(f"buffer {self.descriptor.buffer_id}: the owner's writes of generation "
                                    f"{generation} are not done")
            self.written = generation

    def await_written(self, deadline: float, stop: Callable[[], bool] | None = None) -> bool:
        """Poll for the owner's writes of the current generation until `deadline` (time.monotonic());
        False if they were not seen done by then (or `stop()` turned true)."""
        generation = self.segment.generation()
        if self.written == generation:
            return True
        if not poll_until(self.event.done, max(0.0, deadline - time.monotonic()), stop):
            return False
        self.written = generation
        return True


class BufferImporter:
    """The importing side of one connection: opens descriptors once, resolves references per step."""

    def __init__(self, local_host_id: str | None = None) -> None:
        self.host_id = host_id() if local_host_id is None else local_host_id
        self._buffers: dict[int, _Imported] = {}
        self._lock = threading.Lock()
        self.page: HostPage | None = None  # the DONE page this connection's hello passed (BufferKind.HOST_PAGE)

    def register(self, descriptors: Iterable[BufferDescriptor]) -> None:
        """Open every descriptor, or none of them when one fails; then their names are unlinked."""
        descriptors = list(descriptors)
        ids = [d.buffer_id for d in descriptors]
        with self._lock:
            taken = [i for i in ids if i in self._buffers]
            pages = sum(b.descriptor.kind is BufferKind.HOST_PAGE for b in self._buffers.values())
        if taken or len(set(ids)) != len(ids):
            raise AlreadyExists(f"buffer ids already registered or repeated: {sorted(set(taken) or ids)}")
        if pages + sum(d.kind is BufferKind.HOST_PAGE for d in descriptors) > 1:
            raise AlreadyExists("the host page is registered once a connection")
        opened: dict[int, _Imported] = {}
        try:
            for d in descriptors:
                opened[d.buffer_id] = self._open(d)
            with self._lock:
                if any(i in self._buffers for i in opened):
                    raise AlreadyExists(f"buffer ids registered concurrently: {sorted(opened)}")
                self._buffers.update(opened)
        except BaseException:
            for imported in opened.values():
                imported.segment.close()
            raise
        for imported in opened.values():
            imported.segment.unlink_name()

    def _open(self, descriptor: BufferDescriptor) -> _Imported:
        if descriptor.host_id != self.host_id:
            raise InvalidRequest(f"buffer {descriptor.buffer_id} lives on another host or namespace; send rows inline")
        if descriptor.kind is BufferKind.SHM:
            return _Imported(descriptor, _open_segment(descriptor, descriptor.nbytes))
        if descriptor.kind is BufferKind.HOST_PAGE:
            if self.page is None or self.page.closed:
                raise InvalidRequest(f"buffer {descriptor.buffer_id}: no host page came with this connection's "
                                     "step socket hello")
            return _Imported(descriptor, _NoSegment(), flags=[self.page.flag(i) for i in range(descriptor.cols)])
        segment = _open_segment(descriptor, 0)
        try:
            tensor, event = _open_cuda(descriptor)
        except BaseException:
            segment.close()
            raise
        return _Imported(descriptor, segment, tensor, event)

    def _get(self, buffer_id: int) -> _Imported:
        with self._lock:
            imported = self._buffers.get(buffer_id)
        if imported is None:
            raise UnknownBuffer(f"buffer {buffer_id} is not registered on this connection")
        return imported

    def descriptor(self, buffer_id: int) -> BufferDescriptor:
        return self._get(buffer_id).descriptor

    def with_role(self, role: BufferRole) -> list[BufferDescriptor]:
        """Registered buffers holding `role` (e.g. the target's LM head), in registration order."""
        with self._lock:
            return [b.descriptor for b in self._buffers.values() if b.descriptor.role is BufferRole(role)]

    def resolve(
        self,
        source: RowSource,
        *,
        cols: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        role: BufferRole = BufferRole.ROWS,
        before_written: bool = False,
    ) -> torch.Tensor:
        """RowRef → [rows, cols]: a copy of shared-memory rows, a view of CUDA IPC rows; InlineRows → decoded.

        cols/dtype, when given, are what the caller expects. A CUDA view is given only once the host
        has seen the owner's writes of its generation done (WritesPending otherwise; see
        `await_written`), or with `before_written` at once, for work queued only after `check_current`
        passes. `device` applies to inline rows only. `role`: what the buffer must hold (a chained
        step's feed, or rows).
        """
        if isinstance(source, InlineRows):
            if role is not BufferRole.ROWS:
                raise InvalidRequest(f"a {role.value} buffer's contents never travel inline")
            _check_expected("inline rows", source.cols, source.dtype, cols, dtype)
            return decode_inline(source, device)
        imported = self._get(source.buffer_id)
        described = imported.descriptor
        if described.role is not role:
            raise InvalidRequest(f"buffer {source.buffer_id} holds {described.role.value}, not {role.value}")
        _check_expected(f"buffer {source.buffer_id}", described.cols, described.dtype, cols, dtype)
        # Each side stays within the operands' range, as a C or int64 version of this check must.
        if source.rows > described.rows or source.row_offset > described.rows - source.rows:
            raise InvalidRequest(
                f"{source.rows} rows from row {source.row_offset} lie outside buffer {source.buffer_id} "
                f"of {described.rows} rows"
            )
        current = imported.segment.generation()
        if source.generation != current:
            raise StateConflict(
                f"buffer {source.buffer_id} is at generation {current}; reference to {source.generation} is stale"
            )
        if imported.tensor is None:
            return imported.segment.read_rows(described, source.row_offset, source.rows)
        if not before_written:
            imported.check_written(current)
        return imported.tensor[source.row_offset : source.row_offset + source.rows]

    def check_current(self, source: RowRef, *, written: bool = True) -> None:
        """Before queuing work that reads a view `resolve(before_written=True)` gave: UnknownBuffer if its
        buffer is gone, StateConflict if it has moved to another generation since, WritesPending unless the
        host has seen the owner's writes of it done (with `written`; without, the caller's stream waits
        for them on the device). Never waits."""
        imported = self._get(source.buffer_id)
        current = imported.segment.generation()
        if source.generation != current:
            raise StateConflict(
                f"buffer {source.buffer_id} is at generation {current}; reference to {source.generation} is stale"
            )
        if written and imported.event is not None:
            imported.check_written(current)

    def await_written(self, buffer_ids: Iterable[int], timeout: float, stop: Callable[[], bool] | None = None) -> None:
        """Poll, from the host and for at most `timeout` seconds in all (or until `stop()` turns true), until
        the owner's writes of the current generation of each of `buffer_ids` that is a registered CUDA
        buffer are done; then `resolve` reads them; WritesPending if not. Call it outside any lock other
        peers' calls need: this is the only wait on a peer's GPU work. Ids not registered (or not CUDA)
        are skipped: `resolve` refuses or copies them."""
        deadline = time.monotonic() + timeout
        for buffer_id in sorted(set(buffer_ids)):
            with self._lock:
                imported = self._buffers.get(buffer_id)
            if imported is not None and imported.event is not None and not imported.await_written(deadline, stop):
                raise WritesPending(f"buffer {buffer_id}: the owner's writes of generation "
                                    f"{imported.segment.generation()} were not done within {timeout:.3g} s")

    def drafts_target(self, buffer_id: int) -> tuple[torch.Tensor, _IpcEvent]:
        """A registered DRAFTS buffer: its [rows, cols] int32 device view, and the event to record after
        writing it."""
        imported = self._get(buffer_id)
        if imported.descriptor.role is not BufferRole.DRAFTS or imported.tensor is None:
            raise InvalidRequest(f"buffer {buffer_id} is not a drafts buffer")
        return imported.tensor, imported.event

    def done_target(self, buffer_id: int) -> list[Flag]:
        """A registered DONE buffer's int32 flags, one a column (the first takes chained steps' done values)."""
        imported = self._get(buffer_id)
        if imported.descriptor.role is not BufferRole.DONE or (imported.tensor is None and imported.flags is None):
            raise InvalidRequest(f"buffer {buffer_id} is not a done buffer")
        if imported.flags is None:  # (made once: every chained step that waits on the device asks)
            imported.flags = [Flag.of(imported.tensor[0, i:i + 1]) for i in range(imported.tensor.shape[1])]
        return imported.flags

    def whole(self, buffer_id: int) -> torch.Tensor:
        """The full [rows, cols] buffer written once (embedding, LM head): a copy (SHM) or a view (CUDA IPC).
        A CUDA view may be read only after `check_written(buffer_id)` (or `await_written`) passes."""
        imported = self._get(buffer_id)
        if imported.tensor is None:
            return imported.segment.read_rows(imported.descriptor, 0, imported.descriptor.rows)
        return imported.tensor

    def check_written(self, buffer_id: int) -> None:
        """WritesPending unless the host has seen the owner's writes of a CUDA buffer's current generation
        done (no wait; SHM buffers pass)."""
        imported = self._get(buffer_id)
        if imported.event is not None:
            imported.check_written(imported.segment.generation())

    def release(self, buffer_ids: Iterable[int]) -> None:
        """Forget buffers; a segment closes once no read in flight holds it, CUDA views stay valid until dropped."""
        buffer_ids = list(buffer_ids)
        for buffer_id in buffer_ids:
            self._get(buffer_id)
        with self._lock:
            for buffer_id in buffer_ids:
                self._buffers.pop(buffer_id, None)

    def close(self) -> None:
        with self._lock:
            self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)

    def __contains__(self, buffer_id: object) -> bool:
        return buffer_id in self._buffers

    def __enter__(self) -> BufferImporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
