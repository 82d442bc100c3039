"""Triton when it is installed, else stand-ins that let kernel modules import (their torch references still work)."""

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

__all__ = ["HAVE_TRITON", "tl", "triton"]
