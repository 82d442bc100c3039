"""Plumbing shared by the Triton kernel tests: a kernel file's own checks under Triton's CPU interpreter
(in a child process: triton reads TRITON_INTERPRET when a kernel is decorated, so setting it here would
turn every other test's kernels into interpreted ones), and a capture into a CUDA graph after a warm-up
that compiles outside it."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, TypeVar

import pytest
import torch

T = TypeVar("T")


def run_interpreted(path: str, marker: str) -> None:
    """`python path` with TRITON_INTERPRET=1 (the file's __main__ runs its checks), which must exit 0
    and print `marker`."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the child imports tests.kernel_checks
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    result = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and marker in result.stdout, result.stdout[-3000:] + result.stderr[-6000:]


def captured(record: Callable[[], T], warm_up: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of `record` and what it returned (static outputs), after `warm_up` (default: record
    itself) ran once on a side stream, so that the kernels compile outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warm_up or record)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = record()
    return graph, out
