"""Arrival counters: the workspace of kernels whose last program to finish does the final reduction
(kernels.row_max's), one launch where there would be two.

Each program of a group adds one to its group's counter; the one that finds every other arrived
reduces the group, then sets the counter back to zero. So a workspace stays zeroed between calls and
serves any number of them, and any of these kernels, one after another in stream order; two calls at
once (two streams, two graphs replaying together) must each have their own.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton


def arrival_counters(count: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 counters for calls of up to `count` groups."""
    if count < 1:
        raise ValueError(f"a workspace holds at least one counter, not {count}")
    return torch.zeros(count, dtype=torch.int32, device=device)


@triton.jit
def arrived_last(counter, GROUP: tl.constexpr):
    """In a kernel, after a program stored its part of its group's work: whether it is the group's last to
    arrive at `counter` (of GROUP programs), the one that reduces the group and then zeroes the counter. The
    barriers and the acquire-release add order every program's stores before the last one's loads."""
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == GROUP - 1
    tl.debug_barrier()
    return last
