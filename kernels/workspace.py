"""Arrival counters: the workspace of kernels whose last program to finish does the final reduction
(kernels.row_max's), one launch where there would be two.

Each program of a group adds one to its group's counter; the one that finds every other arrived
reduces the group, then sets the counter back to zero. So a workspace stays zeroed between calls and
serves any number of them, and any of these kernels, one after another in stream order; two calls at
once (two streams, two graphs replaying together) must each have their own.
"""

from __future__ import annotations

import torch


def arrival_counters(count: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 counters for calls of up to `count` groups."""
    if count < 1:
        raise ValueError(f"a workspace holds at least one counter, not {count}")
    return torch.zeros(count, dtype=torch.int32, device=device)
