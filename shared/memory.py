"""Zero-filled pools that cost only what is used on the CPU."""

from __future__ import annotations

import math

import numpy as np
import torch


def zeroed(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor of `shape`. On the CPU its memory comes from calloc, whose pages the OS
    zeroes as they are first touched: a KV or context pool sized for the worst case then costs time
    and resident memory only for the blocks written (`torch.zeros` writes every page up front: 19 s of
    the default model's CPU start went to zeroing its two pools). On a GPU it is `torch.zeros`."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)
