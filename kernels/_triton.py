"""Triton when it is installed, else stand-ins that let kernel modules import (their torch references still work).

Also the programmatic dependent launch (PDL) every kernel here supports: launched with it (`dependent_launch`),
a kernel may be scheduled while the one before it in its stream is still running, and waits at its first line
(`gdc_enter`) for that kernel to finish and its writes to land, before it reads or writes any memory; it then
lets the next kernel be scheduled likewise. What it saves is the gap between two kernels and the next one's
start (the thirtieth session, H200, `bench/floor_profile.py --pdl`, replays of one decode step):

| | without | every kernel dependent | heavy projections plain (the default) |
|---|---|---|---|
| SmolLM2-135M, 222 kernels | 808-811 µs | 676-678 µs | 676 µs (only its LM head is heavy) |
| Qwen3-8B shape, 264 kernels | 4,461-4,466 µs | 4,756-4,768 µs | 4,410-4,411 µs |

(two runs each; with each kernel letting the next launch at its exit instead: 768-770 µs and 4,416-4,465.)
Served (`bench/split_bench.py`, SmolLM2, bf16, three rounds, medians of the rounds' ratios, two runs): target
only 1.10-1.19× at one stream (1,439 against 1,316 tok/s) and 1.07-1.18× at eight; in-process speculative
1.04-1.12× and 1.02×; no request's tokens differ.
Hopper and later only; never under the interpreter. On by default; SPECSPLIT_PDL=0 (read at import) or
`PDL = False` turns it off.
"""

from __future__ import annotations

import functools
import os

from ..shared.errors import InvalidRequest

# Floating-point contraction (a*b + c as one FMA) as every kernel here was measured and tested with: Triton 3.9
# warns that 3.10 turns it off by default, which would change the kernels' rounding under a newer Triton
# (the device's Triton 3.6 fuses). A user's own setting wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

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

SWITCHES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _switch(name: str, default: bool) -> bool:
    """An environment switch as the services read theirs: 1/0, true/false, yes/no or on/off; else an error
    naming the variable (a typo must not leave a setting silently at its default)."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value.strip().lower() not in SWITCHES:
        raise InvalidRequest(f"${name} must be one of {', '.join(SWITCHES)}, got {value!r}")
    return SWITCHES[value.strip().lower()]


PDL = _switch("SPECSPLIT_PDL", True)  # SPECSPLIT_PDL=0 turns it off
# Where a kernel launched dependent lets the next one be scheduled: "start", right after its own wait (the
# next kernel's programs are resident and waiting by the time this one ends), or "exit", when it ends (only
# the launch's processing overlaps)
PDL_TRIGGER = "start"
# The kernel families that launch plain even where PDL is on (names of FAMILIES): the few-rows projections
# of heavy weights (kernels/skinny_linear.py, PDL_HEAVY_BYTES)
PDL_SKIP: frozenset[str] = frozenset({"skinny_linear_heavy"})
FAMILIES = ("skinny_linear", "skinny_linear_heavy", "rms_norm", "rope", "rotary_tables", "paged_attention",
            "combine_splits", "silu_mul", "row_max", "tree_grow", "tree_accept", "fed_inputs", "chain_meta", "kv_move",
            "chain_accept", "top_k")
TRIGGERS = {"start": 1, "exit": 2}  # USE_GDC's values where PDL is on (0: off)
# Whether this Triton has grid dependency control (its gdc_* functions came with launch_pdl; with an older
# Triton, as older torch releases bring, every kernel launches plain)
PDL_SUPPORTED = HAVE_TRITON and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")


@functools.cache
def _hopper_or_later(index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(index) >= (9, 0)


def dependent_launch(device, family: str) -> dict:
    """The launch options of a kernel of `family` on `device` (a torch.device): {USE_GDC: 1 (trigger at
    start) or 2 (at exit), launch_pdl: True} where PDL is on and the family not in PDL_SKIP, Triton has it
    (PDL_SUPPORTED) and is not interpreted, and the device is a CUDA GPU of compute capability 9.0 or later;
    else {USE_GDC: 0}."""
    assert family in FAMILIES, family
    use = (PDL and family not in PDL_SKIP and PDL_SUPPORTED and device.type == "cuda"
           and os.environ.get("TRITON_INTERPRET", "0") != "1"
           and _hopper_or_later(device.index if device.index is not None else 0))
    return {"USE_GDC": TRIGGERS[PDL_TRIGGER], "launch_pdl": True} if use else {"USE_GDC": 0}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """A kernel's first line: with USE_GDC (1 or 2), wait until the kernel before it in the stream is done
    and its writes visible; with 1, then let the next kernel be scheduled (it waits likewise before touching
    memory); with 2 the next is scheduled when this one ends."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        if USE_GDC == 1:
            tl.extra.cuda.gdc_launch_dependents()


__all__ = ["FAMILIES", "HAVE_TRITON", "PDL", "PDL_SKIP", "PDL_TRIGGER", "dependent_launch", "gdc_enter", "tl",
           "triton"]
