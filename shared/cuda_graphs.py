"""What both services' CUDA graphs share: bucket sizes, and capturing a function over static buffers."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch

T = TypeVar("T")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch itself."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return sizes + [max_batch]


def bucket_for(size: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `size`, or None."""
    return next((b for b in buckets if b >= size), None)


def capture(fn: Callable[[], T], pool, *, warm_up: bool = True) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` once on a side stream (lazy initialisation, autotuning), then capture it into a graph
    sharing `pool` (`torch.cuda.graph_pool_handle()`). Returns the graph and the outputs of the captured
    run: static tensors that every replay rewrites. `warm_up=False` skips that first run, for a function
    with effects that must happen once per replay (its kernels must have run before)."""
    if warm_up:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            fn()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads may query CUDA events meanwhile (the drafter service polls its targets'
    # write events outside its lock, while a capture runs under it); in the default global mode such a
    # query invalidates the capture.
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def capture_serving(fn: Callable[[], object], pool) -> torch.cuda.CUDAGraph:
    """Capture `fn` into a graph sharing `pool`, without running it first and without what
    `torch.cuda.graph` does around a capture (a device synchronize, a garbage collection, emptying the
    allocator's cache: tens of milliseconds, and every eager allocation after it a cudaMalloc again).
    For graphs captured while serving, of functions whose kernels have all run before."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # (before the capture: not part of it)
    with torch.cuda.stream(side), torch.inference_mode():
        # thread_local: as in `capture`
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        except BaseException:
            try:
                graph.capture_end()  # (ends the invalidated capture; its own error says less than fn's)
            except Exception:  # noqa: BLE001
                pass
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph


_inline = threading.local()


@contextmanager
def inlined() -> Iterator[None]:
    """While capturing a graph that contains other graphs' functions (a whole chained step holds the
    drafter's and the target's forwards): those functions run their kernels into the capture instead
    of replaying their own graphs (`inlining`)."""
    _inline.on = True
    try:
        yield
    finally:
        _inline.on = False


def inlining() -> bool:
    return getattr(_inline, "on", False)
