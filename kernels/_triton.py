"""Triton when it is installed, else stand-ins that let kernel modules import (their torch references still work).

Also the programmatic dependent launch (PDL) every kernel here supports: launched with it (`dependent_launch`),
a kernel may be scheduled while the one before it in its stream is still running, and waits at its first line
(`gdc_enter`) for that kernel to finish and its writes to land, before it reads or writes any memory; it then
lets the next kernel be scheduled likewise. What it saves is the gap between two kernels (~0.5 µs on the H200:
131 µs of a Qwen3-8B-shaped step's 4.6 ms, twenty-ninth session). Hopper and later only; never under the
interpreter. Off unless `PDL` is set (the environment's SPECSPLIT_PDL=1 sets it at import, for the GPU tests
and benches) until the H200 says it wins.
"""

from __future__ import annotations

import functools
import os

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class triton:  # noqa: N801 - stands in for the module: @triton.jit leaves the kernel a plain, uncalled function
        @staticmethod
        def jit(fn):
            return fn

    class tl:  # noqa: N801 - only tl.constexpr is evaluated at definition time (in annotations)
        constexpr = None

PDL = os.environ.get("SPECSPLIT_PDL", "0") == "1"


@functools.cache
def _hopper_or_later(index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(index) >= (9, 0)


def dependent_launch(device) -> dict:
    """The launch options of a kernel on `device` (a torch.device): {USE_GDC: True, launch_pdl: True} where
    PDL is on, the device a CUDA GPU of compute capability 9.0 or later and Triton not interpreted; else
    {USE_GDC: False}."""
    use = (PDL and HAVE_TRITON and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
           and _hopper_or_later(device.index if device.index is not None else 0))
    return {"USE_GDC": True, "launch_pdl": True} if use else {"USE_GDC": False}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """A kernel's first line: with USE_GDC, wait until the kernel before it in the stream is done and its
    writes visible, then let the next kernel be scheduled (it waits likewise before touching memory)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


__all__ = ["HAVE_TRITON", "PDL", "dependent_launch", "gdc_enter", "tl", "triton"]
