"""What both services' CUDA graphs share: bucket sizes, and capturing a function over static buffers."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch itself."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return sizes + [max_batch]


def bucket_for(size: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `size`, or None."""
    return next((b for b in buckets if b >= size), None)


def capture(fn: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` once on a side stream (lazy initialisation, autotuning), then capture it into a graph
    sharing `pool` (`torch.cuda.graph_pool_handle()`). Returns the graph and the outputs of the captured
    run: static tensors that every replay rewrites."""
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
