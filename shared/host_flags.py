"""A page of int32 flags in host memory that both processes map and both GPUs reach: the DONE buffer of a
split whose streams wait on each other on the device (`shared.device_waits`).

Why host memory: a stream waiting on a value blocks its whole context while the process loads a kernel
module (a kernel's first launch), and then a release written by a stream memory operation does not get
through, while a store of the host's CPU into mapped host memory does (`tools/stream_wait_probe.py --part
8`, twenty-sixth session). A watchdog that releases with a CPU store can always let a wait go.

Why a sealed memfd passed over the Step socket: the drafter must never map memory a client can pull out
from under it (a truncated file would turn its next store into SIGBUS). The target makes the page with
`os.memfd_create`, sizes it to one page and seals it against shrinking and against further seals, then
sends the descriptor with the Step socket's hello (SCM_RIGHTS, `shared.frames`). The drafter checks the
seals, the size and the access mode before it maps anything (`HostPage.adopt`): a page that passes can
neither shrink nor be sealed against writes later.

A `Flag` is one int32 of such a page (or of device memory): the address a stream waits on or writes, and,
in a host page, a CPU view through which the watchdog stores a release.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import logging
import mmap
import os
import stat
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from specsplit.shared.errors import InvalidRequest

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
PAGE_INTS = PAGE_BYTES // 4
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
RETIRE_POLL_SECONDS = 5.0  # how long `close` waits for our stream's last use of the page before leaving it registered
_kept: list = []  # pages that could not be unregistered safely: kept mapped and registered for good


@dataclass(frozen=True, eq=False)
class Flag:
    """One int32 that a stream waits on or writes. `address`: its address on the device; `host`: a CPU view
    of it when it lies in a mapped host page (a release is then a store of our CPU); `keep`: what holds
    the memory (kept alive with the flag)."""

    address: int
    host: torch.Tensor | None = None
    keep: object = None
    device: torch.device | None = None  # the GPU whose streams use `address`

    @staticmethod
    def of(view: torch.Tensor) -> "Flag":
        """The int32 at the start of a device tensor."""
        return Flag(view.data_ptr(), None, view, view.device)

    def store(self, value: int) -> None:
        """A store of our CPU (host pages only)."""
        if self.host is None:
            raise RuntimeError("a flag in device memory is written by a stream, not stored")
        self.host.fill_(_as_int32(value))


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


class HostPage:
    """One page of host memory shared by fd, mapped here and (on a GPU) registered with CUDA, mapped.
    `create` makes one (the owner, who passes `fd` on); `adopt` takes one a peer passed, after checking it."""

    def __init__(self, fd: int, device: torch.device | None, *, owner: bool) -> None:
        self.fd: int | None = fd
        self._map = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # (through numpy: its array holds the mapping's buffer export, so the mapping cannot close under a view;
        # torch.frombuffer holds none, and a store through a view of a closed mapping is a SIGSEGV)
        self.ints = torch.from_numpy(np.frombuffer(self._map, dtype=np.int32, count=PAGE_INTS))
        self.device = _indexed(device) if device is not None and device.type == "cuda" else None
        self.device_address = self.ints.data_ptr()  # (on a GPU: where its streams reach the page, set below)
        self._lock = threading.Lock()
        self.closed = False
        self._used = False  # a flag of it was handed out (a stream may have used it)
        if self.device is not None:
            try:
                self._register()
            except Exception:
                self.ints = None
                self._map.close()
                raise
        if not owner:  # (the mapping holds the page: the descriptor is not needed any more)
            self._close_fd()

    @classmethod
    def create(cls, device: torch.device | None) -> "HostPage":
        """A fresh zeroed page, sealed, mapped and registered: ours to pass on (`fd`)."""
        fd = os.memfd_create("specsplit-done", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return cls(fd, device, owner=True)
        except Exception:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int, device: torch.device | None) -> "HostPage":
        """The page behind a descriptor a peer passed; InvalidRequest (the descriptor closed) unless it is a
        memfd of PAGE_BYTES, sealed against shrinking and further seals, open for reading and writing.
        Takes the descriptor either way."""
        try:
            check_page(fd)
            return cls(fd, device, owner=False)
        except InvalidRequest:
            _close_quietly(fd)
            raise
        except OSError as exc:
            _close_quietly(fd)
            raise InvalidRequest(f"the DONE page cannot be mapped ({exc.strerror or exc})") from None
        except Exception:
            _close_quietly(fd)
            raise

    def flag(self, index: int) -> Flag:
        """The page's int32 number `index`."""
        if not 0 <= index < PAGE_INTS:
            raise IndexError(f"a page holds {PAGE_INTS} int32, not {index + 1}")
        if self.closed:
            raise RuntimeError("a flag of a closed page")
        self._used = True
        return Flag(self.device_address + 4 * index, self.ints[index:index + 1], self, self.device)

    def _register(self) -> None:
        torch.cuda.init()  # (the driver initialized: cuInit, through the runtime)
        self.device_address = _driver().register(self.device.index, self.ints.data_ptr())

    def close(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """Unregister and unmap once `stream`'s work queued so far is done (the work of ours that may still
        use the page; the caller's current stream when None). If it is not done within RETIRE_POLL_SECONDS
        the page stays registered and mapped for good: memory a stream may still write is never unregistered.
        Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._close_fd()
        if self.device is None:
            self._unmap()
            return
        if not self._used:  # (no stream ever had its address: nothing to wait for)
            self._unregister()
            return
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        deadline = time.monotonic() + RETIRE_POLL_SECONDS
        while not event.query():
            if time.monotonic() > deadline:
                log.warning("a DONE page's last use on the GPU was not done within %.0f s: it stays mapped",
                            RETIRE_POLL_SECONDS)
                _kept.append(self)
                return
            time.sleep(1e-3)
        self._unregister()

    def _unregister(self) -> None:
        try:
            _driver().unregister(self.device.index, self.ints.data_ptr())
        except OSError as exc:  # (left registered: kept mapped, for good)
            log.warning("a DONE page could not be unregistered (%s): it stays mapped", exc)
            _kept.append(self)
            return
        self._unmap()

    def keep_for_good(self) -> None:
        """Never unregister nor unmap this page (a stream may still write it)."""
        with self._lock:
            self.closed = True
        _kept.append(self)

    def _unmap(self) -> None:
        self.ints = None
        try:
            self._map.close()
        except BufferError:  # a flag still holds a view: the mapping goes with the last of them (and the page)
            pass

    def _close_fd(self) -> None:
        if self.fd is not None:
            _close_quietly(self.fd)
            self.fd = None


def check_page(fd: int) -> None:
    """InvalidRequest unless `fd` is a memfd of exactly PAGE_BYTES, sealed (REQUIRED_SEALS), read-write."""
    try:
        info = os.fstat(fd)
    except OSError as exc:
        raise InvalidRequest(f"the DONE page's descriptor cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise InvalidRequest("the DONE page must be a memfd, not a socket, pipe or device")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidRequest("the DONE page must be a memfd that takes seals (MFD_ALLOW_SEALING)") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise InvalidRequest("the DONE page must be sealed against shrinking and further seals "
                             "(F_SEAL_SHRINK | F_SEAL_SEAL)")
    if seals & (fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0)):
        raise InvalidRequest("the DONE page must stay writable (no F_SEAL_WRITE)")
    if info.st_size != PAGE_BYTES:
        raise InvalidRequest(f"the DONE page must be {PAGE_BYTES} bytes, not {info.st_size}")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidRequest("the DONE page must be open for reading and writing")


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _indexed(device: torch.device) -> torch.device:
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _Driver:
    """Host memory's registration through libcuda's driver API, in our GPU's primary context: a failure there
    leaves nothing behind for the runtime, where a failed cudaHostRegister's error would be raised by torch's
    next check of a kernel launch, in an unrelated operation."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        def fn(names: tuple[str, ...], *argtypes):
            for name in names:
                found = getattr(lib, name, None)
                if found is not None:
                    found.argtypes, found.restype = list(argtypes), ctypes.c_int
                    return found
            raise OSError(f"libcuda has no {names[0]}")

        ptr, int_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
        self._device = fn(("cuDeviceGet",), int_p, ctypes.c_int)
        self._retain = fn(("cuDevicePrimaryCtxRetain",), ctypes.POINTER(ptr), ctypes.c_int)
        self._release = fn(("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"), ctypes.c_int)
        self._push = fn(("cuCtxPushCurrent_v2", "cuCtxPushCurrent"), ptr)
        self._pop = fn(("cuCtxPopCurrent_v2", "cuCtxPopCurrent"), ctypes.POINTER(ptr))
        self._register = fn(("cuMemHostRegister_v2", "cuMemHostRegister"), ptr, ctypes.c_size_t, ctypes.c_uint)
        self._unregister = fn(("cuMemHostUnregister",), ptr)
        self._pointer = fn(("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"),
                           ctypes.POINTER(ctypes.c_uint64), ptr, ctypes.c_uint)

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise OSError(f"{what} returned CUresult {code}")

    @contextlib.contextmanager
    def _in_context(self, index: int, *, keep: bool = False):
        """Our GPU's primary context, current on this thread within; retained for good with `keep` (a page
        registered holds the context: released to no one else, it would be destroyed, the registration with
        it, and the runtime's context made later would not know the page)."""
        device, context = ctypes.c_int(0), ctypes.c_void_p()
        self._check(self._device(ctypes.byref(device), index), "cuDeviceGet")
        self._check(self._retain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        kept = False
        try:
            self._check(self._push(context), "cuCtxPushCurrent")
            try:
                yield
                kept = keep
            finally:
                self._pop(ctypes.byref(ctypes.c_void_p()))
        finally:
            if not kept:
                self._release(device)

    def register(self, index: int, address: int) -> int:
        """Register one page at `address` (portable, mapped), its primary context held until `unregister`;
        its device address."""
        with self._in_context(index, keep=True):
            self._check(self._register(address, PAGE_BYTES, _HOST_REGISTER_PORTABLE_MAPPED), "cuMemHostRegister")
            out = ctypes.c_uint64(0)
            code = self._pointer(ctypes.byref(out), address, 0)
            if code != 0:
                self._unregister(address)
                self._check(code, "cuMemHostGetDevicePointer")
            return out.value

    def unregister(self, index: int, address: int) -> None:
        with self._in_context(index):
            self._check(self._unregister(address), "cuMemHostUnregister")
        device = ctypes.c_int(0)
        if self._device(ctypes.byref(device), index) == 0:
            self._release(device)  # (the hold `register` took)


@functools.lru_cache(maxsize=1)
def _driver() -> _Driver:
    return _Driver(ctypes.CDLL("libcuda.so.1"))
