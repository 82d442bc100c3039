"""Small per-step transfers between host and device without stalling the host.

A step's bookkeeping (positions, anchors, lengths, scatter indices) is a handful of ints made on the
host. `torch.tensor(values, device="cuda")` copies them from pageable memory, which the driver does
synchronously (about 30-80 µs of host time each on the H200, measured); several per sequence per step
add up to milliseconds. `HostStaging` writes them into one pinned ring instead and issues an
asynchronous copy, and `to_host` brings a step's results back with one wait for several tensors.

On a CPU device both are plain tensor constructions and copies.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch

_RING_WORDS = 1 << 18  # 2 MiB of pinned int64: thousands of steps between two wraps


class HostStaging:
    """int64 vectors/matrices from host lists to one device, through a pinned ring.

    Each `put` takes the next free span of the ring and copies it asynchronously on the current
    stream. When the ring wraps, the host waits once for the device (every copy issued from the ring
    so far has then finished), so a span is never rewritten while a copy may still read it.
    """

    def __init__(self, device: torch.device | str, words: int = _RING_WORDS) -> None:
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        if self._pinned:
            self._ring = torch.empty(words, dtype=torch.int64, pin_memory=True)
            self._view = self._ring.numpy()
        self._next = 0

    def put(self, values: Sequence[int] | Sequence[Sequence[int]] | np.ndarray) -> torch.Tensor:
        """An int64 tensor on the device holding `values` (a flat list, or equal-length rows)."""
        array = np.asarray(values, dtype=np.int64)
        staged = self._stage(array)
        if staged is None:  # no ring (CPU), or larger than the ring (rare): a plain copy
            return torch.from_numpy(array.copy()).to(self.device)
        return staged.to(self.device, non_blocking=True)

    def put_into(self, dst: torch.Tensor, values: Sequence[int] | Sequence[Sequence[int]] | np.ndarray) -> None:
        """Copy `values` into the int64 device tensor `dst` of the same shape (a static buffer of a CUDA
        graph): one asynchronous copy, no intermediate device tensor."""
        array = np.asarray(values, dtype=np.int64)
        if tuple(array.shape) != tuple(dst.shape) or dst.dtype != torch.int64:
            raise ValueError(f"put_into: values of shape {array.shape} into {tuple(dst.shape)} {dst.dtype}")
        staged = self._stage(array)
        dst.copy_(torch.from_numpy(array) if staged is None else staged, non_blocking=staged is not None)

    def _stage(self, array: np.ndarray) -> torch.Tensor | None:
        """`array` in the next free span of the pinned ring, shaped; None without a ring or room in it."""
        n = array.size
        if not self._pinned or n > self._ring.numel():
            return None
        if self._next + n > self._ring.numel():
            torch.cuda.synchronize(self.device)
            self._next = 0
        span = slice(self._next, self._next + n)
        self._view[span] = array.reshape(-1)
        self._next += n
        return self._ring[span].view(array.shape)


_readback = threading.local()  # each thread's pinned landing buffer for to_host, grown as needed
_ALIGN = 16  # bytes: each tensor's place in it starts aligned for any dtype


def to_host(*tensors: torch.Tensor) -> list[list]:
    """Several device tensors as nested lists, with one wait for the device instead of one per tensor.

    The copies land in a pinned buffer kept per thread (a pinned allocation costs more host time
    than the copy): it is reused only after this call's wait, when nothing may still write it."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors]
    landing = getattr(_readback, "buffer", None)
    if landing is None or landing.numel() < sum(sizes):
        landing = _readback.buffer = torch.empty(max(sum(sizes), 4096), dtype=torch.uint8, pin_memory=True)
    hosts, offset = [], 0
    for t, size in zip(tensors, sizes):
        host = landing[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
        offset += size
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [h.tolist() for h in hosts]
