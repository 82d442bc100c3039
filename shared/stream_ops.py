"""CUDA stream memory operations: a stream that waits for a 32-bit value, and one that writes it.

Two processes on one GPU order their streams through a flag this way without either host waiting: the
drafter's stream writes a chained step's done value into the target's DONE buffer (CUDA IPC memory)
after its drafts, and the target's stream waits for it before its verify reads them
(`shared.device_waits`). Unlike a stream waiting on the other process's CUDA event, a wait on a
value can be released by its own process (it writes the value itself), so a peer that never writes
costs a deadline, not a hang. Measured on the H200 (`tools/stream_wait_probe.py`): 10 µs a round trip
between two processes' streams through device memory.

The driver API is reached through ctypes (torch exposes neither operation); `stream_ops()` is None where
libcuda or the operations are missing (no GPU, an old driver), and callers then keep their host polls.
"""

from __future__ import annotations

import ctypes
import functools

import torch

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0, a wrap-aware difference
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write (earlier writes land first)


class StreamOpError(RuntimeError):
    """A stream memory operation was refused by the driver."""


class StreamOps:
    """`cuStreamWaitValue32` and `cuStreamWriteValue32` (their `_v2` names where the driver has them)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._wait = self._symbol(lib, "cuStreamWaitValue32")
        self._write = self._symbol(lib, "cuStreamWriteValue32")

    @staticmethod
    def _symbol(lib: ctypes.CDLL, name: str):
        for candidate in (name + "_v2", name):  # _v2: CUDA 11.7+, usable without the v1 opt-in
            fn = getattr(lib, candidate, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                fn.restype = ctypes.c_int
                return fn
        raise StreamOpError(f"libcuda has no {name}")

    def wait(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """Queue on `stream`: wait until the int32 at device `address` is >= value (wrap-aware)."""
        self._check(self._wait(stream.cuda_stream, address, value & 0xFFFFFFFF, WAIT_GEQ), "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """Queue on `stream`: write `value` to the int32 at device `address`, after the stream's earlier work."""
        self._check(self._write(stream.cuda_stream, address, value & 0xFFFFFFFF, WRITE_DEFAULT), "cuStreamWriteValue32")

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise StreamOpError(f"{what} returned CUresult {code}")


@functools.lru_cache(maxsize=1)
def stream_ops() -> StreamOps | None:
    """The process's stream operations, or None where CUDA or the operations are not there."""
    if not torch.cuda.is_available():
        return None
    try:
        return StreamOps(ctypes.CDLL("libcuda.so.1"))
    except (OSError, StreamOpError):
        return None


def next_value(value: int) -> int:
    """The done value after `value`: 1..2^32-1, wrapping past 0 (a value of 0 means none)."""
    return value % 0xFFFFFFFF + 1
